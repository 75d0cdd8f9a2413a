// The float CPU kernels, written once over an ISA traits struct `V` (see the ISA files:
// cpu_portable.cpp, cpu_avx2.cpp, cpu_avx512.cpp). Included by each of them inside its own
// namespace after defining `V`, so the three instantiations never share a symbol; nothing from
// the standard library is used here (no template compiled under one ISA's target can be merged
// into another's code).
//
// V provides: F (V::VL floats), zero, set1, load / store of fp32 and of bf16 (uint16_t bits; the
// store rounds to nearest even, NaN -> 0x7fc0, as c10::BFloat16), load of fp16 (`Half`: exact, the
// decode attention's 16-bit K/V pages), round_bf16, add, sub, mul, div,
// fma(a, b, c) = a*b + c, hsum, exp (the softmax's and SiLU's: ~1e-7 relative, 0 below -87,
// NaN stays NaN), and the GEMM register tile NB weight rows x MB input rows.
//
// Rounding points follow the torch references (kernels/*_ref.py): for bf16 each op of the
// reference rounds to bf16 (`rnd`), for fp32 `rnd` is the identity; the build uses
// -ffp-contract=off, so no product and sum are fused where the reference rounds between them.

using F = V::F;
constexpr int VL = V::VL;

// ---- scalar element access (the tails of the vector loops) -------------------------------------
static inline float bits_f(uint32_t b) { float f; __builtin_memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; __builtin_memcpy(&b, &f, 4); return b; }
static inline float ld1(const float* p) { return *p; }
static inline float ld1(const uint16_t* p) { return bits_f(static_cast<uint32_t>(*p) << 16); }
// IEEE half -> fp32, exact: normal numbers rebias the exponent, subnormals are man * 2^-24,
// inf and NaN (payload kept) map to theirs.
static inline float half_f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (e == 0x1fu) return bits_f(sign | 0x7f800000u | (man << 13));
  if (e != 0) return bits_f(sign | ((e + 112u) << 23) | (man << 13));
  const float sub = static_cast<float>(man) * 5.9604644775390625e-8f;
  return sign != 0 ? -sub : sub;
}
static inline float ld1(const Half* p) { return half_f(p->bits); }
static inline uint16_t to_bf16(float v) {
  if (v != v) return 0x7fc0;
  const uint32_t b = f_bits(v);
  return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
static inline void st1(float* p, float v) { *p = v; }
static inline void st1(uint16_t* p, float v) { *p = to_bf16(v); }
static inline float rnd1(const float*, float v) { return v; }
static inline float rnd1(const uint16_t*, float v) { return bits_f(static_cast<uint32_t>(to_bf16(v)) << 16); }
static inline F rndv(const float*, F v) { return v; }
static inline F rndv(const uint16_t*, F v) { return V::round_bf16(v); }
static inline float exp1(float x) {
  if (x != x) return x;
  if (x < -87.f) return 0.f;
  if (x > 88.3f) x = 88.3f;
  const float t = x * 1.4426950408889634f;
  const float n = __builtin_rintf(t), fr = t - n;
  float p = 1.5403530393381609e-4f;
  p = p * fr + 1.3333558146428443e-3f;
  p = p * fr + 9.6181291076284772e-3f;
  p = p * fr + 5.5504108664821580e-2f;
  p = p * fr + 2.4022650695910071e-1f;
  p = p * fr + 6.9314718055994531e-1f;
  p = p * fr + 1.f;
  return p * bits_f(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

// ---- RMSNorm ------------------------------------------------------------------------------------
// One row of fp32 values `x` (already rounded to T) -> out = w * rnd(x * scale).
template <typename T>
static inline void norm_row(const float* x, const T* w, int64_t H, float eps, T* out) {
  F acc = V::zero();
  int64_t i = 0;
  for (; i + VL <= H; i += VL) {
    const F v = V::load(x + i);
    acc = V::fma(v, v, acc);
  }
  float ss = V::hsum(acc);
  for (; i < H; ++i) ss += x[i] * x[i];
  const float scale = 1.f / __builtin_sqrtf(ss / static_cast<float>(H) + eps);
  const F sv = V::set1(scale);
  for (i = 0; i + VL <= H; i += VL) V::store(out + i, V::mul(V::load(w + i), rndv(w, V::mul(V::load(x + i), sv))));
  for (; i < H; ++i) st1(out + i, ld1(w + i) * rnd1(w, x[i] * scale));
}

template <typename T>
static void norm_rows_t(const NormArgs& a, int64_t t0, int64_t t1) {
  const int64_t H = a.H;
  float* row = static_cast<float*>(__builtin_malloc(sizeof(float) * (H + VL)));
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.res);
  const T* w = static_cast<const T*>(a.w);
  T* out = static_cast<T*>(a.out);
  T* total = static_cast<T*>(a.total);
  for (int64_t t = t0; t < t1; ++t) {
    const T* xr = x + t * a.xs;
    int64_t i = 0;
    if (res != nullptr) {  // total = rnd(x + res), the normalised row
      const T* rr = res + t * H;
      T* tr = total + t * H;
      for (; i + VL <= H; i += VL) {
        const F s = rndv(w, V::add(V::load(xr + i), V::load(rr + i)));
        V::store(tr + i, s);
        V::store(row + i, s);
      }
      for (; i < H; ++i) {
        const float s = rnd1(w, ld1(xr + i) + ld1(rr + i));
        st1(tr + i, s);
        row[i] = s;
      }
    } else {
      for (; i + VL <= H; i += VL) V::store(row + i, V::load(xr + i));
      for (; i < H; ++i) row[i] = ld1(xr + i);
    }
    norm_row(row, w, H, a.eps, out + t * H);
  }
  __builtin_free(row);
}

void norm_rows(int dt, const NormArgs& a, int64_t t0, int64_t t1) {
  if (dt == DT_BF16) norm_rows_t<uint16_t>(a, t0, t1);
  else norm_rows_t<float>(a, t0, t1);
}

// ---- rotary -------------------------------------------------------------------------------------
// Task = (token, head) over the q heads then the k heads. Neox halves, the reference's eager
// rounding: out1 = rnd(rnd(x1 * c) + rnd(-x2 * s)), out2 = rnd(rnd(x2 * c) + rnd(x1 * s)), with
// c, s the tables' values rounded to T.
template <typename T>
static void rotary_tasks_t(const RotaryArgs& a, int64_t t0, int64_t t1) {
  const int64_t D = a.D, half = D / 2, H = a.Hq + a.Hk;
  float* buf = static_cast<float*>(__builtin_malloc(sizeof(float) * (3 * D + 3 * VL) + sizeof(T) * (D + VL)));
  float* c = buf;
  float* s = c + half + VL;
  float* x = s + half + VL;
  T* normed = reinterpret_cast<T*>(x + D + VL);
  const T* dummy = nullptr;
  int64_t last_t = -1;
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t t = task / H, h = task % H;
    if (t != last_t) {
      const float* cp = a.cos + a.pos[t] * half;
      const float* sp = a.sin + a.pos[t] * half;
      for (int64_t i = 0; i < half; ++i) { c[i] = rnd1(dummy, cp[i]); s[i] = rnd1(dummy, sp[i]); }
      last_t = t;
    }
    const bool is_q = h < a.Hq;
    const T* src = is_q ? static_cast<const T*>(a.q) + t * a.qs0 + h * a.qs1
                        : static_cast<const T*>(a.k) + t * a.ks0 + (h - a.Hq) * a.ks1;
    T* dst = is_q ? static_cast<T*>(a.qo) + (t * a.Hq + h) * D : static_cast<T*>(a.ko) + (t * a.Hk + h - a.Hq) * D;
    for (int64_t i = 0; i < D; ++i) x[i] = ld1(src + i);
    if (a.qw != nullptr) {
      norm_row(x, static_cast<const T*>(is_q ? a.qw : a.kw), D, is_q ? a.q_eps : a.k_eps, normed);
      for (int64_t i = 0; i < D; ++i) x[i] = ld1(normed + i);
    }
    int64_t i = 0;
    const F zero = V::zero();
    for (; i + VL <= half; i += VL) {
      const F x1 = V::load(x + i), x2 = V::load(x + half + i), cv = V::load(c + i), sv = V::load(s + i);
      V::store(dst + i, V::add(rndv(dummy, V::mul(x1, cv)), rndv(dummy, V::mul(V::sub(zero, x2), sv))));
      V::store(dst + half + i, V::add(rndv(dummy, V::mul(x2, cv)), rndv(dummy, V::mul(x1, sv))));
    }
    for (; i < half; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      st1(dst + i, rnd1(dummy, x1 * c[i]) + rnd1(dummy, -x2 * s[i]));
      st1(dst + half + i, rnd1(dummy, x2 * c[i]) + rnd1(dummy, x1 * s[i]));
    }
  }
  __builtin_free(buf);
}

void rotary_tasks(int dt, const RotaryArgs& a, int64_t t0, int64_t t1) {
  if (dt == DT_BF16) rotary_tasks_t<uint16_t>(a, t0, t1);
  else rotary_tasks_t<float>(a, t0, t1);
}

// ---- SiLU and mul -------------------------------------------------------------------------------
// out = rnd(rnd(g / (1 + exp(-g))) * u)
template <typename T>
static void silu_tasks_t(const SiluArgs& a, int64_t t0, int64_t t1) {
  const T* x = static_cast<const T*>(a.x);
  T* out = static_cast<T*>(a.out);
  const int64_t I = a.I;
  const F one = V::set1(1.f), zero = V::zero();
  for (int64_t task = t0; task < t1; ++task) {
    const int64_t t = task / a.per_row, i0 = (task % a.per_row) * SILU_CHUNK;
    const int64_t i1 = i0 + SILU_CHUNK < I ? i0 + SILU_CHUNK : I;
    const T* g = x + t * a.xs;
    const T* u = g + I;
    T* o = out + t * I;
    int64_t i = i0;
    for (; i + VL <= i1; i += VL) {
      const F gv = V::load(g + i);
      const F sv = rndv(o, V::div(gv, V::add(one, V::exp(V::sub(zero, gv)))));
      V::store(o + i, V::mul(sv, V::load(u + i)));
    }
    for (; i < i1; ++i) {
      const float gv = ld1(g + i);
      st1(o + i, rnd1(o, gv / (1.f + exp1(-gv))) * ld1(u + i));
    }
  }
}

void silu_tasks(int dt, const SiluArgs& a, int64_t t0, int64_t t1) {
  if (dt == DT_BF16) silu_tasks_t<uint16_t>(a, t0, t1);
  else silu_tasks_t<float>(a, t0, t1);
}

// ---- GEMV / small GEMM --------------------------------------------------------------------------
// fp32 dot products of weight rows (T) with the fp32 input rows, one rounding to T at the end
// (with a bias: rnd(s) + b, as F.linear's out + bias for bf16; for fp32 s + b).
template <typename T>
static inline float dot(const T* w, const float* x, int64_t K) {
  F acc0 = V::zero(), acc1 = V::zero();
  int64_t k = 0;
  for (; k + 2 * VL <= K; k += 2 * VL) {
    acc0 = V::fma(V::load(w + k), V::load(x + k), acc0);
    acc1 = V::fma(V::load(w + k + VL), V::load(x + k + VL), acc1);
  }
  for (; k + VL <= K; k += VL) acc0 = V::fma(V::load(w + k), V::load(x + k), acc0);
  float s = V::hsum(V::add(acc0, acc1));
  for (; k < K; ++k) s += ld1(w + k) * x[k];
  return s;
}

template <typename T>
static inline void put(const LinearArgs& a, int64_t m, int64_t n, float s) {
  const T* bias = static_cast<const T*>(a.bias);
  T* out = static_cast<T*>(a.out) + m * a.N + n;
  st1(out, bias != nullptr ? rnd1(out, s) + ld1(bias + n) : s);
}

// NB weight rows x MB input rows: each weight vector loaded feeds MB FMAs.
template <typename T, int NB, int MB>
static inline void tile(const T* w, int64_t ws, const float* x, int64_t K, float* res) {
  F acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = V::zero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    F wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = V::load(w + j * ws + k);
    for (int i = 0; i < MB; ++i) {
      const F xv = V::load(x + i * K + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = V::fma(wv[j], xv, acc[j][i]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) {
      float s = V::hsum(acc[j][i]);
      for (int64_t kk = k; kk < K; ++kk) s += ld1(w + j * ws + kk) * x[i * K + kk];
      res[i * NB + j] = s;
    }
}

template <typename T>
static void linear_rows_t(const LinearArgs& a, int64_t n0, int64_t n1) {
  constexpr int NB = V::NB, MB = V::MB;
  const T* w = static_cast<const T*>(a.w);
  const int64_t M = a.M, K = a.K;
  float res[NB * MB];
  int64_t n = n0;
  if (M > 1) {
    for (; n + NB <= n1; n += NB) {
      int64_t m = 0;
      for (; m + MB <= M; m += MB) {
        tile<T, NB, MB>(w + n * a.ws, a.ws, a.xf + m * K, K, res);
        for (int i = 0; i < MB; ++i)
          for (int j = 0; j < NB; ++j) put<T>(a, m + i, n + j, res[i * NB + j]);
      }
      for (; m < M; ++m) {  // leftover input rows, one at a time
        tile<T, NB, 1>(w + n * a.ws, a.ws, a.xf + m * K, K, res);
        for (int j = 0; j < NB; ++j) put<T>(a, m, n + j, res[j]);
      }
    }
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < M; ++m) put<T>(a, m, n, dot(w + n * a.ws, a.xf + m * K, K));
}

void linear_rows(int dt, const LinearArgs& a, int64_t n0, int64_t n1) {
  if (dt == DT_BF16) linear_rows_t<uint16_t>(a, n0, n1);
  else linear_rows_t<float>(a, n0, n1);
}

// ---- paged decode attention ---------------------------------------------------------------------
// K and V rows are read in their page type KT (fp32, bf16 or fp16) and converted in registers
// (V::load: bf16 by a shift, fp16 by F16C / AVX-512 vcvtph2ps or half_f per lane), each vector
// once for all the group's query rows.

// Rows PREFETCH keys ahead are requested early: pages are scattered, so the hardware prefetcher
// loses the stream at each page boundary.
constexpr int64_t PREFETCH = 8;
static inline void prefetch_row(const void* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(static_cast<const char*>(p) + o);
}

// out[j] = k . q_j for NG query rows q_j = q + j * D (fp32, scaled); two accumulators per row
// (even and odd vectors), so the FMA chains are half as long.
template <int NG, typename KT>
static inline void group_dots(const KT* k, const float* q, int64_t D, float* out) {
  F acc[NG], acc1[NG];
  for (int j = 0; j < NG; ++j) acc[j] = acc1[j] = V::zero();
  int64_t d = 0;
  for (; d + 2 * VL <= D; d += 2 * VL) {
    const F k0 = V::load(k + d), k1 = V::load(k + d + VL);
    for (int j = 0; j < NG; ++j) {
      acc[j] = V::fma(k0, V::load(q + j * D + d), acc[j]);
      acc1[j] = V::fma(k1, V::load(q + j * D + d + VL), acc1[j]);
    }
  }
  for (; d + VL <= D; d += VL) {
    const F kv = V::load(k + d);
    for (int j = 0; j < NG; ++j) acc[j] = V::fma(kv, V::load(q + j * D + d), acc[j]);
  }
  for (int j = 0; j < NG; ++j) out[j] = V::hsum(V::add(acc[j], acc1[j]));
  for (; d < D; ++d) {
    const float kd = ld1(k + d);
    for (int j = 0; j < NG; ++j) out[j] += kd * q[j * D + d];
  }
}

// p.v for NG query rows (probabilities p + g * Lp) into out + g * D: d in slices of PV_NV vectors
// whose NG x PV_NV sums stay in registers over all L values (each row's slice re-read per pass, from
// cache), not loaded and stored per value. Each sum is still one fma chain over l = 0 .. L - 1 from
// zero, so the output is bit-identical to accumulating in memory.
constexpr int PV_NV = VL >= 16 ? 4 : 2;
template <int NG, int NVV, typename KT>
static inline void pv_slice(const KT* vp, const int32_t* slots, int64_t L, int64_t ss, int64_t off,
                            const float* p, int64_t Lp, float* out, int64_t D) {
  F r[NG][NVV];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NVV; ++v) r[g][v] = V::zero();
  const int64_t bytes = NVV * VL * static_cast<int64_t>(sizeof(KT));
  for (int64_t l = 0; l < L; ++l) {
    const KT* vr = vp + static_cast<int64_t>(slots[l]) * ss + off;
    if (l + PREFETCH < L) prefetch_row(vp + static_cast<int64_t>(slots[l + PREFETCH]) * ss + off, bytes);
    F vv[NVV];
    for (int v = 0; v < NVV; ++v) vv[v] = V::load(vr + v * VL);
    for (int g = 0; g < NG; ++g) {
      const F s = V::set1(p[g * Lp + l]);
      for (int v = 0; v < NVV; ++v) r[g][v] = V::fma(s, vv[v], r[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NVV; ++v) V::store(out + g * D + v * VL, r[g][v]);
}

template <int NG, typename KT>
static void pv_rows(const KT* vp, const int32_t* slots, int64_t L, int64_t ss, int64_t off, const float* p,
                    int64_t Lp, float* out, int64_t D) {
  int64_t d = 0;
  for (; d + PV_NV * VL <= D; d += PV_NV * VL) pv_slice<NG, PV_NV, KT>(vp, slots, L, ss, off + d, p, Lp, out + d, D);
  for (; d + VL <= D; d += VL) pv_slice<NG, 1, KT>(vp, slots, L, ss, off + d, p, Lp, out + d, D);
  if (d == D) return;
  for (int64_t g = 0; g < NG; ++g)
    for (int64_t e = d; e < D; ++e) out[g * D + e] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    const KT* vr = vp + static_cast<int64_t>(slots[l]) * ss + off;
    for (int64_t e = d; e < D; ++e) {
      const float vd = ld1(vr + e);
      for (int64_t g = 0; g < NG; ++g) out[g * D + e] += p[g * Lp + l] * vd;
    }
  }
}

// One (request, KV head): the group's G query rows (scaled, fp32) against the request's keys,
// a two-pass softmax in fp32 (NaN scores propagate), then p.v accumulated in fp32. T: q's and
// out's element type; KT: the pages'.
template <typename T, typename KT>
static void attention_task_t(const AttnArgs& a, int64_t task, float* scratch) {
  const int64_t D = a.D, G = a.G, b = task / a.Hkv, h = task % a.Hkv;
  const int64_t L = a.lens[b], Lp = (L + 15) / 16 * 16;
  const int32_t* slots = a.table + a.rows[b] * a.t_sr;
  const KT* kp = static_cast<const KT*>(a.k);
  const KT* vp = static_cast<const KT*>(a.v);
  float* scores = scratch;
  float* qf = scores + G * Lp;
  float* acc = qf + G * D;
  for (int64_t g = 0; g < G; ++g) {
    const T* qr = static_cast<const T*>(a.q) + b * a.q_sb + (h * G + g) * a.q_sh;
    for (int64_t d = 0; d < D; ++d) qf[g * D + d] = ld1(qr + d) * a.scale;
  }
  float m[64];  // G <= 64 (checked by the dispatcher)
  for (int64_t g = 0; g < G; ++g) m[g] = -__builtin_inff();
  const int64_t row_bytes = D * static_cast<int64_t>(sizeof(KT));
  for (int64_t l = 0; l < L; ++l) {
    const KT* kr = kp + static_cast<int64_t>(slots[l]) * a.kv_ss + h * a.kv_sh;
    if (l + PREFETCH < L) prefetch_row(kp + static_cast<int64_t>(slots[l + PREFETCH]) * a.kv_ss + h * a.kv_sh, row_bytes);
    for (int64_t g0 = 0; g0 < G; g0 += 4) {  // up to 4 query rows per pass over the key
      float s[4];
      const int64_t n = G - g0 < 4 ? G - g0 : 4;
      if (n == 4) group_dots<4>(kr, qf + g0 * D, D, s);
      else if (n == 3) group_dots<3>(kr, qf + g0 * D, D, s);
      else if (n == 2) group_dots<2>(kr, qf + g0 * D, D, s);
      else group_dots<1>(kr, qf + g0 * D, D, s);
      for (int64_t j = 0; j < n; ++j) {
        scores[(g0 + j) * Lp + l] = s[j];
        if (!(s[j] <= m[g0 + j])) m[g0 + j] = s[j];  // a NaN score makes the row NaN, as in the reference
      }
    }
  }
  float inv[64];
  for (int64_t g = 0; g < G; ++g) {
    float* sg = scores + g * Lp;
    for (int64_t l = L; l < Lp; ++l) sg[l] = -__builtin_inff();  // exp gives 0
    const F mv = V::set1(m[g]);
    F sum = V::zero();
    for (int64_t l = 0; l < Lp; l += VL) {  // Lp % 16 == 0 and VL divides 16
      const F e = V::exp(V::sub(V::load(sg + l), mv));
      V::store(sg + l, e);
      sum = V::add(sum, e);
    }
    const float total = V::hsum(sum);
    inv[g] = total > 0.f ? 1.f / total : 0.f;  // L == 0: an all-zero output
    if (total != total) inv[g] = total;
  }
#ifdef MINISGL_CPU_PV_IN_MEMORY  // the portable path: its lanes are arrays, so the tiles only spill
  for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
  for (int64_t l = 0; l < L; ++l) {
    const KT* vr = vp + static_cast<int64_t>(slots[l]) * a.kv_ss + h * a.kv_sh;
    if (l + PREFETCH < L) prefetch_row(vp + static_cast<int64_t>(slots[l + PREFETCH]) * a.kv_ss + h * a.kv_sh, row_bytes);
    int64_t d = 0;
    for (; d + VL <= D; d += VL) {
      const F vv = V::load(vr + d);
      for (int64_t g = 0; g < G; ++g) {
        float* ag = acc + g * D + d;
        V::store(ag, V::fma(V::set1(scores[g * Lp + l]), vv, V::load(ag)));
      }
    }
    for (; d < D; ++d) {
      const float vd = ld1(vr + d);
      for (int64_t g = 0; g < G; ++g) acc[g * D + d] += scores[g * Lp + l] * vd;
    }
  }
#else
  for (int64_t g0 = 0; g0 < G; g0 += 3) {  // p.v in register tiles of up to 3 rows x PV_NV vectors
    const int64_t ng = G - g0 < 3 ? G - g0 : 3;
    if (ng == 3) pv_rows<3, KT>(vp, slots, L, a.kv_ss, h * a.kv_sh, scores + g0 * Lp, Lp, acc + g0 * D, D);
    else if (ng == 2) pv_rows<2, KT>(vp, slots, L, a.kv_ss, h * a.kv_sh, scores + g0 * Lp, Lp, acc + g0 * D, D);
    else pv_rows<1, KT>(vp, slots, L, a.kv_ss, h * a.kv_sh, scores + g0 * Lp, Lp, acc + g0 * D, D);
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    T* orow = static_cast<T*>(a.out) + b * a.o_sb + (h * G + g) * a.o_sh;
    const F iv = V::set1(inv[g]);
    int64_t d = 0;
    for (; d + VL <= D; d += VL) V::store(orow + d, V::mul(V::load(acc + g * D + d), iv));
    for (; d < D; ++d) st1(orow + d, acc[g * D + d] * inv[g]);
  }
}

template <typename T>
static void attention_task_q(int kv_dt, const AttnArgs& a, int64_t task, float* scratch) {
  if (kv_dt == DT_F16) attention_task_t<T, Half>(a, task, scratch);
  else if (kv_dt == DT_BF16) attention_task_t<T, uint16_t>(a, task, scratch);
  else attention_task_t<T, float>(a, task, scratch);
}

void attention_task(int dt, int kv_dt, const AttnArgs& a, int64_t task, float* scratch) {
  if (dt == DT_BF16) attention_task_q<uint16_t>(kv_dt, a, task, scratch);
  else attention_task_q<float>(kv_dt, a, task, scratch);
}
