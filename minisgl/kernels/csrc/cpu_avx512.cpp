// AVX-512 (F/BW/VL/DQ + FMA) path of the float CPU kernels: the generic kernels with 16 lanes,
// bf16 loaded and stored by shifts. Compiled for that target through a target pragma / attribute,
// as cpu_avx2.cpp explains. Where the CPU also has AVX512-BF16, the dispatcher sends bf16 GEMV /
// small GEMM and decode attention to cpu_avx512bf16.cpp instead (vdpbf16ps dot products).
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_kernels.h"

#if defined(__x86_64__) && !defined(CPU_PORTABLE_ONLY)
#include <immintrin.h>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#endif

namespace minisgl_cpu {
namespace avx512 {

#include "cpu_avx512_v.h"

#include "cpu_kernels_impl.h"

struct VX {
  static inline V::F max(V::F a, V::F b) { return _mm512_max_ps(a, b); }
};
#include "cpu_extend.h"
#include "cpu_sample.h"

}  // namespace avx512
}  // namespace minisgl_cpu

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
