// Weight-only quantized GEMV / GEMM over GGUF blocks, written once over an ISA traits struct `V`.
//
// Included by each ISA translation unit (quant_avx512.cpp, quant_avx2.cpp, quant_portable.cpp)
// after it has defined `V` and `QUANT_ISA_NS`; everything here lands in that namespace, so the
// three instantiations never share a symbol (no ODR merging of code built for different ISAs).
// The including TU has already included <cstdint>, <cstdlib>, <cstring>: no std templates are
// used here, so nothing compiled under an ISA's target attributes can leak into another TU.
//
// V provides: F (a vector of V::VL floats), I (16 bytes), and
//   zero, set1, load, store, add, sub, mul, fma(a, b, c) = a*b + c, hsum,
//   load16, shr_mask(v, s, m) = (v >> s) & m per byte, or_shl4(a, b) = a | (b << 4) per byte,
//   sub_i8(v, c) per byte, cvt_u8 / cvt_i8 (16 bytes -> 16 / VL vectors), h2f (fp16 bits -> float),
//   h2f_lo(p) / h2f_pair(p, out) (the fp16 at p / the two at p, reading 4 bytes),
//   nibbles<MAP>(16 bytes, d, m, lo, hi): the low and the high nibbles through one of the NIB_*
//   maps (quant_types.h), nibbles_sel<MAP>(16 bytes, high, d, m, out): one of the two.
//
// Each quant type dequantizes a 32-element chunk of a block into NV = 32 / VL vectors with the
// same float operations, in the same order, as gguf.quants.dequantize (the build uses
// -ffp-contract=off), so the weights the kernels multiply are bit-identical to the reference's;
// only the summation order of the dot products differs.

#include "quant_types.h"

