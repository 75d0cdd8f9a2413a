// The AVX2 GEMV of Q4_0, Q4_1 and Q8_0 (decode rows), included by quant_avx2.cpp inside its
// namespace and target pragma. quant_impl.h calls it through `gemv_lanes` when the caller has
// prepared x for it (`lanes_prep`, once per call, shared by the threads).
//
// Why a separate kernel: with fp32 activations, a Q4 weight's nibble has to become one fp32 lane.
// The generic path expands bytes to dwords with vpmovzxbd (4 per 32-weight chunk, plus 2 unpacks:
// all on the one shuffle port of Intel cores) after shifting and masking the nibbles out. Here the
// block's 16 bytes are broadcast to both 128-bit halves of a ymm by the load itself (vbroadcasti128
// is a pure load), and each of the 4 vectors of a chunk is one AND with a constant mask: dword
// lane j keeps one nibble of the 4 bytes it holds, in place (a value q << s, s < 24, exact as an
// int and as a float), then one convert. No shuffle and no shift: per 32 weights 4 ANDs, 4
// converts and 5 FMAs (the factored form d * sum(q x) + m * sum(x), as quant_impl.h's
// gemv_tile_f), and per 4 rows one vcvtph2ps for their scales and one FMA for their offsets.
//
// The weights then come out in a fixed permuted order, each scaled by 2^s: the activations are
// permuted and scaled by 2^-s to match once per call (`lanes_prep`), so each product q * x is the
// same float as the unpermuted, unscaled one (a power-of-2 scale is exact for normal floats; an
// activation below ~1e-32 would lose bits as a subnormal).
//
// Vector t (0..3) of a chunk, dword lane j (0..7): element e = 4 * (j & 3) + t + 16 * (j >> 2)
// of the block (byte 4 * (j & 3) + t, the low nibble for j < 4, the high one for j >= 4), held at
// bit s = 8 * t + 4 * (j >> 2) for t < 3. Byte 3 of a dword would put the high nibble in the sign
// bit, so vector 3 is taken from the block's bytes 1 .. 16 (one more unaligned broadcast load),
// where byte 4 * (j & 3) + 3 sits at bit 16: s = 16 + 4 * (j >> 2).
//
// Q8_0's bytes are expanded with vpmovsxbd from memory (one shuffle uop with its load), in natural
// order. Measured (tools/bench_cpu_quant.py --ab, docs/performance.md "fifteenth session"): the
// loop runs at ~5.5 cycles per 32 weights on Sapphire Rapids, close to its 9.5 FMA-port uops.

static inline int lanes_elem(int t, int j) { return 4 * (j & 3) + t + 16 * (j >> 2); }
static inline int lanes_shift(int t, int j) { return (t < 3 ? 8 * t : 16) + 4 * (j >> 2); }

#ifndef LANES_PREFETCH
#define LANES_PREFETCH 1
#endif
#ifndef LANES_PF_TILES
#define LANES_PF_TILES 2
#endif

static inline bool lanes_type(int qtype) { return qtype == QT_Q4_0 || qtype == QT_Q4_1 || qtype == QT_Q8_0; }

// Floats of the prepared x for M rows of K: per row K permuted (Q4) or copied (Q8_0) values, then
// per 32-element chunk 8 floats for the offset term (see lanes_tile); 0 for a type without lanes.
static inline int64_t lanes_prep_floats(int qtype, int64_t M, int64_t K) {
  if (!lanes_type(qtype) || K % 32 != 0) return 0;
  return M * (K + K / 32 * 8);
}

