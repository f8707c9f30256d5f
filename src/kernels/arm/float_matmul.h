// NEON twins of the float-weight matmul rows (kernels/float_rows.h). Compiled only for aarch64;
// tests/kernels_test.cc runs them against the scalar rows on odd sizes (under qemu-aarch64).
#pragma once

#include "core/dtype.h"
#include "kernels/float_rows.h"

namespace gemstage::neon {
// The NEON rows for F32 / BF16 / F16 weights (null for other dtypes).
FloatRowsFn float_rows(DType t);
}  // namespace gemstage::neon
