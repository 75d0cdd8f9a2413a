
#include <torch/extension.h>
#include <cmath>
#if defined(__AVX512BF16__)
#include <immintrin.h>
// exp(x) (x <= 0 in softmax after the max shift; larger x is fine up to overflow to inf):
// 2^(x log2 e) = 2^n * 2^f, n = round, |f| <= 1/2, 2^f by its degree-6 Taylor series in f ln 2
// (truncation ~1e-7 relative), scaled by 2^n.
static inline __m512 exp_neg(__m512 x) {
  // NaN stays NaN (vmaxps returns its second operand when either is NaN); exp(-104) rounds to 0.
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 fr = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_ps(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// fp32 -> bf16 (round to nearest even) -> fp32, 16 lanes: the reference's rounding points.
static inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif
