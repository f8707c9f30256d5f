// Prefill GEMMs on Intel AMX tiles (TDPBF16PS) for the block-quantized Q8_0 / Q4_0 weights;
// compiled only for x86.
//
// Why bf16 and not int8 tiles: a Q4_0/Q8_0 block scale covers 32 weights, so int8 tiles have to
// stop after every 32 input columns: store the int32 C tile and add it to f32 accumulators with
// its two scales. Measured on the 2-core Xeon (bench/RESULTS.md, 2026-12-06), with one C
// tile store and two tile loads per 32 columns: 0.35-0.85x these bf16 tiles at 128-512 rows
// (0.6-1.0x, and 1.1-1.2x on the 12B's 64-row shapes, with the f32 accumulators kept in
// registers, which gives up the VNNI kernels' exact summation order), and 0.2-0.6x the VNNI
// kernels at 2-16 rows. Tile loads and stores cost tens
// of cycles each there, and bf16 tiles need none per block. So each weight row is dequantized to
// bf16 with its scale folded in, w = (u - z) * d, once per pass of up to 256 activation rows,
// and the tiles accumulate in f32 across the whole input width with no per-block work.
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

namespace gemstage::amx {

// y[S, N] = x[S, K] * W^T for a Q8_0 / Q4_0 matrix of N rows of row_bytes each (K % 32 == 0,
// validated by quant_matmul). Requires cpu_features().amx_bf16 (the amx tier); calls of fewer
// than kAmxMinRows rows (kernels/quant.h) run on the VNNI kernels instead.
void quant_matmul(ThreadPool& pool, const float* x, int64_t S, DType t, const uint8_t* w,
                  size_t row_bytes, int64_t K, int64_t N, float* y);

}  // namespace gemstage::amx
