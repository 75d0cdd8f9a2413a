// The Python binding of the float CPU kernels (kernels/cpp_ext.py imports it): checks the tensors
// (TORCH_CHECK: RuntimeError in Python), allocates the outputs and calls the C entry points of
// cpu_dispatch.cpp with the ISA id the caller resolved. Through pybind's tensor casters a call
// costs ~1-2 us, against ~5-10 us for the same checks and pointer reads in Python. Only the light
// ATen headers (no torch/extension.h): ~12 s of compiler time, built in parallel with the ISA files.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <tuple>

extern "C" {
int minisgl_cpu_isas_compiled();
int minisgl_cpu_isas_cpu();
void* minisgl_cpu_pool_entry();
int minisgl_cpu_rms_norm(int, int, const void*, int64_t, const void*, void*, const void*, void*, int64_t, int64_t,
                         double, int);
int minisgl_cpu_rotary(int, int, const int64_t*, const void*, int64_t, int64_t, const void*, int64_t, int64_t,
                       int64_t, int64_t, int64_t, int64_t, const float*, const float*, int64_t, const void*,
                       const void*, double, double, void*, void*, int);
int minisgl_cpu_silu_and_mul(int, int, const void*, int64_t, int64_t, int64_t, void*, int);
int minisgl_cpu_linear(int, int, const void*, int64_t, int64_t, const void*, int64_t, int64_t, int64_t,
                       const void*, void*, int);
int minisgl_cpu_decode_attention(int, int, int, const void*, int64_t, int64_t, const void*, const void*, int64_t,
                                 int64_t, const int32_t*, int64_t, int64_t, int64_t, const int64_t*,
                                 const int32_t*, int64_t, int64_t, int64_t, int64_t, double, void*, int64_t,
                                 int64_t, int);
int minisgl_cpu_extend_attention(int, int, int, const void*, int64_t, int64_t, int64_t, const void*, const void*,
                                 int64_t, int64_t, const int32_t*, int64_t, int64_t, int64_t, const int64_t*,
                                 const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t, double, void*,
                                 int64_t, int64_t, int);
int minisgl_cpu_sample(int, int, const void*, int64_t, int64_t, int64_t, const float*, const float*, int64_t*, int);
}

using at::Tensor;

namespace {

// The dtype id (0 fp32, 1 bf16) of `t`, which must be a CPU tensor of `like`'s dtype (if given).
int dtype_of(const Tensor& t, const char* what, const Tensor* like = nullptr) {
  const auto st = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (st == at::kFloat || st == at::kBFloat16) &&
                  (like == nullptr || st == like->scalar_type()),
              what, ": bf16 or fp32 CPU tensors of one dtype expected");
  return st == at::kBFloat16 ? 1 : 0;
}

void check_status(int rc, const char* what) {
  TORCH_CHECK(rc != 2, what, ": ISA not compiled in or not supported by this CPU");
  TORCH_CHECK(rc != 4, what, ": out of memory");
  TORCH_CHECK(rc != 5, what, ": position out of the table");
  TORCH_CHECK(rc != 6, what, ": row or length outside the token table");
  TORCH_CHECK(rc != 7, what, ": unsupported dtype");
  TORCH_CHECK(rc == 0, what, ": error ", rc);
}

std::tuple<int, int> isas() { return {minisgl_cpu_isas_compiled(), minisgl_cpu_isas_cpu()}; }

// x [..., H] (rows may be strided, unit stride along H), w [H] -> [..., H]
Tensor rms_norm(const Tensor& x, const Tensor& w, double eps, int isa) {
  const int dt = dtype_of(x, "rms_norm x");
  dtype_of(w, "rms_norm weight", &x);
  const int64_t H = x.dim() >= 1 ? x.size(-1) : 0;
  TORCH_CHECK(H > 0 && w.numel() == H && w.is_contiguous() && x.stride(-1) == 1, "rms_norm: shapes");
  const Tensor rows = x.dim() == 2 ? x : x.reshape({-1, H});
  Tensor out = at::empty({rows.size(0), H}, x.options());
  check_status(minisgl_cpu_rms_norm(isa, dt, rows.data_ptr(), rows.stride(0), nullptr, nullptr, w.data_ptr(),
                                    out.data_ptr(), rows.size(0), H, eps, at::get_num_threads()),
               "rms_norm");
  return x.dim() == 2 ? out : out.view(x.sizes());
}

