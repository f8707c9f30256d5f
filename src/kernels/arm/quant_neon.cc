// y = x * W^T on NEON for Q8_0 / Q4_0 weights in their stored, chunk-interleaved form
// (kernels/quant.h): int8 dots on signed weights, 4 int32 lanes = a quarter chunk.
//
// The activations carry no zero-point term here (z = 0): the weights are made signed in
// registers, Q8_0 as u ^ 0x80 = u - 128, Q4_0 as each nibble - 8, and the integer block dot is
// sum(w * xq) directly. A 16-byte vector of a group holds four bytes of each of 4 blocks, so with
// SDOT (the dot-product extension, FEAT_DotProd: most cores since Cortex-A55/A75, every Apple
// core) int32 lane i accumulates block i, as VPDPBUSD's lanes do. Cores without it multiply with
// SMULL (int16 products) and fold adjacent pairs with SADALP, so one block spans two int32 lanes
// of two accumulators, added pairwise (ADDP) at the end of the quarter.
#include "kernels/arm/quant_neon.h"

#include <arm_neon.h>

#include <algorithm>
#include <cstring>

#include "kernels/quant.h"

namespace gemstage::neon {

namespace {

constexpr int64_t kCB = kQuantChunkBlocks;

#define GEMSTAGE_DOTPROD __attribute__((target("arch=armv8.2-a+dotprod")))

// `bytes` (<= 16) bytes from p, zero-filled: a quarter chunk of one group, or its short tail.
inline int8x16_t load_quarter(const uint8_t* p, int bytes) {
  if (bytes == 16) return vreinterpretq_s8_u8(vld1q_u8(p));
  uint8_t buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(bytes));
  return vreinterpretq_s8_u8(vld1q_u8(buf));
}

// Signed weights of a group's raw bytes: Q8_0 the group itself, Q4_0 its low (plane 0) or high
// (plane 1) nibbles.
template <DType T>
inline int8x16_t signed_weights(int8x16_t packed, [[maybe_unused]] int plane) {
  if constexpr (T == DType::Q8_0) {
    return veorq_s8(packed, vdupq_n_s8(static_cast<int8_t>(0x80)));
  } else {
    const uint8x16_t u = vreinterpretq_u8_s8(packed);
    const uint8x16_t nib = plane ? vshrq_n_u8(u, 4) : vandq_u8(u, vdupq_n_u8(0x0f));
    return vsubq_s8(vreinterpretq_s8_u8(nib), vdupq_n_s8(8));
  }
}

// Integer dots of one quarter chunk (L <= 4 blocks, lb = 4 L bytes per group) of NW weight rows
// with NX activation rows: D[a][w] lane i = block i's sum(w * xq). gs is the chunk's group stride.
template <DType T, int NX, int NW, bool kDot>
GEMSTAGE_DOTPROD inline void quarter_dots(const uint8_t* const* wq, const uint8_t* const* xq,
                                          int64_t gs, int lb, int32x4_t (&D)[NX][NW]) {
  [[maybe_unused]] int32x4_t lo[NX][NW], hi[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) {
      D[a][w] = vdupq_n_s32(0);
      if constexpr (!kDot) lo[a][w] = hi[a][w] = vdupq_n_s32(0);
    }
  // Q8_0: 8 weight groups of one plane each; Q4_0: 4 packed groups of two nibble planes.
  constexpr int kGroups = T == DType::Q8_0 ? 8 : 4, kPlanes = 8 / kGroups;
  for (int g = 0; g < kGroups; ++g) {
    int8x16_t packed[NW];
    for (int w = 0; w < NW; ++w) packed[w] = load_quarter(wq[w] + g * gs, lb);
    for (int pl = 0; pl < kPlanes; ++pl) {
      const int j = g * kPlanes + pl;  // the activation group (element plane) it meets
      int8x16_t wv[NW];
      for (int w = 0; w < NW; ++w) wv[w] = signed_weights<T>(packed[w], pl);
      for (int a = 0; a < NX; ++a) {
        const int8x16_t xv = load_quarter(xq[a] + j * gs, lb);
        for (int w = 0; w < NW; ++w) {
          if constexpr (kDot) {
            D[a][w] = vdotq_s32(D[a][w], wv[w], xv);
          } else {
            lo[a][w] = vpadalq_s16(lo[a][w], vmull_s8(vget_low_s8(wv[w]), vget_low_s8(xv)));
            hi[a][w] = vpadalq_s16(hi[a][w], vmull_high_s8(wv[w], xv));
          }
        }
      }
    }
  }
  if constexpr (!kDot)
    for (int a = 0; a < NX; ++a)
      for (int w = 0; w < NW; ++w) D[a][w] = vpaddq_s32(lo[a][w], hi[a][w]);
}

// out[a * NW + w] = dot(activation row srow[a], weight row wrow[w]) over the whole width.
template <DType T, int NX, int NW, bool kDot>
GEMSTAGE_DOTPROD void tile_neon(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                float* out) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  const int64_t K = A.K, nb = A.nb;
  float32x4_t facc[NX][NW];
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) facc[a][w] = vdupq_n_f32(0);
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB), gs = 4 * m;
    for (int64_t qt = 0; qt < 4; ++qt) {
      const int64_t L = std::min<int64_t>(4, m - 4 * qt);
      if (L <= 0) break;
      const int64_t b0 = c * kCB + 4 * qt;
      const uint8_t* wq[NW];
      const uint8_t* xq[NX];
      for (int w = 0; w < NW; ++w) wq[w] = wrow[w] + 2 * nb + c * chunk_bytes + 16 * qt;
      for (int a = 0; a < NX; ++a) xq[a] = A.q.data() + srow[a] * K + c * 512 + 16 * qt;
      int32x4_t D[NX][NW];
      quarter_dots<T, NX, NW, kDot>(wq, xq, gs, static_cast<int>(4 * L), D);
      float32x4_t dw[NW];
      for (int w = 0; w < NW; ++w) {
        uint16_t h[4] = {};
        std::memcpy(h, wrow[w] + 2 * b0, static_cast<size_t>(2 * L));
        dw[w] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(h)));
      }
      for (int a = 0; a < NX; ++a) {
        float dxs[4] = {};
        std::memcpy(dxs, A.d.data() + srow[a] * nb + b0, static_cast<size_t>(4 * L));
        const float32x4_t dx = vld1q_f32(dxs);
        for (int w = 0; w < NW; ++w)
          facc[a][w] = vfmaq_f32(facc[a][w], vcvtq_f32_s32(D[a][w]), vmulq_f32(dw[w], dx));
      }
    }
  }
  for (int a = 0; a < NX; ++a)
    for (int w = 0; w < NW; ++w) out[a * NW + w] = vaddvq_f32(facc[a][w]);
}

