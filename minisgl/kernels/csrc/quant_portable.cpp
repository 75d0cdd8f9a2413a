// Portable path of the quantized CPU kernels: plain C++, no intrinsics and no target attributes,
// so it builds for any target (aarch64 included) with the compiler's default flags; the loops
// over 8 lanes are written so that -O3 auto-vectorizes them for whatever the baseline ISA is.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "quant_types.h"

namespace minisgl_quant {
namespace portable_isa {

struct V {
  static constexpr int VL = 8;
  static constexpr int GEMM_NRB = 6;
  static constexpr bool GEMV_FACTORED = false;  // quant_impl.h: gemv_tile_f
  struct F { float v[8]; };
  struct I { uint8_t b[16]; };
  static inline F zero() { F r; for (int l = 0; l < 8; ++l) r.v[l] = 0.f; return r; }
  static inline F set1(float a) { F r; for (int l = 0; l < 8; ++l) r.v[l] = a; return r; }
  static inline F load(const float* p) { F r; memcpy(r.v, p, sizeof r.v); return r; }
  static inline void store(float* p, F a) { memcpy(p, a.v, sizeof a.v); }
  static inline F add(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] += b.v[l]; return a; }
  static inline F sub(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] -= b.v[l]; return a; }
  static inline F mul(F a, F b) { for (int l = 0; l < 8; ++l) a.v[l] *= b.v[l]; return a; }
  static inline F fma(F a, F b, F c) { for (int l = 0; l < 8; ++l) c.v[l] += a.v[l] * b.v[l]; return c; }
  static inline float hsum(F a) {
    float s = 0.f;
    for (int l = 0; l < 8; ++l) s += a.v[l];
    return s;
  }
  static inline I load16(const uint8_t* p) { I r; memcpy(r.b, p, 16); return r; }
  static inline I shr_mask(I a, int s, int m) { for (int l = 0; l < 16; ++l) a.b[l] = (uint8_t)((a.b[l] >> s) & m); return a; }
  static inline I or_shl4(I a, I b) { for (int l = 0; l < 16; ++l) a.b[l] = (uint8_t)(a.b[l] | (b.b[l] << 4)); return a; }
  static inline I sub_i8(I a, int c) { for (int l = 0; l < 16; ++l) a.b[l] = (uint8_t)(a.b[l] - c); return a; }
  static inline void cvt_u8(I a, F* out) { for (int l = 0; l < 16; ++l) out[l / 8].v[l % 8] = (float)a.b[l]; }
  static inline void cvt_i8(I a, F* out) { for (int l = 0; l < 16; ++l) out[l / 8].v[l % 8] = (float)(int8_t)a.b[l]; }
  // fp16 bits -> float, exact for every input (subnormals: mant * 2^-24 is exact in float).
  static inline float h2f(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, ex = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    if (ex == 0) {
      float f = (float)mant * 5.9604644775390625e-08f;
      memcpy(&bits, &f, 4);
      bits |= sign;
    } else if (ex == 31) {
      bits = sign | 0x7f800000u | (mant << 13);
    } else {
      bits = sign | ((ex + 112u) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
  }
  static inline float h2f_lo(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return h2f(h);
  }
  static inline void h2f_pair(const uint8_t* p, float* out) { out[0] = h2f_lo(p), out[1] = h2f_lo(p + 2); }
#include "quant_nibbles.h"  // nib_map, nibbles, nibbles_sel over the primitives above
};

}  // namespace portable_isa
}  // namespace minisgl_quant

#define QUANT_ISA_NS portable
namespace minisgl_quant { namespace portable { using V = portable_isa::V; } }
#include "quant_impl.h"