// (rms_norm(x + residual), x + residual) as new tensors; x, residual [..., H] contiguous.
std::tuple<Tensor, Tensor> add_rms_norm(const Tensor& x, const Tensor& residual, const Tensor& w, double eps,
                                        int isa) {
  const int dt = dtype_of(x, "add_rms_norm x");
  dtype_of(residual, "add_rms_norm residual", &x);
  dtype_of(w, "add_rms_norm weight", &x);
  const int64_t H = x.dim() >= 1 ? x.size(-1) : 0;
  TORCH_CHECK(H > 0 && x.sizes() == residual.sizes() && x.is_contiguous() && residual.is_contiguous() &&
                  w.numel() == H && w.is_contiguous(),
              "add_rms_norm: shapes");
  Tensor out = at::empty_like(x), total = at::empty_like(x);
  check_status(minisgl_cpu_rms_norm(isa, dt, x.data_ptr(), H, residual.data_ptr(), total.data_ptr(), w.data_ptr(),
                                    out.data_ptr(), x.numel() / H, H, eps, at::get_num_threads()),
               "add_rms_norm");
  return {out, total};
}

// q [T, Hq, D], k [T, Hk, D] (any token/head strides, unit stride on D), positions [T] int64,
// cos/sin [P, D/2] fp32; optional per-head norm weights [D] (Qwen3) first.
std::tuple<Tensor, Tensor> rotary(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& cos,
                                  const Tensor& sin, const c10::optional<Tensor>& q_weight,
                                  const c10::optional<Tensor>& k_weight, double q_eps, double k_eps, int isa) {
  const int dt = dtype_of(q, "rotary q");
  dtype_of(k, "rotary k", &q);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(2) == k.size(2) && q.size(0) == k.size(0),
              "rotary: q [T, Hq, D], k [T, Hk, D]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "rotary: unit stride along D");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rotary: fp32 tables");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() && positions.numel() == q.size(0),
              "rotary: int64 positions [T]");
  const int64_t T = q.size(0), Hq = q.size(1), Hk = k.size(1), D = q.size(2);
  TORCH_CHECK(D % 2 == 0 && cos.dim() == 2 && cos.size(1) == D / 2 && sin.sizes() == cos.sizes(),
              "rotary: even D, tables [P, D/2]");
  TORCH_CHECK(cos.device().is_cpu() && sin.device().is_cpu() && positions.device().is_cpu(), "rotary: CPU tensors");
  const bool norm = q_weight.has_value() && q_weight->defined();
  if (norm) {
    TORCH_CHECK(k_weight.has_value() && k_weight->defined(), "rotary: q and k norm weights together");
    dtype_of(*q_weight, "rotary q norm weight", &q);
    dtype_of(*k_weight, "rotary k norm weight", &q);
    TORCH_CHECK(q_weight->numel() == D && k_weight->numel() == D && q_weight->is_contiguous() &&
                    k_weight->is_contiguous(),
                "rotary: per-head norm weights [D]");
  }
  Tensor qo = at::empty({T, Hq, D}, q.options()), ko = at::empty({T, Hk, D}, k.options());
  check_status(minisgl_cpu_rotary(isa, dt, positions.data_ptr<int64_t>(), q.data_ptr(), q.stride(0), q.stride(1),
                                  k.data_ptr(), k.stride(0), k.stride(1), T, Hq, Hk, D, cos.data_ptr<float>(),
                                  sin.data_ptr<float>(), cos.size(0), norm ? q_weight->data_ptr() : nullptr,
                                  norm ? k_weight->data_ptr() : nullptr, q_eps, k_eps, qo.data_ptr(), ko.data_ptr(),
                                  at::get_num_threads()),
               "rotary");
  return {qo, ko};
}

// x [.., 2I] = [gate | up] -> [.., I]
Tensor silu_and_mul(const Tensor& x, int isa) {
  const int dt = dtype_of(x, "silu_and_mul x");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1 && x.size(-1) % 2 == 0, "silu_and_mul: [.., 2I], unit stride");
  const int64_t I = x.size(-1) / 2;
  const Tensor rows = x.dim() == 2 ? x : x.reshape({-1, 2 * I});
  Tensor out = at::empty({rows.size(0), I}, x.options());
  check_status(minisgl_cpu_silu_and_mul(isa, dt, rows.data_ptr(), rows.stride(0), rows.size(0), I, out.data_ptr(),
                                        at::get_num_threads()),
               "silu_and_mul");
  if (x.dim() == 2) return out;
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  return out.view(shape);
}

