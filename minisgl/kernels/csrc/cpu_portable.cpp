// Portable path of the float CPU kernels: plain C++, no intrinsics and no target attributes, so it
// builds for any target (aarch64 included) with the compiler's default flags; the 8-lane loops
// are written so that -O3 auto-vectorizes them for whatever the baseline ISA is.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cpu_kernels.h"

namespace minisgl_cpu {
namespace portable {

struct V {
  static constexpr int VL = 8, NB = 4, MB = 2;
  struct F { float v[8]; };
  static inline F zero() { return set1(0.f); }
  static inline F set1(float a) { F r; for (int l = 0; l < 8; ++l) r.v[l] = a; return r; }
  static inline F load(const float* p) { F r; memcpy(r.v, p, sizeof r.v); return r; }
  static inline void store(float* p, F a) { memcpy(p, a.v, sizeof a.v); }
  static inline F load(const uint16_t* p) {
    F r;
    for (int l = 0; l < 8; ++l) { const uint32_t b = static_cast<uint32_t>(p[l]) << 16; memcpy(&r.v[l], &b, 4); }
    return r;
  }
  // fp16 -> fp32, exact, branch-free per lane: normals and inf/NaN rebias the exponent field,
  // subnormals are their integer mantissa times 2^-24. (GCC keeps this scalar at the x86-64
  // baseline: fp16 pages cost ~2.5x fp32 pages' attention time on this path; docs/performance.md.)
  static inline F load(const Half* p) {
    F r;
    for (int l = 0; l < 8; ++l) {
      const uint32_t h = p[l].bits, em = h & 0x7fffu;
      const float sub = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-8f;
      uint32_t sub_bits;
      memcpy(&sub_bits, &sub, 4);
      const uint32_t norm = (em << 13) + (em >= 0x7c00u ? 224u << 23 : 112u << 23);
      const uint32_t b = ((h & 0x8000u) << 16) | (em < 0x400u ? sub_bits : norm);
      memcpy(&r.v[l], &b, 4);
    }
    return r;
  }
  static inline uint16_t bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t b;
    memcpy(&b, &f, 4);
    return static_cast<uint16_t>((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
  }
  static inline void store(uint16_t* p, F a) { for (int l = 0; l < 8; ++l) p[l] = bf16(a.v[l]); }
  static inline F round_bf16(F a) {
    for (int l = 0; l < 8; ++l) { const uint32_t b = static_cast<uint32_t>(bf16(a.v[l])) << 16; memcpy(&a.v[l], &b, 4); }
    return a;
  }
  static inline F add(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
  static inline F sub(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] -= b.v[l]; return a; }
  static inline F mul(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l]; return a; }
  static inline F div(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] /= b.v[l]; return a; }
  static inline F fma(F a, F b, F c) { for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l]; return c; }
  static inline float hsum(F a) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += a.v[l];
    return s;
  }
  static inline F exp(F a);  // the scalar exp1 per lane (defined after the kernels' helpers)
};

#define MINISGL_CPU_PV_IN_MEMORY 1  // cpu_kernels_impl.h: p.v summed in memory (1.8x faster here)
#include "cpu_kernels_impl.h"
#undef MINISGL_CPU_PV_IN_MEMORY

inline V::F V::exp(F a) { for (int l = 0; l < 8; ++l) a.v[l] = exp1(a.v[l]); return a; }

struct VX {
  static inline V::F max(V::F a, V::F b) {
    for (int l = 0; l < 8; ++l) a.v[l] = b.v[l] > a.v[l] || b.v[l] != b.v[l] ? b.v[l] : a.v[l];
    return a;
  }
};
#include "cpu_extend.h"
#include "cpu_sample.h"

}  // namespace portable
}  // namespace minisgl_cpu
