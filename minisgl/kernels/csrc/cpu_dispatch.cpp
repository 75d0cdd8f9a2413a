// C entry points of the float CPU kernels (loaded with ctypes by minisgl/kernels/cpp_ext.py):
// the runtime ISA choice (cpuid through __builtin_cpu_supports), the bounds checks on positions
// and token-table reads, and the split into tasks over the thread pool (pool.h). Built with the
// compiler's default flags; the ISA code lives in cpu_{avx512bf16,avx512,avx2,portable}.cpp.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "cpu_kernels.h"
#include "pool.h"

MINISGL_CPU_DECLARE(portable)
MINISGL_CPU_DECLARE_EXTEND(portable)
MINISGL_CPU_DECLARE_SAMPLE(portable)
#if !defined(CPU_PORTABLE_ONLY) && defined(__x86_64__)
#define MINISGL_CPU_HAVE_X86 1
MINISGL_CPU_DECLARE(avx2)
MINISGL_CPU_DECLARE(avx512)
MINISGL_CPU_DECLARE(avx512bf16)
MINISGL_CPU_DECLARE_EXTEND(avx2)
MINISGL_CPU_DECLARE_EXTEND(avx512)
MINISGL_CPU_DECLARE_EXTEND(avx512bf16)
MINISGL_CPU_DECLARE_SAMPLE(avx2)
MINISGL_CPU_DECLARE_SAMPLE(avx512)
MINISGL_CPU_DECLARE_SAMPLE(avx512bf16)
namespace minisgl_cpu {
namespace avx512bf16 {
void linear_rows_dot(const LinearArgs& a, int64_t n0, int64_t n1);
bool attention_fits(int64_t D, int64_t G);
void attention_task_dot(const AttnArgs& a, int64_t task, float* scratch);
}  // namespace avx512bf16
}  // namespace minisgl_cpu
#endif