// x [M, K] @ w [N, K]^T (+ bias [N]) -> [M, N]
Tensor linear(const Tensor& x, const Tensor& w, const c10::optional<Tensor>& bias, int isa) {
  const int dt = dtype_of(x, "gemm x");
  dtype_of(w, "gemm weight", &x);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) == x.size(1), "gemm: x [M, K], w [N, K]");
  TORCH_CHECK(x.stride(1) == 1 && w.stride(1) == 1, "gemm: unit stride along K");
  const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
  const void* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    dtype_of(*bias, "gemm bias", &x);
    TORCH_CHECK(bias->numel() == N && bias->is_contiguous(), "gemm bias: [N] expected");
    bp = bias->data_ptr();
  }
  Tensor out = at::empty({M, N}, x.options());
  check_status(minisgl_cpu_linear(isa, dt, x.data_ptr(), x.stride(0), M, w.data_ptr(), w.stride(0), N, K, bp,
                                  out.data_ptr(), at::get_num_threads()),
               "gemm");
  return out;
}

// The pools' dtype id (0 fp32, 1 bf16, 2 fp16): K and V CPU tensors of one of those, the same.
int kv_dtype_of(const Tensor& k, const Tensor& v) {
  const auto st = k.scalar_type();
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && st == v.scalar_type() &&
                  (st == at::kFloat || st == at::kBFloat16 || st == at::kHalf),
              "decode attention: K/V pools of one dtype (fp32, bf16 or fp16) on the CPU expected");
  return st == at::kHalf ? 2 : st == at::kBFloat16 ? 1 : 0;
}

// q [B, Hq, D] (fp32 or bf16; out of q's dtype); pools [S, Hkv, D] (fp32, bf16 or fp16, read as
// fp32); table [R, C] int32 slots; rows [B] int64; seq_lens [B] int32.
Tensor decode_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& table,
                        const Tensor& rows, const Tensor& seq_lens, double scale, int isa) {
  const int dt = dtype_of(q, "decode attention q");
  const int kv_dt = kv_dtype_of(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2),
              "decode attention: q [B, Hq, D], pools [S, Hkv, D]");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "decode attention: unit stride along D");
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  q.size(1) % k_cache.size(1) == 0,
              "decode attention: K/V pools of one layout, Hq % Hkv == 0");
  TORCH_CHECK(q.size(1) / k_cache.size(1) <= 64, "decode attention: at most 64 query heads per KV head");
  TORCH_CHECK(table.device().is_cpu() && rows.device().is_cpu() && seq_lens.device().is_cpu(),
              "decode attention: CPU tensors");
  const int64_t B = q.size(0);
  TORCH_CHECK(table.dim() == 2 && rows.numel() >= B && seq_lens.numel() >= B,
              "decode attention: one row and length per query");
  TORCH_CHECK(table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt,
              "decode attention: int32 table, int64 rows, int32 seq_lens");
  TORCH_CHECK(table.stride(1) == 1 && rows.is_contiguous() && seq_lens.is_contiguous(),
              "decode attention: unit-stride table rows, contiguous rows and seq_lens");
  Tensor out = at::empty({B, q.size(1), q.size(2)}, q.options());
  check_status(minisgl_cpu_decode_attention(isa, dt, kv_dt, q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(),
                                            v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                                            table.data_ptr<int32_t>(), table.stride(0), table.size(0), table.size(1),
                                            rows.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(), B, q.size(1),
                                            k_cache.size(1), q.size(2), scale, out.data_ptr(), out.stride(0),
                                            out.stride(1), at::get_num_threads()),
               "decode attention");
  return out;
}

