// What the "avx512" path runs where the CPU also has AVX512-BF16 (Sapphire Rapids, Zen 4): bf16
// GEMV / small GEMM and decode attention on vdpbf16ps (pairs of bf16 products summed into fp32;
// the products of bf16 inputs are exact in fp32), and the generic kernels with vcvtneps2bf16 for
// the bf16 rounding. Compiled for that target through a target pragma / attribute, as
// cpu_avx2.cpp explains.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && !defined(CPU_PORTABLE_ONLY)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")
#endif

namespace minisgl_cpu {
namespace avx512bf16 {

static inline float f(uint16_t v) {
  const uint32_t b = static_cast<uint32_t>(v) << 16;
  float r;
  __builtin_memcpy(&r, &b, 4);
  return r;
}
static inline uint16_t bf16(float v) {
  if (v != v) return 0x7fc0;
  uint32_t b;
  __builtin_memcpy(&b, &v, 4);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline float r(float v) { return f(bf16(v)); }
static inline __m512bh ld(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
static inline __m512 bf16x16_to_ps(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
// exp as cpu_avx512.cpp's (the same operations, so both AVX-512 paths agree).
static inline __m512 exp_neg(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 fr = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// ---- GEMV / small GEMM --------------------------------------------------------------------------
static inline float dot(const uint16_t* a, const uint16_t* b, int64_t K) {
  int64_t k = 0;
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; k + 64 <= K; k += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, ld(a + k), ld(b + k));
    acc1 = _mm512_dpbf16_ps(acc1, ld(a + k + 32), ld(b + k + 32));
  }
  for (; k + 32 <= K; k += 32) acc0 = _mm512_dpbf16_ps(acc0, ld(a + k), ld(b + k));
  float s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  for (; k < K; ++k) s += f(a[k]) * f(b[k]);
  return s;
}

static inline void put(const LinearArgs& a, int64_t m, int64_t n, float s) {
  const uint16_t* bias = static_cast<const uint16_t*>(a.bias);
  static_cast<uint16_t*>(a.out)[m * a.N + n] = bf16(bias != nullptr ? r(s) + f(bias[n]) : s);
}

// Register tiles of NB weight rows x MB input rows (24 fp32 accumulators at 4 x 6): each weight
// chunk loaded from memory feeds MB dot-product instructions. K % 32 == 0.
template <int NB, int MB>
static inline void tile(const uint16_t* x, int64_t xs, const uint16_t* w, int64_t ws, int64_t K, float* res) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = ld(w + j * ws + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = ld(x + i * xs + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) res[i * NB + j] = _mm512_reduce_add_ps(acc[j][i]);
}

void linear_rows_dot(const LinearArgs& a, int64_t n0, int64_t n1) {
  constexpr int NB = 4, MB = 6;
  const uint16_t* x = static_cast<const uint16_t*>(a.x);
  const uint16_t* w = static_cast<const uint16_t*>(a.w);
  const int64_t M = a.M, K = a.K, xs = a.xs, ws = a.ws;
  float res[NB * MB];
  int64_t n = n0;
  if (M > 1 && K % 32 == 0) {
    for (; n + NB <= n1; n += NB) {
      int64_t m = 0;
      for (; m + MB <= M; m += MB) {
        tile<NB, MB>(x + m * xs, xs, w + n * ws, ws, K, res);
        for (int i = 0; i < MB; ++i)
          for (int j = 0; j < NB; ++j) put(a, m + i, n + j, res[i * NB + j]);
      }
      for (; m < M; ++m) {  // leftover input rows, one at a time
        tile<NB, 1>(x + m * xs, xs, w + n * ws, ws, K, res);
        for (int j = 0; j < NB; ++j) put(a, m, n + j, res[j]);
      }
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) put(a, m, n, dot(w + n * ws, x + m * xs, K));
}

// ---- decode attention ---------------------------------------------------------------------------
// D % 32 == 0, D <= 256, G <= 8 (attention_fits): q.k with vdpbf16ps, a vectorised two-pass
// softmax, p.v accumulated in fp32. scratch: G * Lp scores, then G * D accumulators.
bool attention_fits(int64_t D, int64_t G) { return D % 32 == 0 && D <= 256 && G <= 8; }

void attention_task_dot(const AttnArgs& a, int64_t task, float* scratch) {
  const int64_t D = a.D, G = a.G, C = D / 32, b = task / a.Hkv, h = task % a.Hkv;
  const int64_t L = a.lens[b], Lp = (L + 15) / 16 * 16;
  const int32_t* slots = a.table + a.rows[b] * a.t_sr;
  const uint16_t* kp = static_cast<const uint16_t*>(a.k);
  const uint16_t* vp = static_cast<const uint16_t*>(a.v);
  float* scores = scratch;
  float* acc = scratch + G * Lp;
  __m512bh qv[8][8];
  for (int64_t g = 0; g < G; ++g)
    for (int64_t c = 0; c < C; ++c)
      qv[g][c] = ld(static_cast<const uint16_t*>(a.q) + b * a.q_sb + (h * G + g) * a.q_sh + c * 32);
  for (int64_t i = 0; i < G * Lp; ++i) scores[i] = -__builtin_inff();
  float m[8];
  for (int64_t g = 0; g < G; ++g) m[g] = -__builtin_inff();
  for (int64_t l = 0; l < L; ++l) {
    const uint16_t* kr = kp + static_cast<int64_t>(slots[l]) * a.kv_ss + h * a.kv_sh;
    __m512bh kv[8];
    for (int64_t c = 0; c < C; ++c) kv[c] = ld(kr + c * 32);
    for (int64_t g = 0; g < G; ++g) {
      __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
      for (int64_t c = 1; c < C; ++c) s = _mm512_dpbf16_ps(s, qv[g][c], kv[c]);
      const float sc = _mm512_reduce_add_ps(s) * a.scale;
      scores[g * Lp + l] = sc;
      if (!(sc <= m[g])) m[g] = sc;  // a NaN score makes the row NaN, as in the reference
    }
  }
  float inv[8];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * Lp;
    const __m512 mv = _mm512_set1_ps(m[g]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t l = 0; l < Lp; l += 16) {  // padding holds -inf: exp gives 0
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mv));
      _mm512_storeu_ps(sg + l, e);
      sum = _mm512_add_ps(sum, e);
    }
    const float total = _mm512_reduce_add_ps(sum);
    inv[g] = total > 0.f ? 1.f / total : 0.f;
  }
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    const uint16_t* vr = vp + static_cast<int64_t>(slots[l]) * a.kv_ss + h * a.kv_sh;
    __m512 vv[16];
    for (int64_t c = 0; c < D / 16; ++c) vv[c] = bf16x16_to_ps(vr + c * 16);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 pb = _mm512_set1_ps(scores[g * Lp + l]);
      float* ag = acc + g * D;
      for (int64_t c = 0; c < D / 16; ++c)
        _mm512_storeu_ps(ag + c * 16, _mm512_fmadd_ps(pb, vv[c], _mm512_loadu_ps(ag + c * 16)));
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    uint16_t* orow = static_cast<uint16_t*>(a.out) + b * a.o_sb + (h * G + g) * a.o_sh;
    const __m512 iv = _mm512_set1_ps(inv[g]);
    for (int64_t c = 0; c < D / 16; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(orow + c * 16),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(acc + g * D + c * 16), iv)));
  }
}

// ---- the generic kernels, with vcvtneps2bf16 for the bf16 rounding -------------------------------
#define MINISGL_AVX512_BF16_CVT 1
#include "cpu_avx512_v.h"

#include "cpu_kernels_impl.h"

struct VX {
  static inline V::F max(V::F a, V::F b) { return _mm512_max_ps(a, b); }
};
#include "cpu_extend.h"
#include "cpu_sample.h"

}  // namespace avx512bf16
}  // namespace minisgl_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
