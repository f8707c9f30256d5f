// AVX-512 VNNI twins of the integer matmul (kernels/quant_kernels.h), for the avx512 and amx
// tiers on CPUs with AVX-512 VNNI. Compiled only for x86; tests/quant_test.cc runs them against
// the scalar kernels on odd sizes.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "kernels/quant_kernels.h"

namespace gemstage::avx512 {

// One row of activations, quantized as the scalar quantizer does, into Q8 order.
void quantize_act_row(const float* x, int64_t K, int z, uint8_t* q, float* d, int32_t* nzx);
// The row kernel for Q8_0 / Q4_0 weights.
QuantRowsFn quant_rows(DType t);

}  // namespace gemstage::avx512
