// y = x * W^T on SMMLA (FEAT_I8MM) for Q8_0 / Q4_0 weights: the prefill kernel of the i8mm tier.
//
// SMMLA Vd.4S, Vn.16B, Vm.16B reads each operand as two rows of 8 int8 and adds the 2 x 2 matrix
// of their row dots to Vd: lane 2i + j += dot(Vn row i, Vm row j), 32 multiply-adds, twice an
// SDOT's 16. Here Vn holds 8 codes of two activation rows and Vm the same 8 columns of two weight
// rows, all 8 inside one block of 32, so each lane of a block's accumulator is one exact integer
// block dot, as in the other kernels (kernels/quant_kernels.cc).
//
// The operand layout ("pairs"): rows r and r + 1 of width K side by side in 2K bytes; block b,
// piece p (0..3) is 16 bytes at 64 b + 16 p: columns 32 b + 8 p .. + 7 of row r, then of row r + 1,
// as signed int8 (Q8_0 u - 128, Q4_0 u - 8). The stored weight layout (kernels/quant.h) keeps 4
// columns of 4 blocks per 16 bytes instead, so SMMLA cannot read it directly: per 8-column piece of
// a block the two 4-column groups of a row must be zipped, then the two rows (ZIP1/ZIP2 .4S, then
// .2D: 3 vector instructions per operand with the sign fix or the nibble split).
//
// Where that happens, counted in vector (SIMD pipe) instructions per 32 multiply-adds, for the
// 4 x 4 tile below (per block: 16 SMMLA, 4 accumulator resets, 4 conversions, 4 scale products, 4
// FMAs): the tile itself costs 2.0. Zipping the weights inside the tile adds 3 per operand, each
// operand serving 2 SMMLAs: 3.5 in all, no better than the dot-product kernel's 3.2 (Q8_0: per 16
// columns of one weight row, 4 SDOTs for 4 activation rows plus the sign fix and scale work;
// Q4_0's nibble split makes it 3.6). Copying each strip of 4 weight rows into the pairs layout
// once per block of activation rows (kernels/quant_kernels.h: 40-170 rows at K = 1536-6144) costs
// the same 3 per operand but spread over every row pair of the block: 2.0 + 6 / rows, 2.04-2.15
// at those widths, against 2.0 for weights repacked once at load time. Repacking at load would
// also keep a second, anonymous copy of every quantized matrix instead of reading the
// memory-mapped file, so the strips are repacked per call into a buffer that stays in L1/L2, and
// the activation rows of a block are laid out in pairs the same way. Below kI8mmMinRows rows the
// copy no longer pays and the dot-product kernel runs (2.0 + 6 / S < 3.2 from S = 5 on; 8 leaves
// room for the copies' loads and stores).
//
// Bit for bit the dot-product kernel's result: that kernel's f32 accumulator lane l sums, in
// block order, fma(acc, block dot, d_w * d_x) over the blocks b = l (mod 4) and adds the four
// lanes as (l0 + l1) + (l2 + l3) (FADDP). This one keeps four accumulators per output, one per
// block residue, with the same products, and adds them in the same order.
#include "kernels/arm/quant_i8mm.h"

#include <arm_neon.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/quant.h"

