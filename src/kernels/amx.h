// Prefill GEMMs on Intel AMX tiles (TDPBF16PS) for the block-quantized Q8_0 / Q4_0 weights.
//
// Why bf16 and not int8 tiles: a Q4_0/Q8_0 block scale covers 32 weights, so int8 tiles would
// have to stop after every 32 input columns to scale the int32 partial sums (16 x 16 outputs
// times two scales), which costs more vector work than the tile multiply saves. Instead each
// weight row is dequantized to bf16 with its scale folded in, w = (u - z) * d, once per pass of
// up to 256 activation rows, and the tiles accumulate in f32 across the whole input width with
// no per-block work.
//
// The inner product may visit the input columns in any order as long as both operands use the
// same one, so the weights are read in their stored chunk-interleaved order (kernels/quant.h:
// "Q8 order", four columns of each of the chunk's blocks per 64-byte group) and the activation
// rows are permuted into that order when they are packed, which is O(S * in) against the
// O(S * in * out) multiply.
//
// Precision: both operands are rounded to bf16 (relative error <= 2^-9 each) and the products
// summed in f32, so |y - y_ref| <= (2^-8 + 2^-17) * sum |x| |w^| plus f32 summation error,
// where w^ is the dequantized weight. The VNNI path's int8 activations (error <= max|x_b|/254
// per element) are of the same order; both are tested against matmul_reference.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"
#include "core/thread_pool.h"

namespace gemstage {

// True when the CPU has AMX-TILE, AMX-BF16 and AVX512-BF16 and the kernel granted this process
// the tile state (cpu_features().amx_bf16, kernels/cpu_features.cc).
bool amx_bf16_available();

// Below this many activation rows the VNNI kernels win (each weight is dequantized once per
// call, which only pays off when the tiles reuse it across enough rows; measured crossover on
// the 2-core Xeon at 6144 x 1536: 24 rows VNNI 493 vs AMX 430 GFLOP/s, 32 rows 483 vs 574).
inline constexpr int64_t kAmxMinRows = 32;

// y[S, N] = x[S, K] * W^T for a Q8_0 / Q4_0 matrix of N rows of row_bytes each (K % 32 == 0,
// validated by quant_matmul). Requires amx_bf16_available().
void amx_quant_matmul(ThreadPool& pool, const float* x, int64_t S, DType t, const uint8_t* w,
                      size_t row_bytes, int64_t K, int64_t N, float* y);

}  // namespace gemstage
