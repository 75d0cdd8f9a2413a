
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <tuple>

using bf16 = at::BFloat16;

static inline float f(bf16 v) { return static_cast<float>(v); }
static inline float r(float v) { return static_cast<float>(bf16(v)); }  // round to bf16 and back

static void check_bf16(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, what, ": bf16 CPU tensor expected");
}

// The optional bias of a linear layer: [N] bf16, or nullptr.
static const bf16* bias_data(const c10::optional<at::Tensor>& bias, int64_t N, const char* what) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  check_bf16(*bias, what);
  TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), what, ": [N] expected");
  return bias->data_ptr<bf16>();
}

// ---------------------------------------------------------------- GEMV
static inline float dot(const bf16* a, const bf16* b, int64_t K) {
  int64_t k = 0;
  float s = 0.f;
#if defined(__AVX512BF16__)
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; k + 64 <= K; k += 64) {
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
    acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + k + 32), (__m512bh)_mm512_loadu_si512(b + k + 32));
  }
  for (; k + 32 <= K; k += 32)
    acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + k), (__m512bh)_mm512_loadu_si512(b + k));
  s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#endif
  for (; k < K; ++k) s += f(a[k]) * f(b[k]);
  return s;
}

// x [1, K], w [N, K] (rows contiguous), bias [N] or empty -> [1, N]
at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_bf16(x, "gemv x");
  check_bf16(w, "gemv weight");
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w.dim() == 2 && w.size(1) == x.size(1), "gemv: x [1, K], w [N, K]");
  TORCH_CHECK(w.stride(1) == 1 && x.stride(1) == 1, "gemv: unit stride along K");
  const int64_t N = w.size(0), K = w.size(1), ws = w.stride(0);
  at::Tensor out = at::empty({1, N}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  const bf16* bp = bias_data(bias, N, "gemv bias");
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, N, 32, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      float s = dot(wp + n * ws, xp, K);
      op[n] = bf16(bp ? r(s) + f(bp[n]) : s);  // with a bias: as F.linear's out + bias in bf16
    }
  });
  return out;
}

// x [M, K] (rows unit-stride), w [N, K] -> [M, N], for a few rows (a decode batch): register tiles
// of 4 weight rows x 6 input rows (24 fp32 accumulators), so each weight chunk loaded from memory
// feeds 6 dot-product instructions; threads split the weight rows. K % 32 == 0.
bool has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
template <int NB, int MB>
static inline void tile(const bf16* x, int64_t xs, const bf16* w, int64_t ws, int64_t K, float* res) {
  __m512 acc[NB][MB];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < MB; ++i) acc[j][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * ws + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i * xs + k);
      for (int j = 0; j < NB; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], wv[j], xv);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < NB; ++j) res[i * NB + j] = _mm512_reduce_add_ps(acc[j][i]);
}

template <int NB, int MB, typename Put>
static void gemm_tiles(const bf16* xp, int64_t xs, const bf16* wp, int64_t ws, int64_t M, int64_t N, int64_t K,
                       const Put& put) {
  at::parallel_for(0, (N + NB - 1) / NB, 4, [&](int64_t begin, int64_t end) {
    float res[NB * MB];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t n = blk * NB;
      if (n + NB > N) {  // the last, partial block of weight rows
        for (int64_t nn = n; nn < N; ++nn)
          for (int64_t m = 0; m < M; ++m) put(m, nn, dot(wp + nn * ws, xp + m * xs, K));
        continue;
      }
      int64_t m0 = 0;
      for (; m0 + MB <= M; m0 += MB) {
        tile<NB, MB>(xp + m0 * xs, xs, wp + n * ws, ws, K, res);
        for (int64_t i = 0; i < MB; ++i)
          for (int64_t j = 0; j < NB; ++j) put(m0 + i, n + j, res[i * NB + j]);
      }
      for (; m0 < M; ++m0) {  // leftover input rows, one at a time
        tile<NB, 1>(xp + m0 * xs, xs, wp + n * ws, ws, K, res);
        for (int64_t j = 0; j < NB; ++j) put(m0, n + j, res[j]);
      }
    }
  });
}
#endif

