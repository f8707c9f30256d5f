// NEON twins of the integer matmul (kernels/quant_kernels.h), for the neon tier. Compiled only for
// aarch64; tests/quant_test.cc runs them against the scalar kernels on odd sizes (under
// qemu-aarch64 in the aarch64 preset).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/quant_kernels.h"

namespace gemstage::neon {

// The row kernel for Q8_0 / Q4_0 weights, from activations quantized with z = 0 (the kernels make
// the weights signed in registers); dotprod: SDOT (FEAT_DotProd), else SMULL.
QuantRowsFn quant_rows(DType t, bool dotprod);

}  // namespace gemstage::neon
