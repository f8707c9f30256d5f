// The prefill twin of the NEON integer matmul (arm/quant_neon.h) on SMMLA, the Armv8.6 int8
// matrix multiply (FEAT_I8MM: Neoverse V1/V2/N2, Cortex-A710 and later, Apple M2 and later).
// Compiled only for aarch64; tests/quant_test.cc runs it against the scalar kernels on odd sizes
// and against the dot-product kernels bit for bit (under qemu-aarch64 -cpu max in the aarch64
// preset).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/quant_kernels.h"

namespace gemstage::neon {

// The row kernel for Q8_0 / Q4_0 weights. Unlike the other row kernels it takes the activations
// quantized in natural order (quantize_acts with interleave = false) and with z = 0.
QuantRowsFn quant_rows_i8mm(DType t);

// Calls with fewer activation rows than this run on the dot-product kernels instead: the SMMLA
// kernel first copies each strip of weight rows into the operand layout SMMLA reads (and a block
// of activation rows likewise), which only pays once the strip serves enough rows
// (arm/quant_i8mm.cc counts the instructions).
inline constexpr int64_t kI8mmMinRows = 8;

}  // namespace gemstage::neon
