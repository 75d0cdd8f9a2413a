// Shared facts of the quantized CPU kernels: GGML type ids, ISA ids, the GEMM panel height.
// Only constants: the ISA translation units include it under their target attributes.
#pragma once
#include <cstdint>

namespace minisgl_quant {

// GGML type ids (ggml.h: enum ggml_type), as gguf.GGMLQuantizationType names them.
enum QType : int { QT_Q4_0 = 2, QT_Q4_1 = 3, QT_Q8_0 = 8, QT_Q4_K = 12, QT_Q6_K = 14 };

// ISA ids, also the bit positions of the masks that minisgl_quant_isas_* return.
enum Isa : int { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

// Nibble -> float maps, each in the reference's order of operations (so bit-identical to it).
constexpr int NIB_MUL_ADD = 0;  // (d * q) + m   (Q4_1)
constexpr int NIB_MUL_SUB = 1;  // (d * q) - m   (Q4_K, m = dmin * min)
constexpr int NIB_Q4_0 = 2;     // d * (q - 8)   (Q4_0)

// Weight rows dequantized at a time by the GEMM (the per-thread fp32 scratch is GEMM_NB x K): a
// multiple of every path's tile heights (6, 12 and 12, 24 rows).
constexpr int64_t GEMM_NB = 48;
// The GEMM sums k in chunks of GEMM_KC (its panel is laid out in such chunks: the scratch holds
// ceil(K / GEMM_KC) * GEMM_KC * GEMM_NB floats).
constexpr int64_t GEMM_KC = 64;
// Activation rows are packed in blocks of 2 vectors (16 or 32); the packed buffer is sized for 32.
constexpr int64_t GEMM_XB_MAX = 32;

}  // namespace minisgl_quant
