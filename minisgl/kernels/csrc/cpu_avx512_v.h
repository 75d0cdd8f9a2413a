// The AVX-512 traits struct `V` of the generic float kernels (cpu_kernels_impl.h), shared by
// cpu_avx512.cpp and cpu_avx512bf16.cpp; included inside their namespaces, under their target
// pragmas. With MINISGL_AVX512_BF16_CVT (the AVX512-BF16 file) bf16 rounding is vcvtneps2bf16,
// else integer round-to-nearest-even.
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
  static inline F load(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  // Round to nearest even into the low 16 bits of each lane; NaN -> 0x7fc0 (c10::BFloat16's rule).
  static inline __m512i bf16_bits(F x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
  }
#if defined(MINISGL_AVX512_BF16_CVT)
  // vcvtneps2bf16: round to nearest even in one instruction (denormals flush to zero).
  static inline void store(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
  }
  static inline F round_bf16(F x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
  }
#else
  static inline void store(uint16_t* p, F x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
  }
  static inline F round_bf16(F x) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }
#endif
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

