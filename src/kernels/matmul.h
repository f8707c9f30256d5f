// y[S, out] = x[S, in] · Wᵀ with W stored [out, in] in any weight dtype (F32, BF16, F16, and the
// block-quantized Q8_0 / Q4_0 of kernels/quant.h, whose activations are quantized per call).
// Weights are consumed in their stored form: a BF16 matrix is widened a register at a time, never
// materialized as f32.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace gemstage {

void matmul(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y);

// One matrix of a matmul_many call and where its outputs go.
struct MatmulTarget {
  const WeightView& w;
  float* y;
};
// matmul of several matrices on the same input (Q, K, V; gate, up). Quantized matrices of one
// format run as one job (kernels/quant.h, quant_matmul_many), which saves a pool hand-off and
// an activation quantization per extra matrix in every decoded layer; others run one by one.
void matmul_many(ThreadPool& pool, const float* x, int64_t S,
                 std::initializer_list<MatmulTarget> targets);

// Plain scalar reference (double accumulation); every optimized path is tested against it.
void matmul_reference(const float* x, int64_t S, const WeightView& w, float* y);

// Which implementation matmul() dispatches to under `tier` (core/cpu_features.h: "avx512",
// "avx2", "neon", "scalar") for the float weight dtypes; quant_isa() names the Q8_0/Q4_0 one.
const char* matmul_isa(CpuTier tier);

}  // namespace gemstage
