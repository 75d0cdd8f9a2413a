"""bf16 CPU kernels for the per-token work of a decoder layer: GEMV, RMSNorm (with the residual
add), rotary (with Qwen3's q/k norms), SiLU-and-mul. One small C++ extension built at engine start.

Why: decoding one request on CPU reads every weight once per token, so the weights' bytes set the
floor (~10 ms for SmolLM2 in bf16 on the 2-core CI machine), but the plain-torch layer code adds
~60 small aten ops per layer (casts, pow/mean/rsqrt, chunk/cat/neg for rotary, ...), ~15 ms more
per token, and each torch.compile'd region adds ~50 us of wrapper. Here each op is one C++ call
(a few us), with fp32 math and the reference's bf16 rounding points:

- RMSNorm: Hugging Face's order (fp32 normalise, round to bf16, times the bf16 weight, round);
  `add_rms_norm` first rounds x + residual to bf16, as the torch reference does.
- rotary: cos/sin rounded to bf16, each product rounded, the sum rounded (the reference's
  eager bf16 ops), neox halves.
- SiLU-and-mul: silu(gate) rounded to bf16, times up, rounded.
- GEMV (one row) and small GEMM (up to `SMALL_GEMM_ROWS` rows, register tiles of 4 weight rows x
  6 input rows): fp32 dot products (AVX-512 BF16 `vdpbf16ps` where the CPU has it), rounded once.
- exp for SiLU and the CPU decode attention's softmax: a vectorised 2^n * 2^f with a degree-6
  series (~1e-7 relative), `AVX512_MATH` below.

The references (`kernels/*_ref.py`) are the oracles (tests/unit/test_cpu_ops.py). Only bf16 takes
this path; fp32 stays on the references, the exact-parity mode. Off: MINISGL_CPU_KERNELS=0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from minisgl.env import ENV
from minisgl.kernels.activation_ref import silu_and_mul_ref
from minisgl.kernels.cpp_ext import CppExtension
from minisgl.kernels.norm_ref import fused_add_rms_norm_ref, rms_norm_ref
from minisgl.kernels.rotary_ref import qk_norm_rotary_ref, rotary_ref

# Vector math shared by the C++ CPU kernels (this module's and `cpu_attention`'s), prepended to
# their sources. Compiled only where the CPU has AVX-512 BF16 (`-march=native`).
AVX512_MATH = r"""
#include <torch/extension.h>
#include <cmath>
#if defined(__AVX512BF16__)
#include <immintrin.h>
// exp(x) (x <= 0 in softmax after the max shift; larger x is fine up to overflow to inf):
// 2^(x log2 e) = 2^n * 2^f, n = round, |f| <= 1/2, 2^f by its degree-6 Taylor series in f ln 2
// (truncation ~1e-7 relative), scaled by 2^n.
static inline __m512 exp_neg(__m512 x) {
  // NaN stays NaN (vmaxps returns its second operand when either is NaN); exp(-104) rounds to 0.
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 fr = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381609e-4f);  // ln2^6 / 6!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.3333558146428443e-3f));  // ln2^5 / 5!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(9.6181291076284772e-3f));  // ln2^4 / 4!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(5.5504108664821580e-2f));  // ln2^3 / 3!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(2.4022650695910071e-1f));  // ln2^2 / 2!
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(6.9314718055994531e-1f));  // ln2
  p = _mm512_fmadd_ps(p, fr, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

static inline __m512 bf16x16_to_ps(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// fp32 -> bf16 (round to nearest even) -> fp32, 16 lanes: the reference's rounding points.
static inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
#endif
"""

_SOURCE = AVX512_MATH + r"""
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
"""

_EXT = CppExtension(
    "minisgl_cpu_ops", _SOURCE,
    ["gemv", "gemm_rows", "has_bf16_dot", "rms_norm", "add_rms_norm", "rotary", "silu_and_mul"],
    enabled=ENV.cpu_kernels, switch="MINISGL_CPU_KERNELS", what="bf16 CPU kernels",
)  # fmt: skip


def load() -> Any:
    """The built extension, or None (turned off, or the build failed: then the callers keep the
    references)."""
    return _EXT.load()


def enabled() -> bool:
    """Whether the extension is (or can be) loaded; builds it on first call."""
    return load() is not None


def _ready(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and x.device.type == "cpu" and _EXT.module is not None


# Thin wrappers with the references' signatures: bf16 CPU tensors take the C++ kernel, anything
# else (fp32, the exact mode) the reference.


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _ready(x) and weight.dtype == torch.bfloat16 and x.stride(-1) == 1:
        return _EXT.module.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if (
        _ready(x) and residual.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
        and x.is_contiguous() and residual.is_contiguous() and weight.is_contiguous() and x.shape == residual.shape
    ):  # fmt: skip
        return _EXT.module.add_rms_norm(x, residual, weight, eps)
    return fused_add_rms_norm_ref(x, residual, weight, eps)


def _rotary_ok(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """What the C++ rotary takes: bf16 [T, H, D] views with unit stride on an even D, fp32 tables."""
    return (
        _ready(q) and k.dtype == torch.bfloat16 and q.dim() == k.dim() == 3 and q.shape[-1] % 2 == 0
        and q.stride(-1) == 1 and k.stride(-1) == 1 and positions.dtype == torch.int64
        and cos.dtype == sin.dtype == torch.float32
    )  # fmt: skip


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if _rotary_ok(positions, q, k, cos, sin):
        return _EXT.module.rotary(positions.contiguous(), q, k, cos, sin, None, None, 0.0, 0.0)
    return rotary_ref(positions, q, k, cos, sin)


def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_weight: torch.Tensor, k_weight: torch.Tensor, q_eps: float, k_eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    if _rotary_ok(positions, q, k, cos, sin) and q_weight.dtype == k_weight.dtype == torch.bfloat16:
        return _EXT.module.rotary(positions.contiguous(), q, k, cos, sin, q_weight, k_weight, q_eps, k_eps)
    return qk_norm_rotary_ref(positions, q, k, cos, sin, q_weight, k_weight, q_eps, k_eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if _ready(x):
        return _EXT.module.silu_and_mul(x)
    return silu_and_mul_ref(x)


# Up to this many rows the register-tiled C++ GEMM beats oneDNN's bf16 GEMM on the CI machine
# (SmolLM2's layer shapes: 2.2-3x at 2-8 rows, 1.2x at 16, even at 32); beyond, oneDNN.
SMALL_GEMM_ROWS = 16


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear`; bf16 with one row goes through the C++ GEMV, with a few rows through the
    C++ small GEMM (needs AVX-512 BF16 and K % 32 == 0); more rows keep oneDNN's GEMM."""
    if (
        _ready(x) and x.dim() == 2 and x.shape[0] <= SMALL_GEMM_ROWS and weight.dtype == torch.bfloat16
        and x.stride(1) == 1 and weight.stride(1) == 1
    ):  # fmt: skip
        if x.shape[0] == 1:
            return _EXT.module.gemv(x, weight, bias)
        if x.shape[1] % 32 == 0 and _EXT.module.has_bf16_dot():
            return _EXT.module.gemm_rows(x, weight, bias)
    return F.linear(x, weight, bias)