at::Tensor gemm_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  check_bf16(x, "gemm x");
  check_bf16(w, "gemm weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "gemm: x [M, K], w [N, K]");
  TORCH_CHECK(w.stride(1) == 1 && x.stride(1) == 1 && x.size(1) % 32 == 0, "gemm: unit stride along K, K % 32 == 0");
  TORCH_CHECK(has_bf16_dot(), "gemm: needs AVX-512 BF16");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1), ws = w.stride(0), xs = x.stride(0);
  at::Tensor out = at::empty({M, N}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  const bf16* bp = bias_data(bias, N, "gemm bias");
  bf16* op = out.data_ptr<bf16>();
  auto put = [&](int64_t m, int64_t n, float s) { op[m * N + n] = bf16(bp ? r(s) + f(bp[n]) : s); };
#if defined(__AVX512BF16__)
  gemm_tiles<4, 6>(xp, xs, wp, ws, M, N, K, put);
#endif
  return out;
}

// ---------------------------------------------------------------- RMSNorm
// One row: out = bf16(w * bf16(x * rsqrt(mean(x^2) + eps))), all in fp32 between roundings.
static inline void norm_row(const float* x, const bf16* w, int64_t H, double eps, bf16* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) ss += x[i] * x[i];
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(H) + static_cast<float>(eps));
  for (int64_t i = 0; i < H; ++i) out[i] = bf16(f(w[i]) * r(x[i] * scale));
}

// x [T, H] (rows may be strided, unit stride along H) -> [T, H]
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_bf16(x, "rms_norm x");
  check_bf16(w, "rms_norm weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(x.dim() >= 1 && H > 0 && w.numel() == H && w.is_contiguous() && x.stride(-1) == 1, "rms_norm: shapes");
  at::Tensor xs = x.reshape({-1, H});
  const int64_t T = xs.size(0), xstride = xs.stride(0);
  at::Tensor out = at::empty({T, H}, x.options());
  const bf16* xp = xs.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; ++i) row[i] = f(xp[t * xstride + i]);
      norm_row(row.data(), wp, H, eps, op + t * H);
    }
  });
  return out.view(x.sizes());
}

// (rms_norm(bf16(x + residual)), bf16(x + residual)) as new tensors; x, residual [T, H] contiguous.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w, double eps) {
  check_bf16(x, "add_rms_norm x");
  check_bf16(residual, "add_rms_norm residual");
  check_bf16(w, "add_rms_norm weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(x.dim() >= 1 && H > 0 && x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous()
              && w.numel() == H && w.is_contiguous(), "add_rms_norm: shapes");
  const int64_t T = x.numel() / H;
  at::Tensor out = at::empty_like(x), total = at::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* rp = residual.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  bf16* tp = total.data_ptr<bf16>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = 0; i < H; ++i) {
        const bf16 s = bf16(f(xp[t * H + i]) + f(rp[t * H + i]));
        tp[t * H + i] = s;
        row[i] = f(s);
      }
      norm_row(row.data(), wp, H, eps, op + t * H);
    }
  });
  return {out, total};
}

// ---------------------------------------------------------------- rotary
// One head in place in `buf` (fp32 values already rounded to bf16): neox halves, the reference's
// eager bf16 rounding: bf16(bf16(x * c) + bf16(rot * s)) with c, s rounded to bf16.
static inline void rotate_head(const float* x, const float* c, const float* s, int64_t half, bf16* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    out[i] = bf16(r(x1 * c[i]) + r(-x2 * s[i]));
    out[i + half] = bf16(r(x2 * c[i]) + r(x1 * s[i]));
  }
}

