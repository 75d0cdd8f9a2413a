// The x86 GEMV of Q4_0, Q4_1 and Q8_0 (decode rows), written once over a traits struct `LW` of
// VL-float vectors (AVX2: 8, AVX-512: 16) and included by quant_avx2.cpp and quant_avx512.cpp
// inside their namespace and target pragma. quant_impl.h calls it through `gemv_lanes` when the
// caller has prepared x for it (`lanes_prep`, once per call, shared by the threads).
//
// Why a separate kernel: with fp32 activations, a Q4 weight's nibble has to become one fp32 lane.
// The generic AVX2 path expands bytes to dwords with vpmovzxbd (4 per 32-weight chunk, plus 2
// unpacks: all on the one shuffle port of Intel cores) after shifting and masking the nibbles out;
// the generic AVX-512 path looks each nibble up in a 16-float vpermps table. Here the block's 16
// bytes are broadcast to every 128-bit lane of a vector by the load itself (vbroadcasti128 /
// vbroadcasti32x4 are pure loads), and each vector of a chunk is one AND with a constant mask:
// dword lane j keeps one nibble of the 4 bytes it holds, in place (a value q << s, s < 24, exact as
// an int and as a float), then one convert. No shuffle and no shift: per 32 weights 32 / VL ANDs,
// converts and FMAs plus one FMA (the factored form d * sum(q x) + m * sum(x), as quant_impl.h's
// gemv_tile_f), and per 4 rows one vcvtph2ps for their scales and one FMA for their offsets.
//
// The weights then come out in a fixed permuted order, each scaled by 2^s: the activations are
// permuted and scaled by 2^-s to match once per call (`lanes_prep`), so each product q * x is the
// same float as the unpermuted, unscaled one (a power-of-2 scale is exact for normal floats; an
// activation below ~1e-32 would lose bits as a subnormal).
//
// The layout: a dword d (0..3) of the block's 16 bytes holds bytes 4d .. 4d + 3, i.e. 8 nibbles,
// "slots" u = 0..7: byte u >> 1, the high nibble when u is odd, element 4d + (u >> 1) + 16 (u & 1).
// Lane j of vector t holds dword j & 3 and slot u = t * VL / 4 + (j >> 2). Slots 0..3 (bytes 0, 1)
// are taken from the broadcast of the block's bytes 0 .. 15, at bit s = 4u; slots 4..7 (bytes 2, 3)
// from the broadcast of its bytes 1 .. 16 (one more unaligned load), where they sit one byte lower,
// at s = 4u - 8 < 24: so no nibble reaches the sign bit. (Byte 16 is the next block's first: past
// the matrix for its last block, where the tile shifts the first broadcast right by 8 instead.)
//
// Q8_0's bytes are expanded with vpmovsxbd from memory (one shuffle uop with its load), in natural
// order. Measured (tools/bench_cpu_quant.py --ab; docs/performance.md, "fifteenth session").

constexpr int LANES_NV = 32 / LW::VL;  // vectors per 32-element chunk

static inline int lanes_slot(int t, int j) { return t * (LW::VL / 4) + (j >> 2); }
static inline int lanes_shift(int t, int j) {
  const int u = lanes_slot(t, j);
  return u < 4 ? 4 * u : 4 * u - 8;
}

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
  if (qtype != QT_Q8_0 && M > LW::Q4_MAX_ROWS) return 0;  // the generic tiles are faster there
  return M * (K + K / 32 * 8);
}

