// Block-quantized weight formats Q8_0 and Q4_0 (blocks of 32 input-dim weights, one scale per
// block) and the matmul kernels that consume them in place.
//
// A quantized matrix W [out, in] is stored row after row; every row is independent and holds
// nb = in / 32 whole blocks (in % 32 != 0 is an error). Block b of a row covers the input
// columns [32 b, 32 b + 32). Each row is
//
//     [ nb scales: IEEE f16, little-endian, block order ]  2 nb bytes
//     [ quants of the row, in chunks of 16 blocks         ]  32 nb (Q8_0) / 16 nb (Q4_0) bytes
//
// so quant_row_bytes = 34 nb (Q8_0, 8.5 bits/weight) and 18 nb (Q4_0, 4.5 bits/weight), and a
// view's nbytes = rows * quant_row_bytes. Every stored value is an unsigned code u with a fixed
// zero point z; the weight is  w^ = (u - z) * d  with d the block's scale.
//
// Q8_0: d = max|w| / 127 (rounded to f16), q = round(w / d) in [-127, 127], stored as the byte
//   u = q + 128 (offset binary, z = 128). The unsigned code is the unsigned operand VPDPBUSD
//   wants; the  -128 * sum(x)  correction depends only on the activation block, so the kernels
//   pay it once per activation block, not once per weight block.
// Q4_0: as ggml's q4_0 (and the QAT "int4 blocks of 32" checkpoints): m = the block's signed
//   value of largest magnitude, d = m / -8 (so d may be negative), u = clamp(round(w / d) + 8,
//   0, 15), z = 8. The extreme weight maps to u = 0 (w^ = -8 d = m up to the f16 rounding of d);
//   every weight with w / d in [-8.5, 7.5] is within |d| / 2; an opposite-sign weight with
//   w / d > 7.5 clamps to u = 15 (w^ = 7 d), an error of (w / d - 7) |d| <= |d| (1 + 2^-8) for
//   f16-normal d, <= 1.5 |d| for the coarse subnormal scales of blocks with max|w| < 5e-4.
//
// Scales are f16, not f32: the decode GEMV is memory-bound and f16 saves 6% (Q8_0) / 11% (Q4_0)
// of the bytes, while one VCVTPH2PS widens 16 scales (one chunk) at once. The f16 rounding of
// d is applied before the codes are computed (q = round(w / stored d)), and d is nudged up one
// f16 ulp while max|w| / |d| would exceed 127.5 (Q8_0) / 8.5 (Q4_0), so the bounds above hold
// for the stored scale even when it is an f16 subnormal.
//
// Chunks (the repacked, kernel-friendly part). The quants of a row are cut into chunks of 16
// blocks (512 weights); the last chunk has m = nb mod 16 blocks when that is not 0, every
// other chunk has m = 16. Chunk c starts at byte 512 c (Q8_0) / 256 c (Q4_0) of the quant
// section. Inside a chunk the blocks are interleaved four weights at a time, so that one
// 64-byte vector holds four consecutive weights of each of the 16 blocks and the int32 lane i
// of a VPDPBUSD accumulates block i alone (no per-block shuffles or horizontal sums):
//   Q8_0: 8 groups of 4m bytes; group j (0..7) holds, for block i = 0..m-1, the bytes of
//         elements 4j .. 4j+3 of that block:
//             byte  j*4m + 4i + t  =  u(block 16c + i, element 4j + t),   t = 0..3.
//   Q4_0: 4 groups of 4m bytes; group g (0..3), block i, t = 0..3:
//             byte  g*4m + 4i + t  =  u(element 8g + t)  |  u(element 8g + 4 + t) << 4
//         so the low nibbles of a group are Q8_0 group 2g and the high nibbles group 2g+1: one
//         AND and one shift+AND unpack 128 weights into two VPDPBUSD operands.
//
// Activations are quantized per call (see matmul): per block of 32, dx = max|x| / 127 kept in
// f32, xq = round(x / dx) in [-127, 127]; a block dot is then the exact integer
// sum((u - z) * xq) times d * dx.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

