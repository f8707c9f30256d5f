// NEON twins of the integer matmul (kernels/quant_kernels.h), for the neon and dotprod tiers (and
// the i8mm tier's calls too short for SMMLA). Compiled only for aarch64; tests/quant_test.cc runs
// them against the scalar kernels on odd sizes (under qemu-aarch64 in the aarch64 preset).
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/quant_kernels.h"

namespace gemstage::neon {

// The row kernel for Q8_0 / Q4_0 weights, from activations quantized with z = 0 (the kernels make
// the weights signed in registers); dotprod: SDOT (FEAT_DotProd, the dotprod tier), else SMULL.
QuantRowsFn quant_rows(DType t, bool dotprod);

}  // namespace gemstage::neon
