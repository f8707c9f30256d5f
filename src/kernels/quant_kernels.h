// The integer matmul kernels' shared pieces, internal to the kernels library: the activation rows
// quantized per call, the prefill loop order every SIMD tier walks, and the signature of the
// per-ISA row kernels (x86/quant_avx512.h, x86/quant_avx2.h, arm/quant_neon.h, arm/quant_i8mm.h)
// that quant_matmul (quant_kernels.cc) picks from the tier in force.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/thread_pool.h"

namespace gemstage {

// Activations quantized per block of 32: dx = max|x| / 127 (f32), codes xq = round(x / dx) in
// [-127, 127], and -z * sum(xq) for a weight format with zero point z (0 where the kernel makes
// the weights signed itself). Row s has K codes at q + s*K (interleaved like a Q8_0 row's quant
// section, kernels/quant.h, or natural order for the scalar path), nb scales at d + s*nb and nb
// corrections at nzx + s*nb.
struct ActQ {
  int64_t K = 0, nb = 0;
  std::vector<uint8_t> q;
  std::vector<float> d;
  std::vector<int32_t> nzx;
};

// x[S, K] -> *a (quant_kernels.cc). interleave: Q8 order, else natural; use_avx512: the AVX-512
// twin (the VNNI kernels' callers only; the codes are the same on every path).
void quantize_acts(ThreadPool& pool, const float* x, int64_t S, int64_t K, int z, bool interleave,
                   bool use_avx512, ActQ* a);

// Rows [r0, r1) of y[S, N] = x * W^T from the quantized activations, for a matrix of N rows of
// row_bytes each at wdata.
using QuantRowsFn = void (*)(const ActQ& a, int64_t S, const uint8_t* wdata, size_t row_bytes,
                             int64_t N, float* y, int64_t r0, int64_t r1);

// Decode streams every weight byte once from DRAM (the VNNI and AVX2 GEMVs). The hardware
// prefetchers alone leave the GEMV at ~60% of the measured read bandwidth (they stop at 4 KiB pages
// and lag the demand stream), so the decode tile asks for the bytes kDecodePrefetch ahead into L2,
// spread over its chunks. Measured on the 2-core Xeon: 1-4 KiB ahead all reach ~95% of the read
// bandwidth; 4 KiB is kept so each prefetch lands one page ahead of the demand loads.
inline constexpr size_t kDecodePrefetch = 4096;

// The prefill loop order, shared by every SIMD tier.
//
// Every activation row meets every weight row. Walking all S rows per strip of NW weight rows
// streamed the whole quantized activation matrix (S x K bytes: 786 KB for a 512-row prompt of
// width 1536, 3 MB at width 6144) through the caches once per strip. Instead the rows are walked
// in blocks of about kActBlockBytes of codes, which stay in L2 while the thread's weight rows
// stream past each block; the weights are re-read once per block, far below the tile's compute
// rate. Measured on the Zen 4 VM (bench/RESULTS.md): VNNI pp512 +15-20%.
inline constexpr int64_t kActBlockBytes = int64_t{256} << 10;

// On the VNNI kernels, calls of at most this many activation rows (a batched decode step) stream
// the weights as decode does (x86/quant_avx512.cc, stream_rows_vnni) and are scheduled like it.
// The AVX2 kernels keep their prefill tiles: streamed 1 x NX tiles measured no faster there (they
// are bound by the maddubs arithmetic at every S from 1 to 16: 55-85 GFLOP/s on 2 Xeon cores,
// bench/RESULTS.md 2026-12-06, before the tile's rewrite in x86/quant_avx2.cc).
inline constexpr int64_t kStreamMaxRows = 8;

// Whole 4-row tiles per block, at least one.
inline int64_t activation_block_rows(int64_t K) {
  return std::max<int64_t>(4, kActBlockBytes / K / 4 * 4);
}

// The second loop order, for tiers whose tiles opt in (Tiles::kWeightsPastRows): four activation
// rows stay in L1 while the weight rows stream past them from a block of about kWeightBlockBytes
// that stays in L2. A tile then reads its 4 x 256 activation bytes per half chunk from L1 and
// only the weights' 2 x 128 from L2, where the first order reads the activations from L2. Used
// while the four rows take at most kRowTileBytes of codes (K <= 4096: the attention and MLP
// input projections); wider rows spill L1 and keep the first order. Measured on the AVX2 tile
// (bench/RESULTS.md, 2026-12-07, AMD EPYC Zen 3): K 1536-2048 +5-8%, K 6144 even, K 12288 -5%.
inline constexpr int64_t kRowTileBytes = int64_t{16} << 10;
inline constexpr int64_t kWeightBlockBytes = int64_t{128} << 10;

// Tiles: a struct with NW (weight rows per tile), kWeightsPastRows (the loop order above), and
// run<NX>(A, srow, wrow, out) writing out[a * NW + w] = dot(activation row srow[a], weight row
// wrow[w]) for NX = 1..4.
template <class Tiles>
void prefill_tiles(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes, int64_t N,
                   float* y, int64_t r0, int64_t r1) {
  constexpr int NW = Tiles::NW;
  // Rows [s, s + 4) (fewer at the end) against weight rows [r, r + NW) (fewer at the end).
  const auto tile = [&](int64_t s, int64_t r) {
    const int nx = static_cast<int>(std::min<int64_t>(4, S - s));
    const int nw = static_cast<int>(std::min<int64_t>(NW, r1 - r));
    const uint8_t* wrow[NW];
    for (int w = 0; w < NW; ++w)
      wrow[w] = wdata + static_cast<size_t>(r + std::min(w, nw - 1)) * row_bytes;
    const int64_t srow[4] = {s, s + 1, s + 2, s + 3};
    float out[4 * NW];
    switch (nx) {
      case 4:
        Tiles::template run<4>(A, srow, wrow, out);
        break;
      case 3:
        Tiles::template run<3>(A, srow, wrow, out);
        break;
      case 2:
        Tiles::template run<2>(A, srow, wrow, out);
        break;
      default:
        Tiles::template run<1>(A, srow, wrow, out);
        break;
    }
    for (int a = 0; a < nx; ++a)
      for (int w = 0; w < nw; ++w) y[(s + a) * N + r + w] = out[a * NW + w];
  };
  if (Tiles::kWeightsPastRows && 4 * A.K <= kRowTileBytes) {
    const int64_t block = std::max<int64_t>(
        NW, static_cast<int64_t>(static_cast<size_t>(kWeightBlockBytes) / row_bytes) / NW * NW);
    for (int64_t g0 = r0; g0 < r1; g0 += block) {
      const int64_t g1 = std::min(r1, g0 + block);
      for (int64_t s = 0; s < S; s += 4)
        for (int64_t r = g0; r < g1; r += NW) tile(s, r);
    }
    return;
  }
  const int64_t block = activation_block_rows(A.K);
  for (int64_t s0 = 0; s0 < S; s0 += block) {
    const int64_t s1 = std::min(S, s0 + block);
    for (int64_t r = r0; r < r1; r += NW)
      for (int64_t s = s0; s < s1; s += 4) tile(s, r);
  }
}

}  // namespace gemstage
