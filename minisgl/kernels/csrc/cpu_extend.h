// Paged extend (prefill) attention of the float CPU kernels (kernels/cpu_extend.py): the step's new
// queries against the pool's K/V read through the token table, causal with the cached prefix (the
// query at position p sees keys 0..p), GQA without repeating K/V, a flash-style online softmax in
// fp32. Included by each ISA file inside its namespace after cpu_kernels_impl.h (which gives F, VL,
// ld1 / st1 and the traits `V`) and after a small struct `VX` with the one extra op it needs,
// VX::max(a, b). As cpu_kernels_impl.h, nothing from the standard library is used here.
//
// One task = (request, KV head, block of QB queries): its rows are the block's queries times the
// group's G q heads (row r = query r / G, head r % G), held transposed and scaled in `qt` [D][RP]
// (RP: rows rounded up to VL) so that the scores of a key block come out key-major, s [KB][RP],
// one vector of rows per FMA: each key element broadcast once feeds every row of the group. The
// running max, sum and the rescale factors are vectors over rows too; p.v accumulates into o
// [RP][D] in register tiles of rows x D. K/V rows are read in place when fp32 and converted into
// the task's scratch when bf16 / fp16 (exact conversions, a vector at a time).

// A page row of D elements as fp32: in place, or converted into `buf`. D % VL == 0.
template <int KV>
struct ExtPage;
template <>
struct ExtPage<DT_F32> {
  using T = float;
  static inline const float* row(const float* p, float*, int64_t) { return p; }
};
template <>
struct ExtPage<DT_BF16> {
  using T = uint16_t;
  static inline const float* row(const uint16_t* p, float* buf, int64_t D) {
    for (int64_t d = 0; d < D; d += VL) V::store(buf + d, V::load(p + d));
    return buf;
  }
};
template <>
struct ExtPage<DT_F16> {
  using T = uint16_t;
  static inline const float* row(const uint16_t* p, float* buf, int64_t D) {
    // V's fp16 load (exact: F16C's vcvtph2ps on AVX2 and AVX-512, per lane on the portable path).
    const Half* h = reinterpret_cast<const Half*>(p);
    for (int64_t d = 0; d < D; d += VL) V::store(buf + d, V::load(h + d));
    return buf;
  }
};

constexpr int EXT_KJ = VL >= 16 ? 4 : 2;  // keys per score tile (accumulators: EXT_KJ x 4 vectors)
constexpr int EXT_MR = VL >= 16 ? 4 : 2;  // rows per p.v tile (accumulators: EXT_MR x 4 vectors)

// s[j][rv0*VL ...) for RV row vectors: dot products of the nk keys with the transposed queries.
template <int RV>
static inline void ext_scores(const float* qt, int64_t RP, int64_t rv0, const float* const* krow, int64_t nk,
                              int64_t D, float* s) {
  const float* q0 = qt + rv0 * VL;
  int64_t j = 0;
  for (; j + EXT_KJ <= nk; j += EXT_KJ) {
    F acc[EXT_KJ][RV];
    for (int kj = 0; kj < EXT_KJ; ++kj)
      for (int rv = 0; rv < RV; ++rv) acc[kj][rv] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
      F qv[RV];
      for (int rv = 0; rv < RV; ++rv) qv[rv] = V::load(q0 + d * RP + rv * VL);
      for (int kj = 0; kj < EXT_KJ; ++kj) {
        const F kb = V::set1(krow[j + kj][d]);
        for (int rv = 0; rv < RV; ++rv) acc[kj][rv] = V::fma(kb, qv[rv], acc[kj][rv]);
      }
    }
    for (int kj = 0; kj < EXT_KJ; ++kj)
      for (int rv = 0; rv < RV; ++rv) V::store(s + (j + kj) * RP + (rv0 + rv) * VL, acc[kj][rv]);
  }
  for (; j < nk; ++j) {
    F acc[RV];
    for (int rv = 0; rv < RV; ++rv) acc[rv] = V::zero();
    for (int64_t d = 0; d < D; ++d) {
      const F kb = V::set1(krow[j][d]);
      for (int rv = 0; rv < RV; ++rv) acc[rv] = V::fma(kb, V::load(q0 + d * RP + rv * VL), acc[rv]);
    }
    for (int rv = 0; rv < RV; ++rv) V::store(s + j * RP + (rv0 + rv) * VL, acc[rv]);
  }
}

