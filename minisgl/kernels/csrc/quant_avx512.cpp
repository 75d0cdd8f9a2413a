// AVX-512 (F/BW/VL + FMA + F16C) path of the quantized CPU kernels. The whole TU is compiled for
// that target through a target pragma (GCC) / attribute (clang) applied to every function defined
// below, not through -march flags, so the library also loads on CPUs without AVX-512; the caller
// (quant_dispatch.cpp) runs this code only after cpuid says the CPU has it. No std or torch code is
// defined under the target, so no AVX-512 instance of a shared inline function can be linked in.
// VNNI / AVX512-BF16 are not used: the activations stay fp32 (never quantized), so the work is
// fp32 FMAs on dequantized weights, where integer or bf16 dot products do not apply.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && !defined(QUANT_PORTABLE_ONLY)
#include <immintrin.h>

#include "quant_types.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#endif

namespace minisgl_quant {
namespace avx512 {

struct V {
  static constexpr int VL = 16;
  static constexpr int GEMM_NRB = 12;  // 2 x 12 accumulators + 2 x + 1 broadcast of 32 registers
  static constexpr bool GEMV_FACTORED = false;  // quant_impl.h: gemv_tile_f
  using F = __m512;
  using I = __m128i;
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F set1(float a) { return _mm512_set1_ps(a); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static inline I load16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
  static inline I shr_mask(I a, int s, int m) {
    return _mm_and_si128(_mm_srl_epi16(a, _mm_cvtsi32_si128(s)), _mm_set1_epi8((char)m));
  }
  static inline I or_shl4(I a, I b) { return _mm_or_si128(a, _mm_slli_epi16(b, 4)); }
  static inline I sub_i8(I a, int c) { return _mm_sub_epi8(a, _mm_set1_epi8((char)c)); }
  static inline void cvt_u8(I a, F* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a)); }
  static inline void cvt_i8(I a, F* out) { out[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)); }
  static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static inline __m128 h2f_4bytes(const uint8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
  }
  static inline float h2f_lo(const uint8_t* p) { return _mm_cvtss_f32(h2f_4bytes(p)); }
  static inline void h2f_pair(const uint8_t* p, float* out) { _mm_storel_pi((__m64*)out, h2f_4bytes(p)); }
  // A nibble indexes a 16-float table (vpermps reads the low 4 bits of each index lane), built
  // once per (sub-)block with the reference's operations: one permute per 16 weights instead of
  // a convert and one or two FP ops.
  template <int MAP> static inline F lut(float d, float m) {
    const F iota = MAP == NIB_Q4_0 ? _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7)
                                   : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const F t = _mm512_mul_ps(_mm512_set1_ps(d), iota);
    if (MAP == NIB_MUL_ADD) return _mm512_add_ps(t, _mm512_set1_ps(m));
    if (MAP == NIB_MUL_SUB) return _mm512_sub_ps(t, _mm512_set1_ps(m));
    return t;
  }
  template <int MAP> static inline void nibbles(I q, float d, float m, F* lo, F* hi) {
    const F table = lut<MAP>(d, m);
    const __m512i z = _mm512_cvtepu8_epi32(q);
    lo[0] = _mm512_permutexvar_ps(z, table);
    hi[0] = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), table);
  }
  template <int MAP> static inline void nibbles_sel(I q, int high, float d, float m, F* out) {
    __m512i z = _mm512_cvtepu8_epi32(q);
    if (high) z = _mm512_srli_epi32(z, 4);
    out[0] = _mm512_permutexvar_ps(z, lut<MAP>(d, m));
  }
};

// The vectors of quant_gemv_lanes.h.
struct LW {
  static constexpr int VL = 16;
  // Q4 GEMVs of up to this many rows take the lanes: past 2 activation rows the vpermps tiles
  // are faster (the lanes 0.8-0.95x at 4 and 11 rows).
  static constexpr int64_t Q4_MAX_ROWS = 2;
  using F = __m512;
  using Iv = __m512i;
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline Iv load_i(const int32_t* p) { return _mm512_loadu_si512(p); }
  static inline F bcast(const float* p) { return _mm512_set1_ps(*p); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
  static inline Iv bcast16(const uint8_t* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)p)); }
  static inline Iv srl8(Iv a) { return _mm512_srli_epi32(a, 8); }
  static inline F cvt_and(Iv a, Iv m) { return _mm512_cvtepi32_ps(_mm512_and_si512(a, m)); }
  static inline F sext8(const uint8_t* p) {  // VL int8 -> floats (vpmovsxbd from memory)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
  }
};

#include "quant_gemv_lanes.h"  // lanes_prep_floats, lanes_prep, gemv_lanes (Q4_0, Q4_1, Q8_0)

}  // namespace avx512
}  // namespace minisgl_quant

#define QUANT_ISA_NS avx512
#define QUANT_GEMV_LANES 1  // quant_impl.h: gemv, gemv_prep_floats, gemv_prep
#include "quant_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
