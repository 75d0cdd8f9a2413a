// Temperature sampling of the float CPU kernels (kernels/cpp_ext.py `CpuKernels.sample`, called by
// engine/sampler.py; its torch reference is the sampler's softmax, cumsum and searchsorted).
// Included by each ISA file inside its namespace after cpu_kernels_impl.h (F, VL, ld1, exp1, the
// traits `V`) and the struct `VX` (VX::max). As cpu_kernels_impl.h, nothing from the standard library is used here.
//
// One row, three reads of its logits instead of the reference's six full-size tensors: the max; the
// exponentials exp((x - max) / t) summed per block of SAMPLE_BLOCK entries (vector sums, then
// the block sums added in order into the total); then the search: target = u * total, walk the
// block sums in the same order to the block where the running sum passes the target, recompute
// that block's exponentials and walk them. The block walk repeats the total's own additions, so
// the target always falls in some block; inside it the element sums are taken in another order
// than the block's vector sum, and where rounding leaves the target just past the block's last
// element, that last element with a nonzero weight is drawn.
//
// A row without a usable distribution (a NaN logit, every logit -inf, a +inf logit: the total is
// not a positive finite number) takes its first largest logit, NaN ignored (0 if there is none);
// the reference gives NaN probabilities there and an arbitrary index.

template <typename T>
static int64_t sample_first_max(const T* x, int64_t n) {
  int64_t best = 0;
  float bv = -__builtin_inff();
  bool found = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = ld1(x + i);
    if (v == v && (!found || v > bv)) best = i, bv = v, found = true;
  }
  return best;
}

// A token's weight exp((x - m) / t), as a vector of VL tokens and one at a time (the tails). Both
// passes below take their weights from here, so the block a walk picks holds the weights its sum
// was made of.
template <typename T>
static inline F sample_weights(const T* x, F m, F inv_t) {
  return V::exp(V::mul(V::sub(V::load(x), m), inv_t));
}
template <typename T>
static inline float sample_weight(const T* x, float m, float inv_t) {
  return exp1((ld1(x) - m) * inv_t);
}

template <typename T>
static int64_t sample_row_t(const T* x, int64_t n, float inv_t, float u, float* sums) {
  if (n <= 0) return 0;
  // 1. the max (VL lanes, then across them)
  F mv = V::set1(-__builtin_inff());
  int64_t i = 0;
  for (; i + VL <= n; i += VL) mv = VX::max(mv, V::load(x + i));
  float lanes[VL];
  V::store(lanes, mv);
  float m = -__builtin_inff();
  for (int l = 0; l < VL; ++l) m = lanes[l] > m ? lanes[l] : m;
  for (; i < n; ++i) m = ld1(x + i) > m ? ld1(x + i) : m;
  // 2. the block sums and the total
  const F mb = V::set1(m), tv = V::set1(inv_t);
  const int64_t nb = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
  float total = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t i1 = (b + 1) * SAMPLE_BLOCK < n ? (b + 1) * SAMPLE_BLOCK : n;
    F acc = V::zero();
    for (i = b * SAMPLE_BLOCK; i + VL <= i1; i += VL) acc = V::add(acc, sample_weights(x + i, mb, tv));
    float s = V::hsum(acc);
    for (; i < i1; ++i) s += sample_weight(x + i, m, inv_t);
    sums[b] = s;
    total += s;
  }
  if (!(total > 0.f) || total > 3.4e38f) return sample_first_max(x, n);
  // 3. the block where the running sum passes the target (the last one if rounding says none)
  const float target = u * total;
  float before = 0.f;
  int64_t b = 0;
  for (; b + 1 < nb; ++b) {
    if (before + sums[b] > target) break;
    before += sums[b];
  }
  // 4. inside it; a block with no weight (target rounded past the end) walks back to the last
  // element with some
  float rest = target - before;
  for (;; --b, rest = __builtin_inff()) {
    const int64_t i0 = b * SAMPLE_BLOCK, i1 = i0 + SAMPLE_BLOCK < n ? i0 + SAMPLE_BLOCK : n;
    float e[SAMPLE_BLOCK];
    for (i = i0; i + VL <= i1; i += VL) V::store(e + (i - i0), sample_weights(x + i, mb, tv));
    for (; i < i1; ++i) e[i - i0] = sample_weight(x + i, m, inv_t);
    float run = 0.f;
    int64_t last = -1;
    for (i = i0; i < i1; ++i) {
      const float w = e[i - i0];
      if (w > 0.f) {
        last = i;
        run += w;
        if (run > rest) return i;
      }
    }
    if (last >= 0) return last;
    if (b == 0) return sample_first_max(x, n);
  }
}

void sample_row(int dt, const SampleArgs& a, int64_t r, float* scratch) {
  const float inv_t = 1.f / a.temperature[r], u = a.uniform[r];
  if (dt == DT_BF16)
    a.out[r] = sample_row_t(static_cast<const uint16_t*>(a.logits) + r * a.ls, a.N, inv_t, u, scratch);
  else
    a.out[r] = sample_row_t(static_cast<const float*>(a.logits) + r * a.ls, a.N, inv_t, u, scratch);
}
