// y[S, out] = x[S, in] · Wᵀ with W stored [out, in] in any weight dtype (F32, BF16, F16; the
// quantized block formats plug in here too). Weights are consumed in their stored form: a BF16
// matrix is widened a register at a time, never materialized as f32.
#pragma once

#include <cstdint>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace gemstage {

void matmul(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y);

// Plain scalar reference (double accumulation); every optimized path is tested against it.
void matmul_reference(const float* x, int64_t S, const WeightView& w, float* y);

// Which implementation matmul() dispatches to on this CPU ("avx512", "avx2", "scalar").
const char* matmul_isa();
// Forces the portable path (tests compare both on the same machine).
void matmul_force_scalar(bool on);

}  // namespace gemstage