// xq[m][K]: permuted, scaled x (Q4) or x itself (Q8_0); then sxi[m][K / 32][8]: the offset
// term's factors per chunk, multiplied lane by lane with 4 rows' fp16 pairs (d0, m0, d1, m1, ..):
// Q4_1 (0, sum x) x 4 (w = d * q + m), Q4_0 (-8 * sum x, 0) x 4 (w = d * q - 8 d), Q8_0 zeros.
static void lanes_prep(int qtype, const float* x, int64_t M, int64_t K, float* out) {
  const int64_t nc = K / 32;
  float scale[4][8];
  int elem[4][8];
  for (int t = 0; t < 4; ++t)
    for (int j = 0; j < 8; ++j) scale[t][j] = 1.f / (float)(1u << lanes_shift(t, j)), elem[t][j] = lanes_elem(t, j);
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* xq = out + m * K;
    float* sxi = out + M * K + m * nc * 8;
    for (int64_t c = 0; c < nc; ++c) {
      const float* xc = xr + 32 * c;
      __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xc), _mm256_loadu_ps(xc + 8)),
                               _mm256_add_ps(_mm256_loadu_ps(xc + 16), _mm256_loadu_ps(xc + 24)));
      __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
      h = _mm_add_ps(h, _mm_movehl_ps(h, h));
      const float sum = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
      for (int l = 0; l < 4; ++l) {
        sxi[8 * c + 2 * l] = qtype == QT_Q4_0 ? -8.f * sum : 0.f;
        sxi[8 * c + 2 * l + 1] = qtype == QT_Q4_1 ? sum : 0.f;
      }
      if (qtype == QT_Q8_0) {
        memcpy(xq + 32 * c, xc, 32 * sizeof(float));
        continue;
      }
      for (int t = 0; t < 4; ++t)
        for (int j = 0; j < 8; ++j) xq[32 * c + 8 * t + j] = xc[elem[t][j]] * scale[t][j];
    }
  }
}

static inline __m256i lanes_mask(int t) {
  const int lo = 0xF << (8 * t), hi = 0xF << (8 * t + 4);
  return _mm256_setr_epi32(lo, lo, lo, lo, hi, hi, hi, hi);
}

static inline float lanes_hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The fp16 scale pairs (d, m) (PAIR) or scales d (with a zero upper half: 0.0) of NR (<= 4) rows'
// blocks at b, b + rb, ..: the dwords of one vector, inserted from memory (no stack round trip).
template <bool PAIR, int NR>
static inline __m128i lanes_scales(const uint8_t* b, int64_t rb) {
  int32_t v0 = 0;
  memcpy(&v0, b, PAIR ? 4 : 2);
  __m128i v = _mm_cvtsi32_si128(v0);
  for (int r = 1; r < NR; ++r) {
    const uint8_t* p = b + r * rb;
    if (PAIR) {
      int32_t d;
      memcpy(&d, p, 4);
      v = r == 1 ? _mm_insert_epi32(v, d, 1) : r == 2 ? _mm_insert_epi32(v, d, 2) : _mm_insert_epi32(v, d, 3);
    } else {
      uint16_t d;
      memcpy(&d, p, 2);
      v = r == 1 ? _mm_insert_epi16(v, d, 2) : r == 2 ? _mm_insert_epi16(v, d, 4) : _mm_insert_epi16(v, d, 6);
    }
  }
  return v;
}

// NR (<= 4) weight rows x MR activation rows from row n: y[m][n + r] for m < MR (y, xq, sxi at
// row m0). Per chunk, the NR rows' fp16 scales are converted by one vcvtph2ps and their offset
// terms summed by one FMA (lanes 2r, 2r + 1 of `off`). Vector 3 of a Q4 chunk is the broadcast of
// the block's bytes 1 .. 16 (byte 4 * (j & 3) + 3 at bit 16 of each dword: mask 2, no shift); byte
// 16 is the next block's first, past the matrix for its last block: END (a tile that holds the
// matrix's last row) shifts the bytes instead.
template <int QT, int NR, int MR, bool END>
static inline void lanes_tile(const uint8_t* w, int64_t rb, const float* xq, const float* sxi, int64_t K,
                              float* y, int64_t N, int64_t n) {
  constexpr int BYTES = QT == QT_Q8_0 ? 34 : (QT == QT_Q4_1 ? 20 : 18);
  constexpr int QOFF = QT == QT_Q4_1 ? 4 : 2;
  const int64_t nc = K / 32;
  constexpr bool PF = LANES_PREFETCH;
  const __m256i m0 = lanes_mask(0), m1 = lanes_mask(1), m2 = lanes_mask(2);
  __m256 acc[NR][MR], off[MR];
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm256_setzero_ps();
    for (int r = 0; r < NR; ++r) acc[r][i] = _mm256_setzero_ps();
  }
  const uint8_t* row = w + n * rb;
  alignas(32) float dmf[8];
  for (int64_t c = 0; c < nc; ++c) {
    const __m256 dm = _mm256_cvtph_ps(lanes_scales<QT == QT_Q4_1, NR>(row + c * BYTES, rb));
    if (QT != QT_Q8_0)
      for (int i = 0; i < MR; ++i) off[i] = _mm256_fmadd_ps(dm, _mm256_loadu_ps(sxi + i * nc * 8 + 8 * c), off[i]);
    _mm256_store_ps(dmf, dm);
    for (int r = 0; r < NR; ++r) {
      const uint8_t* b = row + r * rb + c * BYTES;
      if (PF) __builtin_prefetch(b + LANES_PF_TILES * NR * rb);  // the rows LANES_PF_TILES tiles on (contiguous)
      const __m256 d = _mm256_broadcast_ss(dmf + 2 * r);
      __m256 q[4];
      if (QT == QT_Q8_0) {
        for (int t = 0; t < 4; ++t)
          q[t] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b + QOFF + 8 * t))));
      } else {
        const __m256i bb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + QOFF)));
        q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(bb, m0));
        q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(bb, m1));
        q[2] = _mm256_cvtepi32_ps(_mm256_and_si256(bb, m2));
        const __m256i b3 = END ? _mm256_srli_epi32(bb, 8)
                               : _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(b + QOFF + 1)));
        q[3] = _mm256_cvtepi32_ps(_mm256_and_si256(b3, m2));
      }
      for (int i = 0; i < MR; ++i) {
        const float* xp = xq + i * K + 32 * c;
        __m256 p = _mm256_mul_ps(q[0], _mm256_loadu_ps(xp));
        p = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xp + 8), p);
        p = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xp + 16), p);
        p = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xp + 24), p);
        acc[r][i] = _mm256_fmadd_ps(d, p, acc[r][i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(dmf, off[i]);
    for (int r = 0; r < NR; ++r) y[i * N + n + r] = lanes_hsum(acc[r][i]) + (dmf[2 * r] + dmf[2 * r + 1]);
  }
}

