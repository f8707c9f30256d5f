// x86 twins of the float-weight matmul rows (kernels/float_rows.h). Compiled only for x86;
// tests/kernels_test.cc runs them against the scalar rows on odd sizes.
#pragma once

#include "core/dtype.h"
#include "kernels/float_rows.h"

namespace gemstage {
namespace avx512 {
// The AVX-512 rows for F32 / BF16 / F16 weights (null for other dtypes).
FloatRowsFn float_rows(DType t);
}  // namespace avx512
namespace avx2 {
// The AVX2 + FMA + F16C rows for F32 / BF16 / F16 weights (null for other dtypes).
FloatRowsFn float_rows(DType t);
}  // namespace avx2
}  // namespace gemstage