namespace minisgl_quant {
namespace QUANT_ISA_NS {

constexpr int NV = 32 / V::VL;  // vectors per 32-element chunk
using F = V::F;
using I = V::I;

static inline uint16_t rd16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return h;
}

// ---- per-type block decoding: scales() once per block into SC floats, chunk(c) for c < NC ------
// The fp16/6-bit scales are decoded by a separate pass over a group of blocks (GEMV) into a small
// buffer, so the dequantizing loop broadcasts them from L1 instead of converting each in registers.

struct Q8_0 {
  static constexpr int QK = 32, BYTES = 34, NC = 1, SC = 1;
  static inline void scales(const uint8_t* b, float* s) { s[0] = V::h2f_lo(b); }
  static inline void chunk(const uint8_t* b, const float* s, int, F* out) {
    const F d = V::set1(s[0]);
    V::cvt_i8(V::load16(b + 2), out);
    V::cvt_i8(V::load16(b + 18), out + NV / 2);
    for (int v = 0; v < NV; ++v) out[v] = V::mul(out[v], d);  // q * d
  }
  // Factored form (gemv_tile_f): w = a * q + b per 32-element chunk, q the block's integers.
  static constexpr bool FACTORED = true, OFFSET = false;
  static inline void ints(const uint8_t* b, int, F* out) {
    V::cvt_i8(V::load16(b + 2), out);
    V::cvt_i8(V::load16(b + 18), out + NV / 2);
  }
  static inline float a(const float* s, int) { return s[0]; }
  static inline float b(const float*, int) { return 0.f; }
};

struct Q4_0 {
  static constexpr int QK = 32, BYTES = 18, NC = 1, SC = 1;
  static inline void scales(const uint8_t* b, float* s) { s[0] = V::h2f_lo(b); }
  static inline void chunk(const uint8_t* b, const float* s, int, F* out) {
    // elements 0..15: low nibbles, 16..31: high nibbles; d * (q - 8)
    V::template nibbles<NIB_Q4_0>(V::load16(b + 2), s[0], 0.f, out, out + NV / 2);
  }
  static constexpr bool FACTORED = true, OFFSET = false;
  static inline void ints(const uint8_t* b, int, F* out) {  // q - 8, in bytes
    const I q = V::load16(b + 2);
    V::cvt_i8(V::sub_i8(V::shr_mask(q, 0, 0x0F), 8), out);
    V::cvt_i8(V::sub_i8(V::shr_mask(q, 4, 0x0F), 8), out + NV / 2);
  }
  static inline float a(const float* s, int) { return s[0]; }
  static inline float b(const float*, int) { return 0.f; }
};

struct Q4_1 {
  static constexpr int QK = 32, BYTES = 20, NC = 1, SC = 2;
  static inline void scales(const uint8_t* b, float* s) { V::h2f_pair(b, s); }
  static inline void chunk(const uint8_t* b, const float* s, int, F* out) {
    V::template nibbles<NIB_MUL_ADD>(V::load16(b + 4), s[0], s[1], out, out + NV / 2);  // (d * q) + m
  }
  static constexpr bool FACTORED = true, OFFSET = true;
  static inline void ints(const uint8_t* b, int, F* out) {
    const I q = V::load16(b + 4);
    V::cvt_u8(V::shr_mask(q, 0, 0x0F), out);
    V::cvt_u8(V::shr_mask(q, 4, 0x0F), out + NV / 2);
  }
  static inline float a(const float* s, int) { return s[0]; }
  static inline float b(const float* s, int) { return s[1]; }
};

// Q4_K super-block (256): d, dmin (fp16), 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32,
// 128 bytes of nibbles: sub-block c reads bytes 32*(c/2).. (low nibbles for even c, high for odd).
struct Q4_K {
  static constexpr int QK = 256, BYTES = 144, NC = 8, SC = 16;
  static inline void scales(const uint8_t* b, float* s) {  // s[j] = d * sc_j, s[8 + j] = dmin * m_j
    float dd[2];
    V::h2f_pair(b, dd);
    const uint8_t* q = b + 4;
    for (int j = 0; j < 4; ++j) {
      s[j] = dd[0] * (float)(q[j] & 63);
      s[8 + j] = dd[1] * (float)(q[j + 4] & 63);
      s[j + 4] = dd[0] * (float)((q[j + 8] & 0x0F) | ((q[j] >> 2) & 0x30));
      s[12 + j] = dd[1] * (float)((q[j + 8] >> 4) | ((q[j + 4] >> 2) & 0x30));
    }
  }
  static inline void chunk(const uint8_t* b, const float* s, int ci, F* out) {
    const uint8_t* q = b + 16 + 32 * (ci >> 1);
    // (d*sc) * q - dmin*m
    V::template nibbles_sel<NIB_MUL_SUB>(V::load16(q), ci & 1, s[ci], s[8 + ci], out);
    V::template nibbles_sel<NIB_MUL_SUB>(V::load16(q + 16), ci & 1, s[ci], s[8 + ci], out + NV / 2);
  }
  static constexpr bool FACTORED = true, OFFSET = true;
  static inline void ints(const uint8_t* b, int ci, F* out) {
    const uint8_t* q = b + 16 + 32 * (ci >> 1);
    const int sh = 4 * (ci & 1);
    V::cvt_u8(V::shr_mask(V::load16(q), sh, 0x0F), out);
    V::cvt_u8(V::shr_mask(V::load16(q + 16), sh, 0x0F), out + NV / 2);
  }
  static inline float a(const float* s, int ci) { return s[ci]; }
  static inline float b(const float* s, int ci) { return -s[8 + ci]; }
};

// Q6_K super-block (256): ql[128] low nibbles, qh[64] 2-bit highs, 16 int8 scales (one per 16
// elements), d (fp16). Chunk c = 4*h + g: low nibbles from ql[64h + 32*(g&1) ..] shifted by
// 4*(g>>1), high bits from qh[32h ..] shifted by 2g; q = that - 32; w = (d * scale) * q.
struct Q6_K {
  static constexpr int QK = 256, BYTES = 210, NC = 8, SC = 16;
  static inline void scales(const uint8_t* b, float* s) {
    const float d = V::h2f(rd16(b + 208));
    for (int j = 0; j < 16; ++j) s[j] = d * (float)(int8_t)b[192 + j];
  }
  static inline void chunk(const uint8_t* b, const float* s, int ci, F* out) {
    const int h = ci >> 2, g = ci & 3;
    const uint8_t* ql = b + 64 * h + 32 * (g & 1);
    const uint8_t* qh = b + 128 + 32 * h;
    const int sl = 4 * (g >> 1), sh = 2 * g;
    for (int e = 0; e < 2; ++e) {
      const I lo = V::shr_mask(V::load16(ql + 16 * e), sl, 0x0F);
      const I hi = V::shr_mask(V::load16(qh + 16 * e), sh, 0x03);
      F* o = out + e * (NV / 2);
      V::cvt_i8(V::sub_i8(V::or_shl4(lo, hi), 32), o);
      const F d = V::set1(s[2 * ci + e]);
      for (int v = 0; v < NV / 2; ++v) o[v] = V::mul(d, o[v]);
    }
  }
  static constexpr bool FACTORED = false, OFFSET = false;  // two scales per chunk: gemv_tile
  static inline void ints(const uint8_t*, int, F*) {}
  static inline float a(const float*, int) { return 0.f; }
  static inline float b(const float*, int) { return 0.f; }
};

// ---- GEMV: NR weight rows x MR activation rows per tile, weights dequantized in registers ------

template <class Q, int NR, int MR>
static inline void gemv_tile(const uint8_t* w, int64_t rb, const float* x, int64_t K, float* y,
                             int64_t N, int64_t n, int64_t m0) {
  constexpr int GB = Q::QK >= 256 ? 2 : 16;  // blocks per scale pass
  F acc[NR][MR][2];
  float sbuf[NR][GB * Q::SC];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i][0] = acc[r][i][1] = V::zero();
  const int64_t nb = K / Q::QK;
  for (int64_t b0 = 0; b0 < nb; b0 += GB) {
    const int gn = nb - b0 < GB ? (int)(nb - b0) : GB;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* rowp = w + (n + r) * rb + b0 * Q::BYTES;
      // The same bytes NR rows on (the next tile: rows are contiguous), a few KB ahead.
      for (int off = 0; off < gn * Q::BYTES; off += 64) __builtin_prefetch(rowp + NR * rb + off);
      for (int j = 0; j < gn; ++j) Q::scales(rowp + j * Q::BYTES, sbuf[r] + j * Q::SC);
    }
    for (int j = 0; j < gn; ++j) {
      for (int c = 0; c < Q::NC; ++c) {
        const int64_t k = (b0 + j) * Q::QK + 32 * c;
        for (int r = 0; r < NR; ++r) {
          F wv[NV];
          Q::chunk(w + (n + r) * rb + (b0 + j) * Q::BYTES, sbuf[r] + j * Q::SC, c, wv);
          for (int i = 0; i < MR; ++i) {
            const float* xp = x + (m0 + i) * K + k;
            for (int v = 0; v < NV; ++v)
              acc[r][i][v & 1] = V::fma(wv[v], V::load(xp + v * V::VL), acc[r][i][v & 1]);
          }
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) y[(m0 + i) * N + n + r] = V::hsum(V::add(acc[r][i][0], acc[r][i][1]));
}

// The factored GEMV (V::GEMV_FACTORED, types with Q::FACTORED): each 32-element chunk's weights
// are w = a * q + b with q the block's small integers (exact as floats), so the chunk's dot
// product is a * sum(q * x) + b * sum(x): per vector of weights one convert and one FMA, instead
// of a convert, the dequantizing multiply and add, and an FMA. sum(x) per chunk (sx: [M][K / 32])
// is computed once per call. The products are rounded at other points than the reference's
// dequantized weights: the result is the reference's within fp32 rounding, not bit for bit.
template <class Q, int NR, int MR>
static inline void gemv_tile_f(const uint8_t* w, int64_t rb, const float* x, int64_t K, float* y,
                               int64_t N, int64_t n, int64_t m0, const float* sx) {
  constexpr int GB = Q::QK >= 256 ? 2 : 16;
  F acc[NR][MR];
  float off[NR][MR];
  float sbuf[NR][GB * Q::SC];
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) acc[r][i] = V::zero(), off[r][i] = 0.f;
  const int64_t nb = K / Q::QK, kc = K / 32;
  for (int64_t b0 = 0; b0 < nb; b0 += GB) {
    const int gn = nb - b0 < GB ? (int)(nb - b0) : GB;
    for (int r = 0; r < NR; ++r) {
      const uint8_t* rowp = w + (n + r) * rb + b0 * Q::BYTES;
      for (int off_b = 0; off_b < gn * Q::BYTES; off_b += 64) __builtin_prefetch(rowp + NR * rb + off_b);
      for (int j = 0; j < gn; ++j) Q::scales(rowp + j * Q::BYTES, sbuf[r] + j * Q::SC);
    }
    for (int j = 0; j < gn; ++j) {
      for (int c = 0; c < Q::NC; ++c) {
        const int64_t k = (b0 + j) * Q::QK + 32 * c;
        for (int r = 0; r < NR; ++r) {
          F qv[NV];
          const float* sc = sbuf[r] + j * Q::SC;
          Q::ints(w + (n + r) * rb + (b0 + j) * Q::BYTES, c, qv);
          const F a = V::set1(Q::a(sc, c));
          for (int i = 0; i < MR; ++i) {
            const float* xp = x + (m0 + i) * K + k;
            F p = V::mul(qv[0], V::load(xp));
            for (int v = 1; v < NV; ++v) p = V::fma(qv[v], V::load(xp + v * V::VL), p);
            acc[r][i] = V::fma(a, p, acc[r][i]);
            if (Q::OFFSET) off[r][i] += Q::b(sc, c) * sx[(m0 + i) * kc + k / 32];
          }
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int i = 0; i < MR; ++i) y[(m0 + i) * N + n + r] = V::hsum(acc[r][i]) + off[r][i];
}

template <class Q, int MR>
static void gemv_rows(const uint8_t* w, int64_t rb, const float* x, int64_t K, float* y, int64_t N,
                      int64_t n0, int64_t n1, int64_t m0, const float* sx) {
  constexpr int NR = MR == 1 ? 4 : (MR == 2 ? 2 : 1);
  int64_t n = n0;
  if (sx != nullptr) {
    for (; n + NR <= n1; n += NR) gemv_tile_f<Q, NR, MR>(w, rb, x, K, y, N, n, m0, sx);
    for (; n < n1; ++n) gemv_tile_f<Q, 1, MR>(w, rb, x, K, y, N, n, m0, sx);
    return;
  }
  for (; n + NR <= n1; n += NR) gemv_tile<Q, NR, MR>(w, rb, x, K, y, N, n, m0);
  for (; n < n1; ++n) gemv_tile<Q, 1, MR>(w, rb, x, K, y, N, n, m0);
}

// Chunk sums of x for the factored GEMV: sx[m * (K / 32) + c] = sum of x[m][32c .. 32c + 31].
constexpr int64_t GEMV_SX_MAX = 16384;  // floats on the stack; beyond, the unfactored tiles

template <class Q>
static void gemv_q(const uint8_t* w, int64_t rb, const float* x, int64_t M, int64_t K, float* y,
                   int64_t N, int64_t n0, int64_t n1) {
  constexpr bool factored = Q::FACTORED && V::GEMV_FACTORED;
  float sxbuf[factored && Q::OFFSET ? GEMV_SX_MAX : 1];
  const float* sx = nullptr;  // non-null: the factored tiles (read only for Q::OFFSET types)
  if (factored && (!Q::OFFSET || M * (K / 32) <= GEMV_SX_MAX)) {
    if (Q::OFFSET)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < K / 32; ++c) {
          F s = V::load(x + m * K + 32 * c);
          for (int v = 1; v < NV; ++v) s = V::add(s, V::load(x + m * K + 32 * c + v * V::VL));
          sxbuf[m * (K / 32) + c] = V::hsum(s);
        }
    sx = sxbuf;
  }
  // Row blocks of 16 outer, activation rows inner: a block's bytes are read from memory once and
  // re-read from L1 for each group of 4 activation rows.
  for (int64_t nb = n0; nb < n1; nb += 16) {
    const int64_t ne = nb + 16 < n1 ? nb + 16 : n1;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) gemv_rows<Q, 4>(w, rb, x, K, y, N, nb, ne, m, sx);
    switch (M - m) {
      case 3: gemv_rows<Q, 3>(w, rb, x, K, y, N, nb, ne, m, sx); break;
      case 2: gemv_rows<Q, 2>(w, rb, x, K, y, N, nb, ne, m, sx); break;
      case 1: gemv_rows<Q, 1>(w, rb, x, K, y, N, nb, ne, m, sx); break;
      default: break;
    }
  }
}

// ---- GEMM: x packed once per call, a panel of GEMM_NB weight rows dequantized to fp32, then an ---
// outer-product micro-kernel: per k, MV vectors of x (XB = 2 VL activation rows side by side) times
// NRB broadcast weights into NRB x MV accumulators. Every output is one accumulator lane, so there
// is no horizontal sum, and each weight and x value loaded feeds MV / NRB FMAs. Each chunk of
// GEMM_KC values of k is summed from zero, then added to the output tile (summation depth
// GEMM_KC + K / GEMM_KC, not K).

constexpr int XB = 2 * V::VL;  // activation rows per packed block
static_assert(GEMM_KC % 32 == 0, "a 32-element chunk of a block lands in one k-chunk");

// xp[b][k][i] = x[b * XB + i][k] (rows past M are 0), for the k in this thread's share.
void pack_x(const float* x, int64_t M, int64_t K, float* xp, int t, int nt) {
  const int64_t k0 = K * t / nt, k1 = K * (t + 1) / nt;
  for (int64_t m0 = 0; m0 < M; m0 += XB) {
    float* dst = xp + m0 * K;  // block m0 / XB starts at (m0 / XB) * K * XB
    const int rows = M - m0 < XB ? (int)(M - m0) : XB;
    for (int64_t k = k0; k < k1; ++k) {
      float* d = dst + k * XB;
      for (int i = 0; i < rows; ++i) d[i] = x[(m0 + i) * K + k];
      for (int i = rows; i < XB; ++i) d[i] = 0.f;
    }
  }
}

// Rows n0 .. n0 + rows of a quantized matrix dequantized 32 values at a time: `at(r, k)` is where
// row r's values k .. k + 31 go (the layout of `dequant_rows` or `dequant_panel`).
template <class Q, class At>
static void dequant_each(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t rows, At at) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = w + (n0 + r) * rb;
    for (int64_t bi = 0; bi < K / Q::QK; ++bi) {
      const uint8_t* b = row + bi * Q::BYTES;
      float sc[Q::SC];
      Q::scales(b, sc);
      for (int c = 0; c < Q::NC; ++c) {
        F wv[NV];
        Q::chunk(b, sc, c, wv);
        float* o = at(r, bi * Q::QK + 32 * c);
        for (int v = 0; v < NV; ++v) V::store(o + v * V::VL, wv[v]);
      }
    }
  }
}

