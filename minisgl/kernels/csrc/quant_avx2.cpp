// AVX2 + FMA + F16C path of the quantized CPU kernels (Zen 2/3, Intel client chips), compiled for
// that target through a target pragma / attribute, as quant_avx512.cpp explains.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#if defined(__x86_64__) && !defined(QUANT_PORTABLE_ONLY)
#include <immintrin.h>

#include "quant_types.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

namespace minisgl_quant {
namespace avx2 {

struct V {
  static constexpr int VL = 8;
  static constexpr int GEMM_NRB = 6;  // 2 x 6 accumulators + 2 x + 1 broadcast of 16 registers
  static constexpr bool GEMV_FACTORED = true;  // quant_impl.h: gemv_tile_f
  using F = __m256;
  using I = __m128i;
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F set1(float a) { return _mm256_set1_ps(a); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, F a) { _mm256_storeu_ps(p, a); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(F a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static inline I load16(const uint8_t* p) { return _mm_loadu_si128((const __m128i*)p); }
  static inline I shr_mask(I a, int s, int m) {
    return _mm_and_si128(_mm_srl_epi16(a, _mm_cvtsi32_si128(s)), _mm_set1_epi8((char)m));
  }
  static inline I or_shl4(I a, I b) { return _mm_or_si128(a, _mm_slli_epi16(b, 4)); }
  static inline I sub_i8(I a, int c) { return _mm_sub_epi8(a, _mm_set1_epi8((char)c)); }
  static inline void cvt_u8(I a, F* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(a, a)));
  }
  static inline void cvt_i8(I a, F* out) {
    out[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    out[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a)));
  }
  static inline float h2f(uint16_t h) { return _cvtsh_ss(h); }
  static inline __m128 h2f_4bytes(const uint8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(v));
  }
  static inline float h2f_lo(const uint8_t* p) { return _mm_cvtss_f32(h2f_4bytes(p)); }
  static inline void h2f_pair(const uint8_t* p, float* out) { _mm_storel_pi((__m64*)out, h2f_4bytes(p)); }
#include "quant_nibbles.h"  // nib_map, nibbles, nibbles_sel over the primitives above
};

// The vectors of quant_gemv_lanes.h.
struct LW {
  static constexpr int VL = 8;
  // Q4 GEMVs of up to this many rows take the lanes: as fast as the generic tiles or faster at
  // every row count (1.0-1.1x at 4 and 11 rows).
  static constexpr int64_t Q4_MAX_ROWS = 1 << 30;
  using F = __m256;
  using Iv = __m256i;
  static inline F zero() { return _mm256_setzero_ps(); }
  static inline F load(const float* p) { return _mm256_loadu_ps(p); }
  static inline Iv load_i(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static inline F bcast(const float* p) { return _mm256_broadcast_ss(p); }
  static inline F add(F a, F b) { return _mm256_add_ps(a, b); }
  static inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static inline F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(F a) { return V::hsum(a); }
  static inline Iv bcast16(const uint8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)p)); }
  static inline Iv srl8(Iv a) { return _mm256_srli_epi32(a, 8); }
  static inline F cvt_and(Iv a, Iv m) { return _mm256_cvtepi32_ps(_mm256_and_si256(a, m)); }
  static inline F sext8(const uint8_t* p) {  // VL int8 -> floats (vpmovsxbd from memory)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
  }
};

#include "quant_gemv_lanes.h"  // lanes_prep_floats, lanes_prep, gemv_lanes (Q4_0, Q4_1, Q8_0)

}  // namespace avx2
}  // namespace minisgl_quant

#define QUANT_ISA_NS avx2
#define QUANT_GEMV_LANES 1  // quant_impl.h: gemv, gemv_prep_floats, gemv_prep
#include "quant_impl.h"

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