namespace gemstage::neon {

namespace {

constexpr int64_t kCB = kQuantChunkBlocks;

#define GEMSTAGE_I8MM __attribute__((target("arch=armv8.2-a+i8mm")))

// `bytes` (<= 16) bytes from p, zero-filled: 4 columns of (up to) 4 blocks of one group.
inline int8x16_t load_group(const uint8_t* p, int bytes) {
  if (bytes == 16) return vreinterpretq_s8_u8(vld1q_u8(p));
  uint8_t buf[16] = {};
  std::memcpy(buf, p, static_cast<size_t>(bytes));
  return vreinterpretq_s8_u8(vld1q_u8(buf));
}

// Piece p (columns 8p .. 8p + 7) of up to 4 consecutive blocks of one stored row, signed, in
// column order: lo holds blocks 0 and 1 (8 bytes each), hi blocks 2 and 3. q is the row's
// quant section at the chunk, qt the quarter (4 blocks) of the chunk, m its block count.
template <DType T>
inline void stored_piece(const uint8_t* q, int64_t m, int64_t qt, int lb, int p, int8x16_t* lo,
                         int8x16_t* hi) {
  int8x16_t a, b;  // columns 8p .. 8p + 3 and 8p + 4 .. 8p + 7 of each block
  if constexpr (T == DType::Q8_0) {
    const int8x16_t sign = vdupq_n_s8(static_cast<int8_t>(0x80));
    a = veorq_s8(load_group(q + (2 * p) * 4 * m + 16 * qt, lb), sign);
    b = veorq_s8(load_group(q + (2 * p + 1) * 4 * m + 16 * qt, lb), sign);
  } else {
    const uint8x16_t u = vreinterpretq_u8_s8(load_group(q + p * 4 * m + 16 * qt, lb));
    a = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(u, vdupq_n_u8(0x0f))), vdupq_n_s8(8));
    b = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(u, 4)), vdupq_n_s8(8));
  }
  *lo = vreinterpretq_s8_s32(vzip1q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
  *hi = vreinterpretq_s8_s32(vzip2q_s32(vreinterpretq_s32_s8(a), vreinterpretq_s32_s8(b)));
}

inline int8x16_t zip_rows_lo(int8x16_t r0, int8x16_t r1) {
  return vreinterpretq_s8_s64(vzip1q_s64(vreinterpretq_s64_s8(r0), vreinterpretq_s64_s8(r1)));
}
inline int8x16_t zip_rows_hi(int8x16_t r0, int8x16_t r1) {
  return vreinterpretq_s8_s64(vzip2q_s64(vreinterpretq_s64_s8(r0), vreinterpretq_s64_s8(r1)));
}

float f16_at(const uint8_t* p) {
  uint16_t h = 0;
  std::memcpy(&h, p, 2);
  return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0);
}

// Stored weight rows w0, w1 (K columns, nb blocks) -> the pairs layout at out (2K bytes) and
// their scales, [d0, d1, d0, d1] per block, at scales (4 nb floats).
template <DType T>
void pack_weight_pair(const uint8_t* w0, const uint8_t* w1, int64_t nb, int8_t* out,
                      float* scales) {
  constexpr int64_t chunk_bytes = T == DType::Q8_0 ? 512 : 256;
  for (int64_t b = 0; b < nb; ++b) {
    const float d0 = f16_at(w0 + 2 * b), d1 = f16_at(w1 + 2 * b);
    const float s[4] = {d0, d1, d0, d1};
    std::memcpy(scales + 4 * b, s, sizeof(s));
  }
  const uint8_t* q0 = w0 + 2 * nb;
  const uint8_t* q1 = w1 + 2 * nb;
  for (int64_t c = 0; c * kCB < nb; ++c) {
    const int64_t m = std::min(kCB, nb - c * kCB);
    for (int64_t qt = 0; 4 * qt < m; ++qt) {
      const int64_t L = std::min<int64_t>(4, m - 4 * qt);
      const int64_t b0 = c * kCB + 4 * qt;
      for (int p = 0; p < 4; ++p) {
        int8x16_t lo0, hi0, lo1, hi1;
        stored_piece<T>(q0 + c * chunk_bytes, m, qt, static_cast<int>(4 * L), p, &lo0, &hi0);
        stored_piece<T>(q1 + c * chunk_bytes, m, qt, static_cast<int>(4 * L), p, &lo1, &hi1);
        const int8x16_t ops[4] = {zip_rows_lo(lo0, lo1), zip_rows_hi(lo0, lo1),
                                  zip_rows_lo(hi0, hi1), zip_rows_hi(hi0, hi1)};
        for (int64_t l = 0; l < L; ++l) vst1q_s8(out + (b0 + l) * 64 + 16 * p, ops[l]);
      }
    }
  }
}