template <class Q>
static void dequant_rows(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t rows, float* out) {
  dequant_each<Q>(w, rb, K, n0, rows, [=](int64_t r, int64_t k) { return out + r * K + k; });
}

// The GEMM's panel: rows n0 .. n0 + rows dequantized as [ceil(K / GEMM_KC)][GEMM_NB][GEMM_KC], so
// the weights a tile broadcasts for one k sit at constant offsets from one pointer (12 row
// pointers would not fit the general registers); rows past `rows` are zeros.
template <class Q>
static void dequant_panel(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t rows, float* out) {
  dequant_each<Q>(w, rb, K, n0, rows, [=](int64_t r, int64_t k) {
    return out + (k / GEMM_KC) * (GEMM_NB * GEMM_KC) + r * GEMM_KC + k % GEMM_KC;
  });
  if (rows < GEMM_NB)
    for (int64_t kc = 0; kc < K; kc += GEMM_KC)
      memset(out + (kc / GEMM_KC) * (GEMM_NB * GEMM_KC) + rows * GEMM_KC, 0, (GEMM_NB - rows) * GEMM_KC * sizeof(float));
}

// The partial sums of panel rows j0 .. j0 + NRB over k in [kc, ke) for one packed block xb, added
// into the tile c[GEMM_NB][XB] (stored, when `first`).
template <int MV, int NRB>
static inline void gemm_micro(const float* xb, const float* panel, int64_t j0, int64_t kc, int64_t ke,
                              float* c, bool first) {
  const float* wp = panel + (kc / GEMM_KC) * (GEMM_NB * GEMM_KC) + j0 * GEMM_KC - kc;  // wp[j * KC + k]
  F acc[NRB][MV];
  for (int j = 0; j < NRB; ++j)
    for (int v = 0; v < MV; ++v) acc[j][v] = V::zero();
  for (int64_t k = kc; k < ke; ++k) {
    F xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = V::load(xb + k * XB + v * V::VL);
    for (int j = 0; j < NRB; ++j) {
      const F wv = V::set1(wp[j * GEMM_KC + k]);
      for (int v = 0; v < MV; ++v) acc[j][v] = V::fma(wv, xv[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NRB; ++j)
    for (int v = 0; v < MV; ++v) {
      float* cp = c + (j0 + j) * XB + v * V::VL;
      V::store(cp, first ? acc[j][v] : V::add(V::load(cp), acc[j][v]));
    }
}

// Loop order per panel and packed block: chunks of GEMM_KC k outer, tiles inner, so the chunk of
// x (GEMM_KC x XB floats) and of the panel (GEMM_NB x GEMM_KC) stay in L1 across the tiles.
template <class Q>
static void gemm_q(const uint8_t* w, int64_t rb, const float* xp, int64_t M, int64_t K, float* y,
                   int64_t N, int64_t n0, int64_t n1, float* scratch) {
  constexpr int NRB2 = V::GEMM_NRB, NRB1 = 2 * V::GEMM_NRB;  // weight rows per tile at MV = 2, 1
  static_assert(GEMM_NB % NRB1 == 0 && GEMM_NB % NRB2 == 0, "the panel holds whole tiles");
  float c[GEMM_NB * XB];
  for (int64_t nb = n0; nb < n1; nb += GEMM_NB) {
    const int64_t rows = nb + GEMM_NB < n1 ? GEMM_NB : n1 - nb;
    dequant_panel<Q>(w, rb, K, nb, rows, scratch);
    // The next panel's blocks (contiguous rows) are fetched while this one is multiplied, a slice
    // per k-chunk of the first packed block, so its dequantization does not wait on memory.
    const uint8_t* next = w + (nb + GEMM_NB) * rb;
    const int64_t next_bytes = (nb + 2 * GEMM_NB <= n1 ? GEMM_NB : (n1 > nb + GEMM_NB ? n1 - nb - GEMM_NB : 0)) * rb;
    const int64_t slice = (next_bytes * GEMM_KC / K + 63) / 64 * 64;
    int64_t fetched = 0;
    for (int64_t m0 = 0; m0 < M; m0 += XB) {
      const float* xb = xp + m0 * K;
      const bool two = M - m0 > V::VL;  // else at most VL rows left: one x vector, twice the rows
      for (int64_t kc = 0; kc < K; kc += GEMM_KC) {
        const int64_t ke = kc + GEMM_KC < K ? kc + GEMM_KC : K;
        for (int64_t e = fetched + slice; fetched < next_bytes && fetched < e; fetched += 64)
          __builtin_prefetch(next + fetched);
        if (two) {
          for (int64_t j = 0; j < rows; j += NRB2) gemm_micro<2, NRB2>(xb, scratch, j, kc, ke, c, kc == 0);
        } else {
          for (int64_t j = 0; j < rows; j += NRB1) gemm_micro<1, NRB1>(xb, scratch, j, kc, ke, c, kc == 0);
        }
      }
      const int mi = M - m0 < XB ? (int)(M - m0) : XB;
      for (int i = 0; i < mi; ++i) {  // row by row: runs of `rows` consecutive outputs
        float* yr = y + (m0 + i) * N + nb;
        for (int64_t j = 0; j < rows; ++j) yr[j] = c[j * XB + i];
      }
    }
  }
}

// ---- entry points (single-threaded over output rows [n0, n1); the caller splits the threads) ---

#define MINISGL_QUANT_SWITCH(QT, CALL)            \
  switch (QT) {                                   \
    case QT_Q8_0: CALL(Q8_0); return 0;           \
    case QT_Q4_0: CALL(Q4_0); return 0;           \
    case QT_Q4_1: CALL(Q4_1); return 0;           \
    case QT_Q4_K: CALL(Q4_K); return 0;           \
    case QT_Q6_K: CALL(Q6_K); return 0;           \
    default: return 1;                            \
  }

// The floats of x prepared once per call for this path's GEMV of `qtype` (0: it takes x as it is),
// and that preparation (QUANT_GEMV_LANES: quant_gemv_lanes.h).
int64_t gemv_prep_floats(int qtype, int64_t M, int64_t K) {
#ifdef QUANT_GEMV_LANES
  return lanes_prep_floats(qtype, M, K);
#else
  (void)qtype, (void)M, (void)K;
  return 0;
#endif
}

void gemv_prep(int qtype, const float* x, int64_t M, int64_t K, float* out) {
#ifdef QUANT_GEMV_LANES
  lanes_prep(qtype, x, M, K, out);
#else
  (void)qtype, (void)x, (void)M, (void)K, (void)out;
#endif
}

// prep: gemv_prep's output when gemv_prep_floats > 0, else nullptr.
int gemv(int qtype, const uint8_t* w, int64_t rb, const float* x, const float* prep, int64_t M, int64_t K,
         float* y, int64_t N, int64_t n0, int64_t n1) {
#ifdef QUANT_GEMV_LANES
  if (prep != nullptr && gemv_lanes(qtype, w, rb, prep, M, K, y, N, n0, n1)) return 0;
#else
  (void)prep;
#endif
#define CALL_GEMV(Q) gemv_q<Q>(w, rb, x, M, K, y, N, n0, n1)
  MINISGL_QUANT_SWITCH(qtype, CALL_GEMV)
#undef CALL_GEMV
}

int gemm(int qtype, const uint8_t* w, int64_t rb, const float* xp, int64_t M, int64_t K, float* y,
         int64_t N, int64_t n0, int64_t n1, float* scratch) {
#define CALL_GEMM(Q) gemm_q<Q>(w, rb, xp, M, K, y, N, n0, n1, scratch)
  MINISGL_QUANT_SWITCH(qtype, CALL_GEMM)
#undef CALL_GEMM
}

int dequantize(int qtype, const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, float* out) {
#define CALL_DEQ(Q) dequant_rows<Q>(w, rb, K, n0, n1 - n0, out + n0 * K)
  MINISGL_QUANT_SWITCH(qtype, CALL_DEQ)
#undef CALL_DEQ
}

#undef MINISGL_QUANT_SWITCH

}  // namespace QUANT_ISA_NS
}  // namespace minisgl_quant
