// AVX-512 (F/BW/VL/DQ + FMA) path of the float CPU kernels: the generic kernels with 16 lanes,
// bf16 loaded and stored by shifts. Compiled for that target through a target pragma / attribute,
// as cpu_avx2.cpp explains. Where the CPU also has AVX512-BF16, the dispatcher sends bf16 GEMV /
// small GEMM and decode attention to cpu_avx512bf16.cpp instead (vdpbf16ps dot products).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && !defined(CPU_PORTABLE_ONLY)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif

namespace minisgl_cpu {
namespace avx512 {

struct V {
  static constexpr int VL = 16, NB = 4, MB = 4;
  using F = __m512;
  static inline F zero() { return _mm512_setzero_ps(); }
  static inline F set1(float a) { return _mm512_set1_ps(a); }
  static inline F load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static inline F load(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  // Round to nearest even into the low 16 bits of each lane; NaN -> 0x7fc0 (c10::BFloat16's rule).
  static inline __m512i bf16_bits(F x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  }
  static inline void store(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  static inline F round_bf16(F x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
  static inline F add(F a, F b) { return _mm512_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm512_div_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(F a) { return _mm512_reduce_add_ps(a); }
  // exp(x) = 2^n * 2^f as in cpu_avx2.cpp, scaled by vscalefps (overflow -> inf, exp(-104) -> 0).
  // NaN stays NaN (vmaxps returns its second operand when either is NaN).
  static inline F exp(F x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
    const F t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
    const F n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F fr = _mm512_sub_ps(t, n);
    F p = _mm512_set1_ps(1.5403530393381609e-4f);
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(9.6181291076284772e-3f));
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(5.5504108664821580e-2f));
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(2.4022650695910071e-1f));
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(6.9314718055994531e-1f));
    p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
  }
};

#include "cpu_kernels_impl.h"

}  // namespace avx512
}  // namespace minisgl_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
