// C entry points of the quantized CPU kernels (loaded with ctypes by minisgl/kernels/cpu_quant.py):
// runtime ISA choice (cpuid through __builtin_cpu_supports) and the split over output rows (pool.h).
// Built with the compiler's default flags; the ISA code lives in quant_{avx512,avx2,portable}.cpp.
#include <cstdint>
#include <cstdlib>
#include <atomic>

#include "pool.h"
#include "quant_types.h"

namespace minisgl_quant {

using minisgl_pool::parallel_chunks;

#define MINISGL_QUANT_DECLARE(NS)                                                                   \
  namespace NS {                                                                                    \
  int64_t gemv_prep_floats(int qtype, int64_t M, int64_t K);                                       \
  void gemv_prep(int qtype, const float* x, int64_t M, int64_t K, float* out);                      \
  int gemv(int qtype, const uint8_t* w, int64_t rb, const float* x, const float* prep, int64_t M,   \
           int64_t K, float* y, int64_t N, int64_t n0, int64_t n1);                                 \
  void pack_x(const float* x, int64_t M, int64_t K, float* xp, int t, int nt);                    \
  int gemm(int qtype, const uint8_t* w, int64_t rb, const float* xp, int64_t M, int64_t K, float* y, \
           int64_t N, int64_t n0, int64_t n1, float* scratch);                                      \
  int dequantize(int qtype, const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1,        \
                 float* out);                                                                       \
  }

MINISGL_QUANT_DECLARE(portable)
#if !defined(QUANT_PORTABLE_ONLY) && defined(__x86_64__)
#define MINISGL_QUANT_HAVE_X86 1
MINISGL_QUANT_DECLARE(avx2)
MINISGL_QUANT_DECLARE(avx512)
#endif
#undef MINISGL_QUANT_DECLARE

static int compiled_mask() {
#ifdef MINISGL_QUANT_HAVE_X86
  return (1 << ISA_PORTABLE) | (1 << ISA_AVX2) | (1 << ISA_AVX512);
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
      __builtin_cpu_supports("avx512vl"))
    mask |= 1 << ISA_AVX512;
#endif
  return mask;
}

static int block_size(int qtype) {
  return qtype == QT_Q4_K || qtype == QT_Q6_K ? 256 : 32;
}

static int64_t gemv_prep_floats_isa(int isa, int qtype, int64_t M, int64_t K) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::gemv_prep_floats(qtype, M, K);
  if (isa == ISA_AVX2) return avx2::gemv_prep_floats(qtype, M, K);
#endif
  (void)isa;
  return portable::gemv_prep_floats(qtype, M, K);
}

static void gemv_prep_isa(int isa, int qtype, const float* x, int64_t M, int64_t K, float* out) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::gemv_prep(qtype, x, M, K, out);
  if (isa == ISA_AVX2) return avx2::gemv_prep(qtype, x, M, K, out);
#endif
  (void)isa;
  portable::gemv_prep(qtype, x, M, K, out);
}

static int gemv_isa(int isa, int qtype, const uint8_t* w, int64_t rb, const float* x, const float* prep,
                    int64_t M, int64_t K, float* y, int64_t N, int64_t n0, int64_t n1) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::gemv(qtype, w, rb, x, prep, M, K, y, N, n0, n1);
  if (isa == ISA_AVX2) return avx2::gemv(qtype, w, rb, x, prep, M, K, y, N, n0, n1);
#endif
  (void)isa;
  return portable::gemv(qtype, w, rb, x, prep, M, K, y, N, n0, n1);
}

static void pack_x_isa(int isa, const float* x, int64_t M, int64_t K, float* xp, int t, int nt) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::pack_x(x, M, K, xp, t, nt);
  if (isa == ISA_AVX2) return avx2::pack_x(x, M, K, xp, t, nt);
#endif
  (void)isa;
  portable::pack_x(x, M, K, xp, t, nt);
}

static int gemm_isa(int isa, int qtype, const uint8_t* w, int64_t rb, const float* xp, int64_t M, int64_t K,
                    float* y, int64_t N, int64_t n0, int64_t n1, float* scratch) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
  if (isa == ISA_AVX2) return avx2::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
#endif
  (void)isa;
  return portable::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
}

static int dequantize_isa(int isa, int qtype, const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1,
                          float* out) {
#ifdef MINISGL_QUANT_HAVE_X86
  if (isa == ISA_AVX512) return avx512::dequantize(qtype, w, rb, K, n0, n1, out);
  if (isa == ISA_AVX2) return avx2::dequantize(qtype, w, rb, K, n0, n1, out);
#endif
  (void)isa;
  return portable::dequantize(qtype, w, rb, K, n0, n1, out);
}

// This thread's GEMM panel buffer (64-byte aligned), grown to `floats` when smaller; kept for
// the thread's life (the pool's workers and the caller reuse it call after call).
// slot 0: the GEMM's panel, 1: the GEMV's prepared x (the caller's, read by the workers of its call).
static float* thread_scratch(int64_t floats, int slot = 0) {
  thread_local float* bufs[2] = {nullptr, nullptr};
  thread_local int64_t caps[2] = {0, 0};
  float*& buf = bufs[slot];
  int64_t& cap = caps[slot];
  if (cap < floats) {
    free(buf);
    buf = (float*)aligned_alloc(64, (size_t)(floats * sizeof(float) + 63) / 64 * 64);
    cap = buf == nullptr ? 0 : floats;
  }
  return buf;
}

}  // namespace minisgl_quant

using namespace minisgl_quant;