// Paged extend attention: q [T, Hq, D] fp32/bf16; pools [S, Hkv, D] fp32, bf16 or fp16 (any of
// them with either q); per request a table row, its KV length after the step and its new tokens,
// the new tokens laid out in T request after request -> [T, Hq, D] of q's dtype.
Tensor extend_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& table,
                        const Tensor& rows, const Tensor& seq_lens, const Tensor& extend_lens, double scale,
                        int isa) {
  const int qdt = dtype_of(q, "extend attention q");
  const auto kst = k_cache.scalar_type();
  TORCH_CHECK(k_cache.device().is_cpu() && (kst == at::kFloat || kst == at::kBFloat16 || kst == at::kHalf) &&
                  v_cache.scalar_type() == kst,
              "extend attention: fp32, bf16 or fp16 CPU pools of one dtype expected");
  const int kvdt = kst == at::kFloat ? 0 : kst == at::kBFloat16 ? 1 : 2;
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && q.size(2) == k_cache.size(2) && q.size(2) % 16 == 0,
              "extend attention: q [T, Hq, D], pools [S, Hkv, D], D % 16 == 0");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1,
              "extend attention: unit stride along D");
  TORCH_CHECK(k_cache.size(1) > 0 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  q.size(1) % k_cache.size(1) == 0,
              "extend attention: K/V pools of one layout, Hq % Hkv == 0");
  TORCH_CHECK(table.device().is_cpu() && rows.device().is_cpu() && seq_lens.device().is_cpu() &&
                  extend_lens.device().is_cpu(),
              "extend attention: CPU tensors");
  const int64_t B = rows.numel();
  TORCH_CHECK(table.dim() == 2 && seq_lens.numel() == B && extend_lens.numel() == B,
              "extend attention: one row, length and extend length per request");
  TORCH_CHECK(table.scalar_type() == at::kInt && rows.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kInt &&
                  extend_lens.scalar_type() == at::kInt,
              "extend attention: int32 table, int64 rows, int32 seq_lens and extend_lens");
  TORCH_CHECK(table.stride(1) == 1 && rows.is_contiguous() && seq_lens.is_contiguous() && extend_lens.is_contiguous(),
              "extend attention: unit-stride table rows, contiguous rows and lengths");
  Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int rc = minisgl_cpu_extend_attention(
      isa, qdt, kvdt, q.data_ptr(), q.stride(0), q.stride(1), q.size(0), k_cache.data_ptr(), v_cache.data_ptr(),
      k_cache.stride(0), k_cache.stride(1), table.data_ptr<int32_t>(), table.stride(0), table.size(0), table.size(1),
      rows.data_ptr<int64_t>(), seq_lens.data_ptr<int32_t>(), extend_lens.data_ptr<int32_t>(), B, q.size(1),
      k_cache.size(1), q.size(2), scale, out.data_ptr(), out.stride(0), out.stride(1), at::get_num_threads());
  TORCH_CHECK(rc != 6, "extend attention: a row or length outside the token table, or extend lengths not summing to T");
  check_status(rc, "extend attention");
  return out;
}

// logits [R, N] (fp32 or bf16, unit stride on N), temperature and uniform [R] fp32 -> tokens [R]
// int64: row r drawn from softmax(logits[r] / temperature[r]) by the inverse CDF at uniform[r].
Tensor sample(const Tensor& logits, const Tensor& temperature, const Tensor& uniform, int isa) {
  const int dt = dtype_of(logits, "sample logits");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1 && logits.size(1) > 0, "sample: logits [R, N], unit stride");
  const int64_t R = logits.size(0);
  for (const Tensor* t : {&temperature, &uniform})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == R,
                "sample: temperature and uniform: fp32 [R] CPU tensors");
  const float* temp = temperature.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(temp[r] > 0.f, "sample: temperatures must be > 0 (greedy rows are not sampled here)");
    TORCH_CHECK(u[r] >= 0.f && u[r] < 1.f, "sample: uniforms must lie in [0, 1)");
  }
  Tensor out = at::empty({R}, logits.options().dtype(at::kLong));
  check_status(minisgl_cpu_sample(isa, dt, logits.data_ptr(), logits.stride(0), R, logits.size(1), temp, u,
                                  out.data_ptr<int64_t>(), at::get_num_threads()),
               "sample");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isas", &isas, "(compiled ISA mask, CPU ISA mask)");
  m.def("pool_entry", [] { return reinterpret_cast<int64_t>(minisgl_cpu_pool_entry()); },
        "address of the library's thread-pool entry (pool.h run_here), for another library to adopt");
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rotary", &rotary);
  m.def("silu_and_mul", &silu_and_mul);
  m.def("linear", &linear);
  m.def("decode_attention", &decode_attention);
  m.def("extend_attention", &extend_attention);
  m.def("sample", &sample);
}