// xq[m][K]: permuted, scaled x (Q4) or x itself (Q8_0); then sxi[m][K / 32][8]: the offset
// term's factors per chunk, multiplied lane by lane with 4 rows' fp16 pairs (d0, m0, d1, m1, ..):
// Q4_1 (0, sum x) x 4 (w = d * q + m), Q4_0 (-8 * sum x, 0) x 4 (w = d * q - 8 d), Q8_0 zeros.
static void lanes_prep(int qtype, const float* x, int64_t M, int64_t K, float* out) {
  const int64_t nc = K / 32;
  __m128 scale[8];  // of slot u: 2^-s, s = 4u (u < 4) or 4u - 8
  for (int u = 0; u < 8; ++u) scale[u] = _mm_set1_ps(1.f / (float)(1u << (u < 4 ? 4 * u : 4 * u - 8)));
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    float* xq = out + m * K;
    float* sxi = out + M * K + m * nc * 8;
    for (int64_t c = 0; c < nc; ++c) {
      const float* xc = xr + 32 * c;
      LW::F sv = LW::load(xc);
      for (int v = 1; v < LANES_NV; ++v) sv = LW::add(sv, LW::load(xc + v * LW::VL));
      const float sum = LW::hsum(sv);
      for (int l = 0; l < 4; ++l) {
        sxi[8 * c + 2 * l] = qtype == QT_Q4_0 ? -8.f * sum : 0.f;
        sxi[8 * c + 2 * l + 1] = qtype == QT_Q4_1 ? sum : 0.f;
      }
      if (qtype == QT_Q8_0) {
        memcpy(xq + 32 * c, xc, 32 * sizeof(float));
        continue;
      }
      // In memory, a chunk's vectors are the 8 slots' 4 lanes (d = 0..3) one after another, for
      // either VL: slot u = 2b + h holds x[4d + b + 16h], column b of the 4x4 matrix x[16h ..].
      __m128 lo[4], hi[4];
      for (int d = 0; d < 4; ++d) lo[d] = _mm_loadu_ps(xc + 4 * d), hi[d] = _mm_loadu_ps(xc + 16 + 4 * d);
      _MM_TRANSPOSE4_PS(lo[0], lo[1], lo[2], lo[3]);
      _MM_TRANSPOSE4_PS(hi[0], hi[1], hi[2], hi[3]);
      for (int b = 0; b < 4; ++b) {
        _mm_storeu_ps(xq + 32 * c + 8 * b, _mm_mul_ps(lo[b], scale[2 * b]));
        _mm_storeu_ps(xq + 32 * c + 8 * b + 4, _mm_mul_ps(hi[b], scale[2 * b + 1]));
      }
    }
  }
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
// terms summed by one FMA (lanes 2r, 2r + 1 of `off`). END: the tile holds the matrix's last row,
// whose last block has no byte 16 to read (see the layout above).
template <int QT, int NR, int MR, bool END>
static inline void lanes_tile(const uint8_t* w, int64_t rb, const float* xq, const float* sxi, int64_t K,
                              float* y, int64_t N, int64_t n) {
  using F = LW::F;
  constexpr int BYTES = QT == QT_Q8_0 ? 34 : (QT == QT_Q4_1 ? 20 : 18);
  constexpr int QOFF = QT == QT_Q4_1 ? 4 : 2;
  constexpr int NV = LANES_NV;
  const int64_t nc = K / 32;
  constexpr bool PF = LANES_PREFETCH;
  LW::Iv mask[NV];
  for (int t = 0; t < NV; ++t) {
    alignas(64) int32_t bitsv[LW::VL];
    for (int j = 0; j < LW::VL; ++j) bitsv[j] = 0xF << lanes_shift(t, j);
    mask[t] = LW::load_i(bitsv);
  }
  F acc[NR][MR];
  __m256 off[MR];
  for (int i = 0; i < MR; ++i) {
    off[i] = _mm256_setzero_ps();
    for (int r = 0; r < NR; ++r) acc[r][i] = LW::zero();
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
      const F d = LW::bcast(dmf + 2 * r);
      F q[NV];
      if (QT == QT_Q8_0) {
        for (int t = 0; t < NV; ++t) q[t] = LW::sext8(b + QOFF + LW::VL * t);
      } else {
        const LW::Iv b0 = LW::bcast16(b + QOFF);
        const LW::Iv b1 = END ? LW::srl8(b0) : LW::bcast16(b + QOFF + 1);
        for (int t = 0; t < NV; ++t) q[t] = LW::cvt_and(t < NV / 2 ? b0 : b1, mask[t]);
      }
      for (int i = 0; i < MR; ++i) {
        const float* xp = xq + i * K + 32 * c;
        F p = LW::mul(q[0], LW::load(xp));
        for (int t = 1; t < NV; ++t) p = LW::fma(q[t], LW::load(xp + t * LW::VL), p);
        acc[r][i] = LW::fma(d, p, acc[r][i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_store_ps(dmf, off[i]);
    for (int r = 0; r < NR; ++r) y[i * N + n + r] = LW::hsum(acc[r][i]) + (dmf[2 * r] + dmf[2 * r + 1]);
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