// Activation rows s and s + 1 (natural order; a null x1 is a row of zeros) -> the pairs layout
// and their scales, [dx0, dx0, dx1, dx1] per block.
void pack_act_pair(const int8_t* x0, const int8_t* x1, const float* d0, const float* d1, int64_t nb,
                   int8_t* out, float* scales) {
  const int8x16_t zero = vdupq_n_s8(0);
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {  // pieces 2h and 2h + 1
      const int8x16_t a = vld1q_s8(x0 + 32 * b + 16 * h);
      const int8x16_t c = x1 ? vld1q_s8(x1 + 32 * b + 16 * h) : zero;
      vst1q_s8(out + 64 * b + 32 * h, zip_rows_lo(a, c));
      vst1q_s8(out + 64 * b + 32 * h + 16, zip_rows_hi(a, c));
    }
    const float s[4] = {d0[b], d0[b], d1 ? d1[b] : 0.0f, d1 ? d1[b] : 0.0f};
    std::memcpy(scales + 4 * b, s, sizeof(s));
  }
}

// One block's 2 x 2 pair products into the accumulators of its residue l = b mod 4.
template <int l>
GEMSTAGE_I8MM inline void block_step(const int8_t* a0, const int8_t* a1, const float* as0,
                                     const float* as1, const int8_t* w0, const int8_t* w1,
                                     const float* ws0, const float* ws1, int64_t b,
                                     float32x4_t (&f)[2][2][4]) {
  int32x4_t i00 = vdupq_n_s32(0), i01 = vdupq_n_s32(0), i10 = vdupq_n_s32(0), i11 = vdupq_n_s32(0);
  for (int p = 0; p < 4; ++p) {
    const int64_t o = 64 * b + 16 * p;
    const int8x16_t xa = vld1q_s8(a0 + o), xb = vld1q_s8(a1 + o);
    const int8x16_t wa = vld1q_s8(w0 + o), wb = vld1q_s8(w1 + o);
    i00 = vmmlaq_s32(i00, xa, wa);
    i01 = vmmlaq_s32(i01, xa, wb);
    i10 = vmmlaq_s32(i10, xb, wa);
    i11 = vmmlaq_s32(i11, xb, wb);
  }
  const float32x4_t sa0 = vld1q_f32(as0 + 4 * b), sa1 = vld1q_f32(as1 + 4 * b);
  const float32x4_t sw0 = vld1q_f32(ws0 + 4 * b), sw1 = vld1q_f32(ws1 + 4 * b);
  // d_w * d_x, in the dot-product kernel's order (a product commutes, so either is exact).
  f[0][0][l] = vfmaq_f32(f[0][0][l], vcvtq_f32_s32(i00), vmulq_f32(sw0, sa0));
  f[0][1][l] = vfmaq_f32(f[0][1][l], vcvtq_f32_s32(i01), vmulq_f32(sw1, sa0));
  f[1][0][l] = vfmaq_f32(f[1][0][l], vcvtq_f32_s32(i10), vmulq_f32(sw0, sa1));
  f[1][1][l] = vfmaq_f32(f[1][1][l], vcvtq_f32_s32(i11), vmulq_f32(sw1, sa1));
}

// out[a][w] = dot(activation row a, weight row w) for the two activation pairs (a0, a1: rows
// 0-1 and 2-3) and the two weight pairs (w0, w1: rows 0-1 and 2-3).
GEMSTAGE_I8MM void tile(const int8_t* a0, const int8_t* a1, const float* as0, const float* as1,
                        const int8_t* w0, const int8_t* w1, const float* ws0, const float* ws1,
                        int64_t nb, float (&out)[4][4]) {
  float32x4_t f[2][2][4];
  for (auto& pa : f)
    for (auto& pw : pa)
      for (auto& r : pw) r = vdupq_n_f32(0);
  for (int64_t b = 0; b < nb; b += 4) {
    block_step<0>(a0, a1, as0, as1, w0, w1, ws0, ws1, b, f);
    if (b + 1 < nb) block_step<1>(a0, a1, as0, as1, w0, w1, ws0, ws1, b + 1, f);
    if (b + 2 < nb) block_step<2>(a0, a1, as0, as1, w0, w1, ws0, ws1, b + 2, f);
    if (b + 3 < nb) block_step<3>(a0, a1, as0, as1, w0, w1, ws0, ws1, b + 3, f);
  }
  for (int pa = 0; pa < 2; ++pa)
    for (int pw = 0; pw < 2; ++pw) {
      const float32x4_t sum =
          vaddq_f32(vaddq_f32(f[pa][pw][0], f[pa][pw][1]), vaddq_f32(f[pa][pw][2], f[pa][pw][3]));
      float lanes[4];
      vst1q_f32(lanes, sum);
      for (int i = 0; i < 2; ++i)
        for (int j = 0; j < 2; ++j) out[2 * pa + i][2 * pw + j] = lanes[2 * i + j];
    }
}