namespace gemstage {

inline constexpr int64_t kQuantBlock = 32;        // weights per block
inline constexpr int64_t kQuantChunkBlocks = 16;  // blocks per interleaved chunk

bool dtype_is_quantized(DType t);
// Bytes of one block (scale + codes): 34 for Q8_0, 18 for Q4_0.
size_t quant_block_bytes(DType t);
// Bytes of one stored row of `in` weights; fails unless t is Q8_0/Q4_0 and in % 32 == 0.
size_t quant_row_bytes(DType t, int64_t in);

// One row of `in` floats -> quant_row_bytes(t, in) bytes at dst. Fails on non-finite input or
// on a block whose scale does not fit f16 (|w| > 8.3e6 for Q8_0).
void quantize_row(DType t, const float* src, int64_t in, uint8_t* dst);
// The inverse: w^ = (u - z) * d for every element, in natural order.
void dequantize_row(DType t, const uint8_t* src, int64_t in, float* dst);
// Element k of one stored row (reference readers; not for hot loops).
float dequantize_at(DType t, const uint8_t* row, int64_t in, int64_t k);
// The stored scale of block b of a row (f32 value of the f16).
float quant_block_scale(DType t, const uint8_t* row, int64_t in, int64_t b);

// A whole [rows, in] f32 matrix -> rows * quant_row_bytes bytes (rows quantized in parallel
// when a pool is given).
std::vector<uint8_t> quantize_matrix(DType t, const float* src, int64_t rows, int64_t in,
                                     ThreadPool* pool = nullptr);

// ---- used by matmul() -------------------------------------------------------------------------

// On the amx tier, calls of at least this many activation rows run on AMX bf16 tiles
// (kernels/x86/amx.h); fewer rows run on the VNNI kernels, which win there because the tiles
// dequantize each weight once per call, which only pays off when they reuse it across enough
// rows (measured crossover on the 2-core Xeon at 6144 x 1536: 24 rows VNNI 493 vs AMX 430 GFLOP/s,
// 32 rows 483 vs 574).
inline constexpr int64_t kAmxMinRows = 32;

// The kernels follow the tier of the caller's pool (ThreadPool::tier(), core/cpu_features.h): amx
// runs prefill-sized calls (S >= kAmxMinRows) on AMX tiles and the rest as avx512; avx512 uses
// AVX-512 VNNI when the CPU has it (else the AVX2 kernels); avx2 the AVX2 kernels; i8mm runs
// calls of at least kI8mmMinRows rows (arm/quant_i8mm.h) on SMMLA and the rest as dotprod;
// dotprod the NEON kernels on SDOT; neon the NEON kernels on SMULL; scalar the portable integer
// kernels. The kernel quant_matmul runs for S activation rows: "amx-bf16", "avx512vnni", "avx2",
// "neon-i8mm", "neon-dotprod", "neon", "scalar".
const char* quant_isa(CpuTier tier, int64_t S);
// y[S, out] = x[S, in] * W^T for a Q8_0/Q4_0 view (validated by the caller's shape checks;
// this checks in % 32 and nbytes).
void quant_matmul(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y);

// One matrix of a quant_matmul_many call, where its outputs go, and optionally its own input.
struct QuantTarget {
  const WeightView* w;
  float* y;
  const float* x = nullptr;  // S rows of this matrix's own input; null: the call's shared x
};
// y_i = x_i * W_i^T for matrices of one dtype and input width: x_i is the call's shared x (Q, K
// and V; gate and up read the same input, which is quantized once) or the target's own input (a
// decode step's chosen experts' down projections). Below the AMX threshold all rows of all the
// matrices are one job for the pool instead of one job each.
void quant_matmul_many(ThreadPool& pool, const float* x, int64_t S,
                       std::span<const QuantTarget> targets);

}  // namespace gemstage