namespace minisgl_cpu {

enum Status : int { OK = 0, BAD_ISA = 2, NO_MEMORY = 4, BAD_POSITION = 5, BAD_TABLE = 6, BAD_DTYPE = 7 };

static int compiled_mask() {
#ifdef MINISGL_CPU_HAVE_X86
  return (1 << ISA_PORTABLE) | (1 << ISA_AVX2) | (1 << ISA_AVX512) | (1 << ISA_AVX512BF16);
#else
  return 1 << ISA_PORTABLE;
#endif
}

static int cpu_mask() {
  int mask = 1 << ISA_PORTABLE;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    mask |= 1 << ISA_AVX2;
  if ((mask & (1 << ISA_AVX2)) && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    mask |= 1 << ISA_AVX512;
  if ((mask & (1 << ISA_AVX512)) && __builtin_cpu_supports("avx512bf16")) mask |= 1 << ISA_AVX512BF16;
#endif
  return mask;
}

static const int CPU_MASK = cpu_mask();

static bool usable(int isa) { return isa >= 0 && isa < 8 && (compiled_mask() & CPU_MASK & (1 << isa)) != 0; }

// fn(begin, end) over [0, n) in contiguous chunks of at least `grain` tasks, ~4 per thread,
// claimed by up to nthreads threads (pool.h: no thread is waited for that has not started).
template <typename Fn>
static void parallel(int64_t n, int64_t grain, int nthreads, const Fn& fn) {
  if (n <= 0) return;
  const int nt = std::max(nthreads, 1);
  const int64_t chunk = std::max<int64_t>(std::max<int64_t>(grain, 1), (n + 4 * nt - 1) / (4 * nt));
  if (nt <= 1 || chunk >= n) {
    fn(int64_t{0}, n);
    return;
  }
  minisgl_pool::parallel_chunks(n, chunk, nt, fn);
}

// This thread's attention scratch (64-byte aligned: the accumulators' full-vector loads and
// stores must not split cache lines), grown to `floats` when smaller.
static float* thread_scratch(int64_t floats) {
  thread_local float* buf = nullptr;
  thread_local int64_t cap = 0;
  if (cap < floats) {
    free(buf);
    buf = static_cast<float*>(aligned_alloc(64, (sizeof(float) * floats + 63) / 64 * 64));
    cap = buf == nullptr ? 0 : floats;
  }
  return buf;
}

#ifdef MINISGL_CPU_HAVE_X86
#define MINISGL_CPU_CALL(isa, fn, ...)                                     \
  do {                                                                     \
    if ((isa) == ISA_AVX512BF16) avx512bf16::fn(__VA_ARGS__);              \
    else if ((isa) == ISA_AVX512) avx512::fn(__VA_ARGS__);                 \
    else if ((isa) == ISA_AVX2) avx2::fn(__VA_ARGS__);                     \
    else portable::fn(__VA_ARGS__);                                        \
  } while (0)
#else
#define MINISGL_CPU_CALL(isa, fn, ...) portable::fn(__VA_ARGS__)
#endif

}  // namespace minisgl_cpu

using namespace minisgl_cpu;

extern "C" {

int minisgl_cpu_isas_compiled() { return compiled_mask(); }
int minisgl_cpu_isas_cpu() { return CPU_MASK; }
// The entry of this library's thread pool, for the quantized kernels' library to adopt (pool.h).
void* minisgl_cpu_pool_entry() { return reinterpret_cast<void*>(&minisgl_pool::run_here); }

int minisgl_cpu_rms_norm(int isa, int dt, const void* x, int64_t xs, const void* res, void* total, const void* w,
                         void* out, int64_t T, int64_t H, double eps, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  const NormArgs a{x, xs, res, total, w, out, H, static_cast<float>(eps)};
  parallel(T, 16, nthreads, [&](int64_t b, int64_t e) { MINISGL_CPU_CALL(isa, norm_rows, dt, a, b, e); });
  return OK;
}

int minisgl_cpu_rotary(int isa, int dt, const int64_t* pos, const void* q, int64_t qs0, int64_t qs1, const void* k,
                       int64_t ks0, int64_t ks1, int64_t T, int64_t Hq, int64_t Hk, int64_t D, const float* cos,
                       const float* sin, int64_t P, const void* qw, const void* kw, double q_eps, double k_eps,
                       void* qo, void* ko, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  for (int64_t t = 0; t < T; ++t)
    if (pos[t] < 0 || pos[t] >= P) return BAD_POSITION;
  const RotaryArgs a{pos, q, qs0, qs1, k, ks0, ks1, Hq, Hk, D, cos, sin, qw, kw,
                     static_cast<float>(q_eps), static_cast<float>(k_eps), qo, ko};
  parallel(T * (Hq + Hk), 8, nthreads, [&](int64_t b, int64_t e) { MINISGL_CPU_CALL(isa, rotary_tasks, dt, a, b, e); });
  return OK;
}

int minisgl_cpu_silu_and_mul(int isa, int dt, const void* x, int64_t xs, int64_t T, int64_t I, void* out,
                             int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  const int64_t per_row = (I + SILU_CHUNK - 1) / SILU_CHUNK;  // small rows stay on one thread
  const SiluArgs a{x, xs, I, per_row, out};
  parallel(T * per_row, std::max<int64_t>(1, 8192 / SILU_CHUNK), nthreads,
           [&](int64_t b, int64_t e) { MINISGL_CPU_CALL(isa, silu_tasks, dt, a, b, e); });
  return OK;
}

// out [M, N] = x [M, K] @ w [N, K]^T (+ bias); threads split the weight rows (in blocks of 4).
int minisgl_cpu_linear(int isa, int dt, const void* x, int64_t xs, int64_t M, const void* w, int64_t ws, int64_t N,
                       int64_t K, const void* bias, void* out, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  LinearArgs a{x, xs, nullptr, w, ws, bias, out, M, N, K};
  const int64_t blocks = (N + 3) / 4, grain = M == 1 ? 8 : 4;
#ifdef MINISGL_CPU_HAVE_X86
  if (isa == ISA_AVX512BF16 && dt == DT_BF16) {
    parallel(blocks, grain, nthreads, [&](int64_t b, int64_t e) {
      avx512bf16::linear_rows_dot(a, b * 4, std::min(N, e * 4));
    });
    return OK;
  }
#endif
  std::vector<float> xf;  // x as fp32 rows, converted once (bf16: the value's bits shifted up)
  if (dt == DT_BF16 || xs != K) {
    xf.resize(static_cast<size_t>(M * K));
    for (int64_t m = 0; m < M; ++m)
      for (int64_t kk = 0; kk < K; ++kk) {
        if (dt == DT_BF16) {
          const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(x)[m * xs + kk]) << 16;
          __builtin_memcpy(&xf[m * K + kk], &bits, 4);
        } else {
          xf[m * K + kk] = static_cast<const float*>(x)[m * xs + kk];
        }
      }
    a.xf = xf.data();
  } else {
    a.xf = static_cast<const float*>(x);
  }
  parallel(blocks, grain, nthreads, [&](int64_t b, int64_t e) {
    MINISGL_CPU_CALL(isa, linear_rows, dt, a, b * 4, std::min(N, e * 4));
  });
  return OK;
}

// dt: q's and out's dtype (fp32 or bf16); kv_dt: the pools' (fp32, bf16 or fp16).
int minisgl_cpu_decode_attention(int isa, int dt, int kv_dt, const void* q, int64_t q_sb, int64_t q_sh, const void* k,
                                 const void* v, int64_t kv_ss, int64_t kv_sh, const int32_t* table, int64_t t_sr,
                                 int64_t t_rows, int64_t t_cols, const int64_t* rows, const int32_t* lens, int64_t B,
                                 int64_t Hq, int64_t Hkv, int64_t D, double scale, void* out, int64_t o_sb,
                                 int64_t o_sh, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  if ((dt != DT_F32 && dt != DT_BF16) || (kv_dt != DT_F32 && kv_dt != DT_BF16 && kv_dt != DT_F16)) return BAD_DTYPE;
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {  // O(B): every read below stays inside the table
    if (rows[b] < 0 || rows[b] >= t_rows || lens[b] < 0 || lens[b] > t_cols) return BAD_TABLE;
    max_len = std::max<int64_t>(max_len, lens[b]);
  }
  const int64_t G = Hq / Hkv;
  const AttnArgs a{q, q_sb, q_sh, k, v, kv_ss, kv_sh, table, t_sr, rows, lens, Hkv, G, D,
                   static_cast<float>(scale), out, o_sb, o_sh};
  bool bf16_dot = false;
#ifdef MINISGL_CPU_HAVE_X86
  bf16_dot = isa == ISA_AVX512BF16 && dt == DT_BF16 && kv_dt == DT_BF16 && avx512bf16::attention_fits(D, G);
#endif
  const int64_t tasks = B * Hkv;
  const int64_t scratch = G * ((max_len + 15) / 16 * 16) + 2 * G * D + 2 * D + 64;
  std::atomic<int> status{OK};
  minisgl_pool::parallel_chunks(tasks, 1, nthreads, [&](int64_t t0, int64_t t1) {
    float* buf = thread_scratch(scratch);
    if (buf == nullptr) {
      status.fetch_or(NO_MEMORY);
      return;
    }
    for (int64_t task = t0; task < t1; ++task) {
#ifdef MINISGL_CPU_HAVE_X86
      if (bf16_dot) avx512bf16::attention_task_dot(a, task, buf);
      else
#endif
        MINISGL_CPU_CALL(isa, attention_task, dt, kv_dt, a, task, buf);
    }
  });
  return status.load();
}

// Paged extend attention (cpu_extend.h): the blocks of QB queries of every request, costliest
// first (a block's cost is the keys it reads), claimed one (block, KV head) task at a time.
int minisgl_cpu_extend_attention(int isa, int qdt, int kvdt, const void* q, int64_t q_st, int64_t q_sh,
                                 int64_t T, const void* k, const void* v, int64_t kv_ss, int64_t kv_sh,
                                 const int32_t* table, int64_t t_sr, int64_t t_rows, int64_t t_cols,
                                 const int64_t* rows, const int32_t* lens, const int32_t* ext, int64_t B,
                                 int64_t Hq, int64_t Hkv, int64_t D, double scale, void* out, int64_t o_st,
                                 int64_t o_sh, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  if (qdt < DT_F32 || qdt > DT_BF16 || kvdt < DT_F32 || kvdt > DT_F16 || D % 16 != 0) return BAD_DTYPE;
  const int64_t G = Hq / Hkv;
  const int64_t QB = std::max<int64_t>(1, (isa >= ISA_AVX512 ? 64 : 32) / G);
  std::vector<int64_t> starts(static_cast<size_t>(B));
  std::vector<std::pair<int64_t, int64_t>> order;  // (cost, block)
  int64_t total = 0;
  for (int64_t b = 0; b < B; ++b) {  // O(B): every read below stays inside the table and q
    if (rows[b] < 0 || rows[b] >= t_rows || lens[b] < 0 || lens[b] > t_cols || ext[b] < 0 || ext[b] > lens[b])
      return BAD_TABLE;
    starts[b] = total;
    total += ext[b];
    const int64_t prefix = lens[b] - ext[b];
    for (int64_t i0 = 0, qb = 0; i0 < ext[b]; i0 += QB, ++qb)
      order.emplace_back(prefix + std::min<int64_t>(ext[b], i0 + QB), b << 32 | qb);
  }
  if (total != T) return BAD_TABLE;
  std::sort(order.begin(), order.end(), [](const auto& x, const auto& y) { return x.first > y.first; });
  std::vector<int64_t> blocks(order.size());
  for (size_t i = 0; i < order.size(); ++i) blocks[i] = order[i].second;
  const ExtendArgs a{q, q_st, q_sh, k, v, kv_ss, kv_sh, table, t_sr, rows, lens, ext, starts.data(), blocks.data(),
                     Hkv, G, D, QB, static_cast<float>(scale), out, o_st, o_sh};
  const int64_t RP = (QB * G + 15) / 16 * 16;
  const int64_t scratch = 2 * D * RP + EXTEND_KB * RP + 3 * RP + 2 * EXTEND_KB * D + 64;
  std::atomic<int> status{OK};
  minisgl_pool::parallel_chunks(static_cast<int64_t>(blocks.size()) * Hkv, 1, nthreads, [&](int64_t t0, int64_t t1) {
    float* buf = thread_scratch(scratch);
    if (buf == nullptr) {
      status.fetch_or(NO_MEMORY);
      return;
    }
    for (int64_t task = t0; task < t1; ++task) MINISGL_CPU_CALL(isa, extend_task, qdt, kvdt, a, task, buf);
  });
  return status.load();
}

// Temperature sampling (cpu_sample.h), one row per task; temperatures must be > 0 and uniforms
// in [0, 1) (the binding checks).
int minisgl_cpu_sample(int isa, int dt, const void* logits, int64_t ls, int64_t R, int64_t N,
                       const float* temperature, const float* uniform, int64_t* out, int nthreads) {
  if (!usable(isa)) return BAD_ISA;
  if (dt != DT_F32 && dt != DT_BF16) return BAD_DTYPE;
  const SampleArgs a{logits, ls, N, temperature, uniform, out};
  const int64_t scratch = N / SAMPLE_BLOCK + 1;
  std::atomic<int> status{OK};
  parallel(R, 1, nthreads, [&](int64_t r0, int64_t r1) {
    float* buf = thread_scratch(scratch);
    if (buf == nullptr) {
      status.fetch_or(NO_MEMORY);
      return;
    }
    for (int64_t r = r0; r < r1; ++r) MINISGL_CPU_CALL(isa, sample_row, dt, a, r, buf);
  });
  return status.load();
}

}  // extern "C"