// Rows [r0, r1) of y: activation rows in blocks (kernels/quant_kernels.h), and inside a block
// each strip of 4 weight rows repacked once and met by every 4-row tile of the block.
template <DType T>
void rows_i8mm(const ActQ& A, int64_t S, const uint8_t* wdata, size_t row_bytes, int64_t N,
               float* y, int64_t r0, int64_t r1) {
  const int64_t K = A.K, nb = A.nb;
  const int64_t block = std::min(activation_block_rows(K), (S + 3) / 4 * 4);
  const auto* q = reinterpret_cast<const int8_t*>(A.q.data());
  // Activation pairs of one block (whole 4-row tiles, missing rows zero) and one weight strip.
  std::vector<int8_t> acts(static_cast<size_t>(block / 2 * 2 * K));
  std::vector<float> act_scales(static_cast<size_t>(block / 2 * 4 * nb));
  std::vector<int8_t> strip(static_cast<size_t>(2 * 2 * K));
  std::vector<float> strip_scales(static_cast<size_t>(2 * 4 * nb));
  for (int64_t s0 = 0; s0 < S; s0 += block) {
    const int64_t s1 = std::min(S, s0 + block);
    const int64_t pairs = (s1 - s0 + 3) / 4 * 2;
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t s = s0 + 2 * p;
      const bool r0_ok = s < s1, r1_ok = s + 1 < s1;
      if (!r0_ok) {
        std::fill_n(acts.data() + p * 2 * K, 2 * K, int8_t{0});
        std::fill_n(act_scales.data() + p * 4 * nb, 4 * nb, 0.0f);
        continue;
      }
      pack_act_pair(q + s * K, r1_ok ? q + (s + 1) * K : nullptr, A.d.data() + s * nb,
                    r1_ok ? A.d.data() + (s + 1) * nb : nullptr, nb, acts.data() + p * 2 * K,
                    act_scales.data() + p * 4 * nb);
    }
    for (int64_t r = r0; r < r1; r += 4) {
      const int nw = static_cast<int>(std::min<int64_t>(4, r1 - r));
      const auto row = [&](int w) {
        return wdata + static_cast<size_t>(r + std::min(w, nw - 1)) * row_bytes;
      };
      pack_weight_pair<T>(row(0), row(1), nb, strip.data(), strip_scales.data());
      pack_weight_pair<T>(row(2), row(3), nb, strip.data() + 2 * K, strip_scales.data() + 4 * nb);
      for (int64_t s = s0; s < s1; s += 4) {
        const int nx = static_cast<int>(std::min<int64_t>(4, s1 - s));
        const int64_t p = (s - s0) / 2;
        float out[4][4];
        tile(acts.data() + p * 2 * K, acts.data() + (p + 1) * 2 * K, act_scales.data() + p * 4 * nb,
             act_scales.data() + (p + 1) * 4 * nb, strip.data(), strip.data() + 2 * K,
             strip_scales.data(), strip_scales.data() + 4 * nb, nb, out);
        for (int a = 0; a < nx; ++a)
          for (int w = 0; w < nw; ++w) y[(s + a) * N + r + w] = out[a][w];
      }
    }
  }
}

}  // namespace

QuantRowsFn quant_rows_i8mm(DType t) {
  return t == DType::Q8_0 ? rows_i8mm<DType::Q8_0> : rows_i8mm<DType::Q4_0>;
}

}  // namespace gemstage::neon