// q [T, Hq, D], k [T, Hk, D] (views of a fused buffer: any token/head strides, unit stride on D),
// positions [T] int64, cos/sin [P, D/2] fp32; optional per-head norm weights [D] (Qwen3) first.
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& positions, const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& cos, const at::Tensor& sin,
                                          const c10::optional<at::Tensor>& q_weight, const c10::optional<at::Tensor>& k_weight,
                                          double q_eps, double k_eps) {
  check_bf16(q, "rotary q");
  check_bf16(k, "rotary k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0), "rotary: q [T, Hq, D], k [T, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary: unit stride along D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(), "rotary: fp32 tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0), "rotary: int64 positions [T]");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == half && sin.sizes() == cos.sizes(), "rotary: even D, tables [P, D/2]");
  TORCH_CHECK(cos.device().is_cpu() && sin.device().is_cpu() && positions.device().is_cpu(), "rotary: CPU tensors");
  const bool norm = q_weight.has_value() && q_weight->defined();
  if (norm) {
    TORCH_CHECK(k_weight.has_value() && k_weight->defined(), "rotary: q and k norm weights together");
    check_bf16(*q_weight, "rotary q norm weight");
    check_bf16(*k_weight, "rotary k norm weight");
    TORCH_CHECK(q_weight->numel() == D && k_weight->numel() == D && q_weight->is_contiguous() && k_weight->is_contiguous(),
                "rotary: per-head norm weights [D]");
  }
  const bf16* qw = norm ? q_weight->data_ptr<bf16>() : nullptr;
  const bf16* kw = norm ? k_weight->data_ptr<bf16>() : nullptr;
  at::Tensor qo = at::empty({T, Hq, D}, q.options()), ko = at::empty({T, Hk, D}, k.options());
  const int64_t* pp = positions.data_ptr<int64_t>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t P = cos.size(0);
  at::parallel_for(0, T * (Hq + Hk), 8, [&](int64_t begin, int64_t end) {
    std::vector<float> c(half), s(half), x(D);
    std::vector<bf16> normed(D);
    int64_t last_t = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (Hq + Hk), h = task % (Hq + Hk);
      if (t != last_t) {
        const int64_t pos = pp[t];
        TORCH_CHECK(pos >= 0 && pos < P, "rotary: position out of the table");
        for (int64_t i = 0; i < half; ++i) { c[i] = r(cp[pos * half + i]); s[i] = r(sp[pos * half + i]); }
        last_t = t;
      }
      const bool is_q = h < Hq;
      const bf16* src = is_q ? q.data_ptr<bf16>() + t * q.stride(0) + h * q.stride(1)
                             : k.data_ptr<bf16>() + t * k.stride(0) + (h - Hq) * k.stride(1);
      bf16* dst = is_q ? qo.data_ptr<bf16>() + (t * Hq + h) * D : ko.data_ptr<bf16>() + (t * Hk + h - Hq) * D;
      for (int64_t i = 0; i < D; ++i) x[i] = f(src[i]);
      if (norm) {
        norm_row(x.data(), is_q ? qw : kw, D, is_q ? q_eps : k_eps, normed.data());
        for (int64_t i = 0; i < D; ++i) x[i] = f(normed[i]);
      }
      rotate_head(x.data(), c.data(), s.data(), half, dst);
    }
  });
  return {qo, ko};
}

// ---------------------------------------------------------------- SiLU and mul
// x [T, 2I] = [gate | up] -> [T, I]: bf16(bf16(silu(gate)) * up)
at::Tensor silu_and_mul(const at::Tensor& x) {
  check_bf16(x, "silu_and_mul x");
  TORCH_CHECK(x.stride(-1) == 1 && x.size(-1) % 2 == 0, "silu_and_mul: [.., 2I], unit stride");
  const int64_t I = x.size(-1) / 2;
  at::Tensor xs = x.reshape({-1, 2 * I});
  const int64_t T = xs.size(0), xstride = xs.stride(0);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty({T, I}, x.options());
  const bf16* xp = xs.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t chunk = 512;  // columns per task: small rows stay on one thread, batches spread
  const int64_t per_row = (I + chunk - 1) / chunk;
  at::parallel_for(0, T * per_row, std::max<int64_t>(1, 8192 / chunk), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / per_row, i0 = (task % per_row) * chunk, i1 = std::min(I, i0 + chunk);
      int64_t i = i0;
#if defined(__AVX512BF16__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= i1; i += 16) {
        const __m512 g = bf16x16_to_ps(xp + t * xstride + i), u = bf16x16_to_ps(xp + t * xstride + I + i);
        const __m512 s = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(op + t * I + i), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(s, u)));
      }
#endif
      for (; i < i1; ++i) {
        const float g = f(xp[t * xstride + i]), u = f(xp[t * xstride + I + i]);
        op[t * I + i] = bf16(r(g / (1.f + std::exp(-g))) * u);
      }
    }
  });
  return out.view(shape);
}
