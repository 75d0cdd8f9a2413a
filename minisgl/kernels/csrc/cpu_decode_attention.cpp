
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// The tensors of one call as pointers and strides: q [B, Hq, D], pools [S, Hkv, D] (K and V share
// strides), table [R, C] int32 slots, rows [B] int64, seq_lens [B] int32, out [B, Hq, D].
template <typename T>
struct Paged {
  int64_t B, D, Hkv, G;
  const T *qp, *kp, *vp;
  const int32_t* tp;
  const int64_t* rp;
  const int32_t* lp;
  T* op;
  int64_t q_sb, q_sh, kv_ss, kv_sh, t_sr, o_sb, o_sh;
  Paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& table,
        const at::Tensor& rows, const at::Tensor& seq_lens, at::Tensor& out)
      : B(q.size(0)), D(q.size(2)), Hkv(k_cache.size(1)), G(q.size(1) / k_cache.size(1)),
        qp(q.data_ptr<T>()), kp(k_cache.data_ptr<T>()), vp(v_cache.data_ptr<T>()), tp(table.data_ptr<int32_t>()),
        rp(rows.data_ptr<int64_t>()), lp(seq_lens.data_ptr<int32_t>()), op(out.data_ptr<T>()),
        q_sb(q.stride(0)), q_sh(q.stride(1)), kv_ss(k_cache.stride(0)), kv_sh(k_cache.stride(1)),
        t_sr(table.stride(0)), o_sb(out.stride(0)), o_sh(out.stride(1)) {}
  // Request b's slot table, and the rows one (request, head) task reads and writes.
  const int32_t* slots(int64_t b) const { return tp + rp[b] * t_sr; }
  const T* q_row(int64_t b, int64_t head) const { return qp + b * q_sb + head * q_sh; }
  const T* k_row(int32_t slot, int64_t h) const { return kp + static_cast<int64_t>(slot) * kv_ss + h * kv_sh; }
  const T* v_row(int32_t slot, int64_t h) const { return vp + static_cast<int64_t>(slot) * kv_ss + h * kv_sh; }
  T* out_row(int64_t b, int64_t head) const { return op + b * o_sb + head * o_sh; }
};

