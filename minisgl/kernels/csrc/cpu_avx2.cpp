// AVX2 + FMA path of the float CPU kernels (Zen 2/3, Intel client chips): bf16 is loaded and stored
// by 16-bit shifts, fp16 K/V pages loaded by F16C's vcvtph2ps (every AVX2 CPU has F16C), all math
// in fp32. The whole file is compiled for that target through a target
// pragma (GCC) / attribute (clang), not -march flags, so the library also loads on CPUs without
// AVX2; the dispatcher (cpu_dispatch.cpp) runs this code only after cpuid says the CPU has it.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && !defined(CPU_PORTABLE_ONLY)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace minisgl_cpu {
namespace avx2 {

struct V {
  static constexpr int VL = 8, NB = 4, MB = 2;
  using F = __m256;
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F set1(float a) { return _mm256_set1_ps(a); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static inline F load(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static inline F load(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  // Round to nearest even into the low 16 bits of each lane; NaN -> 0x7fc0 (c10::BFloat16's rule).
  static inline __m256i bf16_bits(F x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  }
  static inline void store(uint16_t* p, F x) {
    const __m256i r = bf16_bits(x);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static inline F round_bf16(F x) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F div(F a, F b) { return _mm256_div_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // exp(x) = 2^n * 2^f (n = round(x log2 e), |f| <= 1/2, 2^f by its degree-6 series in f ln 2);
  // 0 below -87 (where 2^n would be subnormal), clamped at 88.3 above; NaN stays NaN (vmin/vmax
  // return their second operand when either is NaN).
  static inline F exp(F x) {
    const F tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_set1_ps(-87.f), _mm256_min_ps(_mm256_set1_ps(88.3f), x));
    const F t = _mm256_mul_ps(x, _mm256_set1_ps(1.4426950408889634f));
    const F n = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const F fr = _mm256_sub_ps(t, n);
    F p = _mm256_set1_ps(1.5403530393381609e-4f);
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(1.3333558146428443e-3f));
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(9.6181291076284772e-3f));
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(5.5504108664821580e-2f));
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(2.4022650695910071e-1f));
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(6.9314718055994531e-1f));
    p = _mm256_fmadd_ps(p, fr, _mm256_set1_ps(1.f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};

#include "cpu_kernels_impl.h"

struct VX {
  static inline V::F max(V::F a, V::F b) { return _mm256_max_ps(a, b); }
};
#include "cpu_extend.h"
#include "cpu_sample.h"

}  // namespace avx2
}  // namespace minisgl_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
