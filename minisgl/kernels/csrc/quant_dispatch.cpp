// C entry points of the quantized CPU kernels (loaded with ctypes by minisgl/kernels/cpu_quant.py):
// runtime ISA choice (cpuid through __builtin_cpu_supports) and the OpenMP split over output rows.
// Built with the compiler's default flags; the ISA code lives in quant_{avx512,avx2,portable}.cpp.
#include <cstdint>
#include <cstdlib>
#include <omp.h>

#include "quant_types.h"

namespace minisgl_quant {

#define MINISGL_QUANT_DECLARE(NS)                                                                   \
  namespace NS {                                                                                    \
  int gemv(int qtype, const uint8_t* w, int64_t rb, const float* x, int64_t M, int64_t K, float* y, \
           int64_t N, int64_t n0, int64_t n1);                                                      \
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

// The row range of thread t of nt over N rows, in whole units of `align` rows.
static inline void split_rows(int64_t N, int64_t align, int t, int nt, int64_t* n0, int64_t* n1) {
  const int64_t units = (N + align - 1) / align;
  const int64_t u0 = units * t / nt, u1 = units * (t + 1) / nt;
  *n0 = u0 * align < N ? u0 * align : N;
  *n1 = u1 * align < N ? u1 * align : N;
}

}  // namespace minisgl_quant

using namespace minisgl_quant;

extern "C" {

int minisgl_quant_isas_compiled() { return compiled_mask(); }
int minisgl_quant_isas_cpu() { return cpu_mask(); }

// y[M, N] = x[M, K] @ W^T, W = N rows of `rb` bytes of GGUF blocks of type `qtype`.
// mode 0: GEMV (dequantize in registers, for few rows), 1: GEMM (dequantize panels to fp32).
// Returns 0, or 1 for an unknown type, 2 for an ISA not compiled in or not supported by the CPU,
// 3 for K not a multiple of the block size, 4 for an allocation failure.
int minisgl_quant_matmul(int qtype, const uint8_t* w, int64_t rb, int64_t N, const float* x, int64_t M,
                         int64_t K, float* y, int isa, int mode, int nthreads) {
  if (!(compiled_mask() & cpu_mask() & (1 << isa))) return 2;
  if (block_size(qtype) == 0 || K % block_size(qtype) != 0) return 3;
  if (M <= 0 || N <= 0) return 0;
  const int64_t align = mode == 0 ? 16 : GEMM_NB;
  int64_t units = (N + align - 1) / align;
  int nt = nthreads < 1 ? 1 : nthreads;
  if (nt > units) nt = (int)units;
  // GEMM: x is packed once (each thread its share of k), shared by all threads after a barrier.
  float* xp = nullptr;
  if (mode != 0) {
    const int64_t mp = (M + GEMM_XB_MAX - 1) / GEMM_XB_MAX * GEMM_XB_MAX;
    xp = (float*)aligned_alloc(64, (size_t)(mp * K * sizeof(float) + 63) / 64 * 64);
    if (xp == nullptr) return 4;
  }
  int status = 0;
#pragma omp parallel num_threads(nt) reduction(| : status)
  {
    const int t = omp_get_thread_num(), tn = omp_get_num_threads();
    if (mode != 0) {
#ifdef MINISGL_QUANT_HAVE_X86
      if (isa == ISA_AVX512) avx512::pack_x(x, M, K, xp, t, tn);
      else if (isa == ISA_AVX2) avx2::pack_x(x, M, K, xp, t, tn);
      else
#endif
        portable::pack_x(x, M, K, xp, t, tn);
#pragma omp barrier
    }
    int64_t n0, n1;
    split_rows(N, align, t, tn, &n0, &n1);
    if (n0 < n1) {
      if (mode == 0) {
#ifdef MINISGL_QUANT_HAVE_X86
        if (isa == ISA_AVX512) status |= avx512::gemv(qtype, w, rb, x, M, K, y, N, n0, n1);
        else if (isa == ISA_AVX2) status |= avx2::gemv(qtype, w, rb, x, M, K, y, N, n0, n1);
        else
#endif
          status |= portable::gemv(qtype, w, rb, x, M, K, y, N, n0, n1);
      } else {
        const int64_t kp = (K + GEMM_KC - 1) / GEMM_KC * GEMM_KC;
        float* scratch = (float*)aligned_alloc(64, (size_t)(GEMM_NB * kp * sizeof(float) + 63) / 64 * 64);
        if (scratch == nullptr) {
          status |= 4;
        } else {
#ifdef MINISGL_QUANT_HAVE_X86
          if (isa == ISA_AVX512) status |= avx512::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
          else if (isa == ISA_AVX2) status |= avx2::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
          else
#endif
            status |= portable::gemm(qtype, w, rb, xp, M, K, y, N, n0, n1, scratch);
          free(scratch);
        }
      }
    }
  }
  free(xp);
  return status;
}

// out[N, K] = the fp32 weights (the kernels' own dequantizer, for tests and for float fallbacks).
int minisgl_quant_dequantize(int qtype, const uint8_t* w, int64_t rb, int64_t N, int64_t K, float* out,
                             int isa, int nthreads) {
  if (!(compiled_mask() & cpu_mask() & (1 << isa))) return 2;
  if (K % block_size(qtype) != 0) return 3;
  int status = 0;
  int nt = nthreads < 1 ? 1 : nthreads;
  if (nt > N) nt = N < 1 ? 1 : (int)N;
#pragma omp parallel num_threads(nt) reduction(| : status)
  {
    int64_t n0, n1;
    split_rows(N, 1, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
    if (n0 < n1) {
#ifdef MINISGL_QUANT_HAVE_X86
      if (isa == ISA_AVX512) status |= avx512::dequantize(qtype, w, rb, K, n0, n1, out);
      else if (isa == ISA_AVX2) status |= avx2::dequantize(qtype, w, rb, K, n0, n1, out);
      else
#endif
        status |= portable::dequantize(qtype, w, rb, K, n0, n1, out);
    }
  }
  return status;
}

}  // extern "C"