// o[r0 + i][d0 ...) = o * alpha[r] + sum_j s[j][r] * v_j, for MR rows and DV vectors of D.
template <int MR, int DV>
static inline void ext_pv_tile(float* o, int64_t D, const float* alpha, const float* s, int64_t RP, int64_t r0,
                               const float* const* vrow, int64_t nk, int64_t d0) {
  F acc[MR][DV];
  for (int i = 0; i < MR; ++i) {
    const F al = V::set1(alpha[r0 + i]);
    for (int v = 0; v < DV; ++v) acc[i][v] = V::mul(V::load(o + (r0 + i) * D + d0 + v * VL), al);
  }
  for (int64_t j = 0; j < nk; ++j) {
    F vv[DV];
    for (int v = 0; v < DV; ++v) vv[v] = V::load(vrow[j] + d0 + v * VL);
    const float* pj = s + j * RP + r0;
    for (int i = 0; i < MR; ++i) {
      const F p = V::set1(pj[i]);
      for (int v = 0; v < DV; ++v) acc[i][v] = V::fma(p, vv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < DV; ++v) V::store(o + (r0 + i) * D + d0 + v * VL, acc[i][v]);
}

template <int MR>
static inline void ext_pv_rows(float* o, int64_t D, const float* alpha, const float* s, int64_t RP, int64_t r0,
                               const float* const* vrow, int64_t nk) {
  int64_t d0 = 0;
  for (; d0 + 4 * VL <= D; d0 += 4 * VL) ext_pv_tile<MR, 4>(o, D, alpha, s, RP, r0, vrow, nk, d0);
  const int64_t rest = (D - d0) / VL;
  if (rest == 3) ext_pv_tile<MR, 3>(o, D, alpha, s, RP, r0, vrow, nk, d0);
  else if (rest == 2) ext_pv_tile<MR, 2>(o, D, alpha, s, RP, r0, vrow, nk, d0);
  else if (rest == 1) ext_pv_tile<MR, 1>(o, D, alpha, s, RP, r0, vrow, nk, d0);
}

template <typename Q, int KV>
static void extend_task_t(const ExtendArgs& a, int64_t task, float* scratch) {
  using P = typename ExtPage<KV>::T;
  const int64_t D = a.D, G = a.G, Hkv = a.Hkv;
  const int64_t blk = a.blocks[task / Hkv], h = task % Hkv;
  const int64_t b = blk >> 32, qb = blk & 0xffffffffLL;
  const int64_t L = a.lens[b], E = a.ext[b], prefix = L - E, start = a.starts[b];
  const int64_t i0 = qb * a.QB, i1 = i0 + a.QB < E ? i0 + a.QB : E, nq = i1 - i0;
  const int64_t R = nq * G, RP = (R + VL - 1) / VL * VL, kend = prefix + i1;
  float* qt = scratch;
  float* s = qt + D * RP;
  float* o = s + EXTEND_KB * RP;
  float* m = o + RP * D;
  float* l = m + RP;
  float* alpha = l + RP;
  float* kbuf = alpha + RP;
  float* vbuf = kbuf + EXTEND_KB * D;
  const Q* q = static_cast<const Q*>(a.q);
  for (int64_t r = 0; r < RP; ++r) {
    if (r < R) {
      const Q* qr = q + (start + i0 + r / G) * a.q_st + (h * G + r % G) * a.q_sh;
      for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = ld1(qr + d) * a.scale;
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * RP + r] = 0.f;
    }
    for (int64_t d = 0; d < D; ++d) o[r * D + d] = 0.f;
    m[r] = -__builtin_inff();
    l[r] = 0.f;
  }
  const int32_t* slots = a.table + a.rows[b] * a.t_sr;
  const P* kp = static_cast<const P*>(a.k) + h * a.kv_sh;
  const P* vp = static_cast<const P*>(a.v) + h * a.kv_sh;
  const float* krow[EXTEND_KB];
  const float* vrow[EXTEND_KB];
  const int64_t first_q = prefix + i0;  // the block's first query position
  for (int64_t j0 = 0; j0 < kend; j0 += EXTEND_KB) {
    const int64_t nk = kend - j0 < EXTEND_KB ? kend - j0 : EXTEND_KB;
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t slot = slots[j0 + j];
      krow[j] = ExtPage<KV>::row(kp + slot * a.kv_ss, kbuf + j * D, D);
      vrow[j] = ExtPage<KV>::row(vp + slot * a.kv_ss, vbuf + j * D, D);
    }
    int64_t rv0 = 0;
    for (; rv0 + 4 <= RP / VL; rv0 += 4) ext_scores<4>(qt, RP, rv0, krow, nk, D, s);
    const int64_t rest = RP / VL - rv0;
    if (rest == 3) ext_scores<3>(qt, RP, rv0, krow, nk, D, s);
    else if (rest == 2) ext_scores<2>(qt, RP, rv0, krow, nk, D, s);
    else if (rest == 1) ext_scores<1>(qt, RP, rv0, krow, nk, D, s);
    for (int64_t j = first_q + 1 - j0 > 0 ? first_q + 1 - j0 : 0; j < nk; ++j) {  // keys past some query
      const int64_t kpos = j0 + j;
      for (int64_t r = 0; r < RP; ++r) {
        const int64_t qi = r < R ? r / G : nq - 1;  // padding rows: the block's last query
        if (kpos > first_q + qi) s[j * RP + r] = -__builtin_inff();
      }
    }
    for (int64_t rv = 0; rv < RP; rv += VL) {  // online softmax, a vector of rows at a time
      F mx = V::load(m + rv);
      for (int64_t j = 0; j < nk; ++j) mx = VX::max(mx, V::load(s + j * RP + rv));
      V::store(alpha + rv, V::exp(V::sub(V::load(m + rv), mx)));
      V::store(m + rv, mx);
      F sum = V::mul(V::load(l + rv), V::load(alpha + rv));
      for (int64_t j = 0; j < nk; ++j) {
        const F e = V::exp(V::sub(V::load(s + j * RP + rv), mx));
        V::store(s + j * RP + rv, e);
        sum = V::add(sum, e);
      }
      V::store(l + rv, sum);
    }
    int64_t r0 = 0;
    for (; r0 + EXT_MR <= R; r0 += EXT_MR) ext_pv_rows<EXT_MR>(o, D, alpha, s, RP, r0, vrow, nk);
    for (; r0 < R; ++r0) ext_pv_rows<1>(o, D, alpha, s, RP, r0, vrow, nk);
  }
  Q* out = static_cast<Q*>(a.out);
  for (int64_t r = 0; r < R; ++r) {
    Q* orow = out + (start + i0 + r / G) * a.o_st + (h * G + r % G) * a.o_sh;
    const float inv = l[r] > 0.f ? 1.f / l[r] : l[r];  // NaN stays NaN
    const F iv = V::set1(inv);
    for (int64_t d = 0; d < D; d += VL) V::store(orow + d, V::mul(V::load(o + r * D + d), iv));
  }
}

void extend_task(int qdt, int kvdt, const ExtendArgs& a, int64_t task, float* scratch) {
  if (qdt == DT_BF16) {
    if (kvdt == DT_BF16) extend_task_t<uint16_t, DT_BF16>(a, task, scratch);
    else if (kvdt == DT_F16) extend_task_t<uint16_t, DT_F16>(a, task, scratch);
    else extend_task_t<uint16_t, DT_F32>(a, task, scratch);
  } else {
    if (kvdt == DT_BF16) extend_task_t<float, DT_BF16>(a, task, scratch);
    else if (kvdt == DT_F16) extend_task_t<float, DT_F16>(a, task, scratch);
    else extend_task_t<float, DT_F32>(a, task, scratch);
  }
}