template <typename T>
static void decode_impl(const Paged<T>& a, double scale) {
  const int64_t D = a.D, Hkv = a.Hkv, G = a.G;
  at::parallel_for(0, a.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    const Paged<T> p = a;  // a task-local copy: its fields stay in registers (no aliasing with the stores)
    std::vector<float> qf(G * D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = p.lp[b];
      const int32_t* slots = p.slots(b);
      for (int64_t g = 0; g < G; ++g) {
        const T* qr = p.q_row(b, h * G + g);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * static_cast<float>(scale);
      }
      scores.assign(G * L, 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* kr = p.k_row(slots[l], h);
        float kf[512];
        for (int64_t d = 0; d < D; ++d) kf[d] = static_cast<float>(kr[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
          const float* qg = &qf[g * D];
          for (int64_t d = 0; d < D; ++d) s += qg[d] * kf[d];
          scores[g * L + l] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sg = &scores[g * L];
        float m = -INFINITY;
        for (int64_t l = 0; l < L; ++l) m = std::max(m, sg[l]);
        float sum = 0.f;
        for (int64_t l = 0; l < L; ++l) { sg[l] = std::exp(sg[l] - m); sum += sg[l]; }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t l = 0; l < L; ++l) sg[l] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const T* vr = p.v_row(slots[l], h);
        float vf[512];
        for (int64_t d = 0; d < D; ++d) vf[d] = static_cast<float>(vr[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + l];
          float* ag = &acc[g * D];
          for (int64_t d = 0; d < D; ++d) ag[d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* orow = p.out_row(b, h * G + g);
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<T>(acc[g * D + d]);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// bf16, head_dim % 32 == 0, G <= 8: q.k with `vdpbf16ps` (products of the bf16 inputs are exact in
// fp32), a vectorised two-pass softmax, p.v accumulated in fp32 registers/L1.
static void decode_bf16_avx512(const Paged<at::BFloat16>& a, double scale) {
  using bf16 = at::BFloat16;
  const int64_t D = a.D, Hkv = a.Hkv, G = a.G, C = D / 32;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, a.B * Hkv, 1, [&](int64_t begin, int64_t end) {
    const Paged<bf16> p = a;  // a task-local copy: its fields stay in registers (no aliasing with the stores)
    std::vector<float> scores;
    alignas(64) float acc[8 * 512];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = p.lp[b];
      const int32_t* slots = p.slots(b);
      __m512bh qv[8][8];
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(p.q_row(b, h * G + g) + c * 32);
      const int64_t Lp = (L + 15) / 16 * 16;
      scores.assign(G * Lp, -INFINITY);
      float m[8];
      for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY;
      for (int64_t l = 0; l < L; ++l) {
        const bf16* kr = p.k_row(slots[l], h);
        __m512bh kv[8];
        for (int64_t c = 0; c < C; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kr + c * 32);
        for (int64_t g = 0; g < G; ++g) {
          __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
          for (int64_t c = 1; c < C; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
          const float s = _mm512_reduce_add_ps(a) * sc;
          scores[g * Lp + l] = s;
          if (!(s <= m[g])) m[g] = s;  // a NaN score makes the row NaN, as in the reference
        }
      }
      float inv[8];
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * Lp;
        const __m512 mv = _mm512_set1_ps(m[g]);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t l = 0; l < Lp; l += 16) {  // padding holds -inf: exp gives 0
          const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sg + l), mv));
          _mm512_storeu_ps(sg + l, e);
          sum = _mm512_add_ps(sum, e);
        }
        const float total = _mm512_reduce_add_ps(sum);
        inv[g] = total > 0.f ? 1.f / total : 0.f;
      }
      std::fill(acc, acc + G * D, 0.f);
      for (int64_t l = 0; l < L; ++l) {
        const bf16* vr = p.v_row(slots[l], h);
        __m512 vv[16];
        for (int64_t c = 0; c < D / 16; ++c) vv[c] = bf16x16_to_ps(vr + c * 16);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 pb = _mm512_set1_ps(scores[g * Lp + l]);
          float* ag = acc + g * D;
          for (int64_t c = 0; c < D / 16; ++c)
            _mm512_storeu_ps(ag + c * 16, _mm512_fmadd_ps(pb, vv[c], _mm512_loadu_ps(ag + c * 16)));
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        bf16* orow = p.out_row(b, h * G + g);
        for (int64_t d = 0; d < D; ++d) orow[d] = static_cast<bf16>(acc[g * D + d] * inv[g]);
      }
    }
  });
}
#endif

at::Tensor decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor table,
                            at::Tensor rows, at::Tensor seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2) && q.size(2) <= 512);
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1);
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides()
              && q.size(1) % k_cache.size(1) == 0, "decode attention: K/V pools of one layout, Hq % Hkv == 0");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() && table.device().is_cpu()
              && rows.device().is_cpu() && seq_lens.device().is_cpu(), "decode attention: CPU tensors");
  TORCH_CHECK(table.dim() == 2 && rows.numel() >= q.size(0) && seq_lens.numel() >= q.size(0), "decode attention: one row and length per query");
  TORCH_CHECK(table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt);
  TORCH_CHECK(table.stride(1) == 1 && rows.is_contiguous() && seq_lens.is_contiguous());
  for (int64_t b = 0; b < q.size(0); ++b) {  // O(B): every read below stays inside the table
    const int64_t row = rows.data_ptr<int64_t>()[b], len = seq_lens.data_ptr<int32_t>()[b];
    TORCH_CHECK(row >= 0 && row < table.size(0) && len >= 0 && len <= table.size(1), "decode attention: row or length outside the token table");
  }
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  if (q.scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
    const int64_t D = q.size(2), G = q.size(1) / k_cache.size(1);
    if (D % 32 == 0 && D <= 256 && G <= 8) {  // q's unit stride on D is checked above
      decode_bf16_avx512(Paged<at::BFloat16>(q, k_cache, v_cache, table, rows, seq_lens, out), scale);
      return out;
    }
#endif
    decode_impl(Paged<at::BFloat16>(q, k_cache, v_cache, table, rows, seq_lens, out), scale);
  } else if (q.scalar_type() == at::kFloat) {
    decode_impl(Paged<float>(q, k_cache, v_cache, table, rows, seq_lens, out), scale);
  } else {
    TORCH_CHECK(false, "cpu decode attention: bf16 or fp32 only");
  }
  return out;
}