extern "C" {

int minisgl_quant_isas_compiled() { return compiled_mask(); }
int minisgl_quant_isas_cpu() { return cpu_mask(); }

// Run this library's jobs on the pool behind `entry` (another library's pool.h run_here; nullptr:
// this library's own pool again).
void minisgl_quant_adopt_pool(void* entry) { minisgl_pool::adopt(reinterpret_cast<minisgl_pool::RunFn>(entry)); }
// Whether jobs run on an adopted pool (1) or this library's own (0).
int minisgl_quant_pool_adopted() { return minisgl_pool::adopted().load() != nullptr; }

// y[M, N] = x[M, K] @ W^T, W = N rows of `rb` bytes of GGUF blocks of type `qtype`.
// mode 0: GEMV (dequantize in registers, for few rows), 1: GEMM (dequantize panels to fp32).
// Returns 0, or 1 for an unknown type, 2 for an ISA not compiled in or not supported by the CPU,
// 3 for K not a multiple of the block size, 4 for an allocation failure.
// The output rows are split into chunks claimed by up to `nthreads` threads (pool.h): several
// chunks per thread, so a thread that starts late (a loaded core) leaves its share to the others.
int minisgl_quant_matmul(int qtype, const uint8_t* w, int64_t rb, int64_t N, const float* x, int64_t M,
                         int64_t K, float* y, int isa, int mode, int nthreads) {
  if (!(compiled_mask() & cpu_mask() & (1 << isa))) return 2;
  if (block_size(qtype) == 0 || K % block_size(qtype) != 0) return 3;
  if (M <= 0 || N <= 0) return 0;
  const int nt = nthreads < 1 ? 1 : nthreads;
  std::atomic<int> status{0};
  if (mode == 0) {
    // Chunks of whole 16-row blocks: at least 8 per thread, and at most ~64 KB of weights each
    // (~10 us), so that a thread preempted inside its chunk holds the call up for little.
    const int64_t units = (N + 15) / 16, by_bytes = (N * rb + 65535) / 65536;
    const int64_t chunks = by_bytes > 8 * nt ? by_bytes : 8 * nt, per = (units + chunks - 1) / chunks;
    // x prepared once for the path's kernel (permuted for the AVX2 lanes), on the caller's thread.
    const int64_t pf = gemv_prep_floats_isa(isa, qtype, M, K);
    float* prep = pf > 0 ? thread_scratch(pf, 1) : nullptr;
    if (pf > 0 && prep == nullptr) return 4;
    if (prep != nullptr) gemv_prep_isa(isa, qtype, x, M, K, prep);
    parallel_chunks(N, 16 * (per < 1 ? 1 : per), nt, [&](int64_t n0, int64_t n1) {
      status.fetch_or(gemv_isa(isa, qtype, w, rb, x, prep, M, K, y, N, n0, n1), std::memory_order_relaxed);
    });
    return status.load();
  }
  // GEMM: x packed once (a share of k per chunk), then whole panels of GEMM_NB rows per chunk
  // (~4 per thread: a chunk prefetches its next panel while it multiplies one).
  const int64_t mp = (M + GEMM_XB_MAX - 1) / GEMM_XB_MAX * GEMM_XB_MAX;
  float* xp = (float*)aligned_alloc(64, (size_t)(mp * K * sizeof(float) + 63) / 64 * 64);
  if (xp == nullptr) return 4;
  const int packs = (int)(K / 64 < 4 * nt ? (K / 64 < 1 ? 1 : K / 64) : 4 * nt);
  parallel_chunks(packs, 1, nt, [&](int64_t t, int64_t) { pack_x_isa(isa, x, M, K, xp, (int)t, packs); });
  const int64_t panels = (N + GEMM_NB - 1) / GEMM_NB, per = (panels + 4 * nt - 1) / (4 * nt);
  const int64_t kp = (K + GEMM_KC - 1) / GEMM_KC * GEMM_KC;
  parallel_chunks(N, GEMM_NB * (per < 1 ? 1 : per), nt, [&](int64_t n0, int64_t n1) {
    float* scratch = thread_scratch(GEMM_NB * kp);
    const int rc = scratch == nullptr ? 4 : gemm_isa(isa, qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
    status.fetch_or(rc, std::memory_order_relaxed);
  });
  free(xp);
  return status.load();
}

// minisgl_quant_matmul with the matrix's facts in one array (a QuantMatrix's `desc`: qtype, weight
// pointer, row bytes, N, K) and isa | mode << 8 | nthreads << 16 in `flags`: 5 arguments instead of
// 11, which saves ctypes ~2 us of argument conversion per call (121 calls a decode step).
int minisgl_quant_run(const int64_t* desc, const float* x, float* y, int64_t M, int64_t flags) {
  return minisgl_quant_matmul((int)desc[0], reinterpret_cast<const uint8_t*>(desc[1]), desc[2], desc[3], x, M,
                              desc[4], y, (int)(flags & 0xff), (int)((flags >> 8) & 0xff), (int)(flags >> 16));
}

// out[N, K] = the fp32 weights (the kernels' own dequantizer, for tests and for float fallbacks).
int minisgl_quant_dequantize(int qtype, const uint8_t* w, int64_t rb, int64_t N, int64_t K, float* out,
                             int isa, int nthreads) {
  if (!(compiled_mask() & cpu_mask() & (1 << isa))) return 2;
  if (K % block_size(qtype) != 0) return 3;
  const int nt = nthreads < 1 ? 1 : nthreads;
  std::atomic<int> status{0};
  // Chunks of at least 16 KB of output: an embedding lookup of a few tokens stays on the
  // caller's thread.
  const int64_t grain = K >= 4096 ? 1 : 4096 / K;
  parallel_chunks(N, grain, nt, [&](int64_t n0, int64_t n1) {
    status.fetch_or(dequantize_isa(isa, qtype, w, rb, K, n0, n1, out), std::memory_order_relaxed);
  });
  return status.load();
}

}  // extern "C"
