// The float-weight matmul's shared pieces, internal to the kernels library: the signature of the
// per-ISA row kernels (x86/float_matmul.h, arm/float_matmul.h) that matmul (matmul.cc) picks from
// the tier in force, and the scalar widening of one weight element their tails use.
#pragma once

#include <cstdint>

#include "core/dtype.h"
#include "core/tensor.h"

namespace gemstage {

// Rows [r0, r1) of y[S, N] = x * W^T for an F32 / BF16 / F16 matrix.
using FloatRowsFn = void (*)(const float* x, int64_t S, const WeightView& w, float* y, int64_t r0,
                             int64_t r1);

// Scalar widening of one weight element; the portable path's inner loop.
inline float widen_weight(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(base)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::F16:
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      return 0.0f;
  }
}

}  // namespace gemstage
