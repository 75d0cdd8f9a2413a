// Shared declarations of the float CPU kernels (kernels/cpu_ops.py, kernels/cpu_attention.py):
// ISA ids, the plain argument structs, and the per-ISA entry points. Only constants, aggregates and
// declarations: the ISA translation units include it under their target attributes, so nothing
// here may define a function (an inline function compiled for AVX-512 could be linked into the
// portable path).
#pragma once
#include <cstdint>

namespace minisgl_cpu {

// ISA ids, also the bit positions of the masks that minisgl_cpu_isas_* return.
// ISA_AVX512: F/BW/VL/DQ; ISA_AVX512BF16: the same plus the AVX512-BF16 instructions.
enum Isa : int { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512BF16 = 3 };
// Element types of the activations and weights: fp32, or bf16 stored as its 16 bits; the decode
// attention's K/V pages may also be fp16 (IEEE half, `Half`), read into fp32 math.
enum Dtype : int { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
// An fp16 element's bits: its own type, so the kernels overload on it apart from bf16's uint16_t.
struct Half {
  uint16_t bits;
};

// RMSNorm over rows of H: out = w * round(x * rsqrt(mean(x^2) + eps)); with `res`, x is first
// replaced by round(x + res), which is also written to `total`. out, res, total: [T, H] contiguous.
struct NormArgs {
  const void* x;
  int64_t xs;  // x's row stride (elements)
  const void* res;
  void* total;
  const void* w;
  void* out;
  int64_t H;
  float eps;
};

// Neox rotary of q [T, Hq, D] and k [T, Hk, D] (strided views, unit stride on D) into contiguous
// qo / ko, after an optional per-head RMSNorm (qw / kw, Qwen3). cos / sin: fp32 [P, D/2].
struct RotaryArgs {
  const int64_t* pos;
  const void* q;
  int64_t qs0, qs1;
  const void* k;
  int64_t ks0, ks1;
  int64_t Hq, Hk, D;
  const float* cos;
  const float* sin;
  const void* qw;
  const void* kw;
  float q_eps, k_eps;
  void* qo;
  void* ko;
};

// x [T, 2I] = [gate | up] (row stride xs) -> out [T, I]; tasks are (row, chunk of SILU_CHUNK).
struct SiluArgs {
  const void* x;
  int64_t xs, I, per_row;
  void* out;
};
constexpr int64_t SILU_CHUNK = 512;

// out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N]); xf: x converted to fp32, [M, K] contiguous.
struct LinearArgs {
  const void* x;
  int64_t xs;
  const float* xf;
  const void* w;
  int64_t ws;
  const void* bias;
  void* out;
  int64_t M, N, K;
};

// Paged decode attention: q [B, Hq, D]; pools [S, Hkv, D] (K and V share strides); table [R, C]
// int32 slots; rows [B] int64; lens [B] int32; out [B, Hq, D]. One task per (request, KV head).
// q and out are of the activations' dtype `dt`, the pools of `kv_dt` (fp32, bf16 or fp16).
struct AttnArgs {
  const void* q;
  int64_t q_sb, q_sh;
  const void* k;
  const void* v;
  int64_t kv_ss, kv_sh;
  const int32_t* table;
  int64_t t_sr;
  const int64_t* rows;
  const int32_t* lens;
  int64_t Hkv, G, D;
  float scale;
  void* out;
  int64_t o_sb, o_sh;
};

// Paged extend (prefill) attention (cpu_extend.h): q [T, Hq, D] (fp32 or bf16; out [T, Hq, D] of
// q's dtype), pools [S, Hkv, D] of fp32, bf16 or fp16 pages (DT_F16), table [R, C] int32 slots,
// per request rows [B] int64, lens [B] (KV length after the step) and ext [B] (new tokens) int32,
// starts [B] (first new token in T). blocks: (request << 32 | block of QB queries), one per task
// group; task = block index * Hkv + KV head. D % 16 == 0.
constexpr int64_t EXTEND_KB = 32;  // keys per block of the online softmax
struct ExtendArgs {
  const void* q;
  int64_t q_st, q_sh;
  const void* k;
  const void* v;
  int64_t kv_ss, kv_sh;
  const int32_t* table;
  int64_t t_sr;
  const int64_t* rows;
  const int32_t* lens;
  const int32_t* ext;
  const int64_t* starts;
  const int64_t* blocks;
  int64_t Hkv, G, D, QB;
  float scale;
  void* out;
  int64_t o_st, o_sh;
};

// Temperature sampling (cpu_sample.h): row r of logits [R, N] (fp32 or bf16, row stride ls) draws
// token i with probability exp(x_i / t_r) / sum_j exp(x_j / t_r), by the inverse CDF of one uniform
// u_r in [0, 1): the first i whose running sum exceeds u_r times the total. The exponentials are
// summed per block of SAMPLE_BLOCK entries (into the row's scratch, N / SAMPLE_BLOCK + 1 floats), so
// the search walks block sums and recomputes one block only.
constexpr int64_t SAMPLE_BLOCK = 256;
struct SampleArgs {
  const void* logits;
  int64_t ls, N;
  const float* temperature;  // [R], > 0
  const float* uniform;      // [R], in [0, 1)
  int64_t* out;              // [R]
};

}  // namespace minisgl_cpu

// The entry points each ISA namespace defines (cpu_kernels_impl.h writes them once).
#define MINISGL_CPU_DECLARE(NS)                                                                    \
  namespace minisgl_cpu {                                                                          \
  namespace NS {                                                                                   \
  void norm_rows(int dt, const NormArgs& a, int64_t t0, int64_t t1);                               \
  void rotary_tasks(int dt, const RotaryArgs& a, int64_t t0, int64_t t1);                          \
  void silu_tasks(int dt, const SiluArgs& a, int64_t t0, int64_t t1);                              \
  void linear_rows(int dt, const LinearArgs& a, int64_t n0, int64_t n1);                           \
  void attention_task(int dt, int kv_dt, const AttnArgs& a, int64_t task, float* scratch);        \
  }                                                                                                \
  }

// The sampler's entry point in each ISA namespace (cpu_sample.h).
#define MINISGL_CPU_DECLARE_SAMPLE(NS)                                                             \
  namespace minisgl_cpu {                                                                          \
  namespace NS {                                                                                   \
  void sample_row(int dt, const SampleArgs& a, int64_t row, float* scratch);                       \
  }                                                                                                \
  }

// The extend attention's entry point in each ISA namespace (cpu_extend.h).
#define MINISGL_CPU_DECLARE_EXTEND(NS)                                                             \
  namespace minisgl_cpu {                                                                          \
  namespace NS {                                                                                   \
  void extend_task(int qdt, int kvdt, const ExtendArgs& a, int64_t task, float* scratch);          \
  }                                                                                                \
  }