template <int QT, int MR>
static void lanes_rows(const uint8_t* w, int64_t rb, const float* xq, const float* sxi, int64_t K, float* y,
                       int64_t N, int64_t n0, int64_t n1) {
  constexpr int NR = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) {
    if (n + NR < N) lanes_tile<QT, NR, MR, false>(w, rb, xq, sxi, K, y, N, n);
    else lanes_tile<QT, NR, MR, true>(w, rb, xq, sxi, K, y, N, n);
  }
  for (; n < n1; ++n) {
    if (n + 1 < N) lanes_tile<QT, 1, MR, false>(w, rb, xq, sxi, K, y, N, n);
    else lanes_tile<QT, 1, MR, true>(w, rb, xq, sxi, K, y, N, n);
  }
}

template <int QT>
static void lanes_gemv(const uint8_t* w, int64_t rb, const float* prep, int64_t M, int64_t K, float* y,
                       int64_t N, int64_t n0, int64_t n1) {
  const int64_t nc = K / 32;
  for (int64_t nb = n0; nb < n1; nb += 16) {  // 16-row blocks, activation rows inner (as gemv_q)
    const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
      lanes_rows<QT, 4>(w, rb, prep + m * K, prep + M * K + m * nc * 8, K, y + m * N, N, nb, ne);
    const float* xq = prep + m * K;
    const float* sxi = prep + M * K + m * nc * 8;
    switch (M - m) {
      case 3: lanes_rows<QT, 3>(w, rb, xq, sxi, K, y + m * N, N, nb, ne); break;
      case 2: lanes_rows<QT, 2>(w, rb, xq, sxi, K, y + m * N, N, nb, ne); break;
      case 1: lanes_rows<QT, 1>(w, rb, xq, sxi, K, y + m * N, N, nb, ne); break;
      default: break;
    }
  }
}

// Rows [n0, n1) of y = x W^T from the prepared x; false for a type this kernel does not take.
static inline bool gemv_lanes(int qtype, const uint8_t* w, int64_t rb, const float* prep, int64_t M, int64_t K,
                              float* y, int64_t N, int64_t n0, int64_t n1) {
  switch (qtype) {
    case QT_Q4_0: lanes_gemv<QT_Q4_0>(w, rb, prep, M, K, y, N, n0, n1); return true;
    case QT_Q4_1: lanes_gemv<QT_Q4_1>(w, rb, prep, M, K, y, N, n0, n1); return true;
    case QT_Q8_0: lanes_gemv<QT_Q8_0>(w, rb, prep, M, K, y, N, n0, n1); return true;
    default: return false;
  }
}