// Prefill keeps a 4 x 4 tile with SDOT (16 int32 accumulators) and 4 x 2 without (each pair of
// accumulators is one SDOT's worth).
template <DType T, bool kDot>
struct NeonTiles {
  static constexpr int NW = kDot ? 4 : 2;
  static constexpr bool kWeightsPastRows = false;  // not measured on ARM hardware
  template <int NX>
  GEMSTAGE_DOTPROD static void run(const ActQ& A, const int64_t* srow, const uint8_t* const* wrow,
                                   float* out) {
    tile_neon<T, NX, NW, kDot>(A, srow, wrow, out);
  }
};

// Decode walks the rows one at a time in address order.
template <DType T, bool kDot>
GEMSTAGE_DOTPROD void rows_neon(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes,
                                int64_t N, float* y, int64_t r0, int64_t r1) {
  if (S == 1) {
    const int64_t s0 = 0;
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* wrow = wdata + static_cast<size_t>(r) * row_bytes;
      tile_neon<T, 1, 1, kDot>(A, &s0, &wrow, y + r);
    }
    return;
  }
  prefill_tiles<NeonTiles<T, kDot>>(A, S, wdata, row_bytes, N, y, r0, r1);
}

}  // namespace

QuantRowsFn quant_rows(DType t, bool dotprod) {
  if (dotprod)
    return t == DType::Q8_0 ? rows_neon<DType::Q8_0, true> : rows_neon<DType::Q4_0, true>;
  return t == DType::Q8_0 ? rows_neon<DType::Q8_0, false> : rows_neon<DType::Q4_0, false>;
}

}  // namespace gemstage::neon
