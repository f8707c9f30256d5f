// y = x * W^T for F32 / BF16 / F16 weights on NEON: 4 weight rows x 2 activation rows per step,
// as the AVX2 tile.
#include "kernels/arm/float_matmul.h"

#include <arm_neon.h>

#include <algorithm>

namespace gemstage::neon {

namespace {

template <DType T>
inline float32x4_t load_w4(const void* base, int64_t i) {
  if constexpr (T == DType::F32) {
    return vld1q_f32(static_cast<const float*>(base) + i);
  } else if constexpr (T == DType::BF16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(base) + i), 16));
  } else {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(base) + i)));
  }
}

template <DType T>
void rows_neon(const float* x, int64_t S, const WeightView& w, float* y, int64_t r0, int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  const int64_t full = K & ~int64_t{3};
  for (int64_t r = r0; r < r1; r += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, r1 - r));
    for (int64_t s = 0; s < S; s += 2) {
      const int nx = static_cast<int>(std::min<int64_t>(2, S - s));
      float32x4_t acc[2][4];
      for (auto& a : acc)
        for (auto& b : a) b = vdupq_n_f32(0);
      for (int64_t k = 0; k < full; k += 4) {
        float32x4_t wv[4];
        for (int b = 0; b < 4; ++b)
          wv[b] = b < nw ? load_w4<T>(w.data, (r + b) * K + k) : vdupq_n_f32(0);
        for (int a = 0; a < nx; ++a) {
          const float32x4_t xv = vld1q_f32(x + (s + a) * K + k);
          for (int b = 0; b < 4; ++b) acc[a][b] = vfmaq_f32(acc[a][b], xv, wv[b]);
        }
      }
      for (int a = 0; a < nx; ++a)
        for (int b = 0; b < nw; ++b) {
          float v = vaddvq_f32(acc[a][b]);
          for (int64_t k = full; k < K; ++k)
            v += x[(s + a) * K + k] * widen_weight(w.data, T, (r + b) * K + k);
          y[(s + a) * N + r + b] = v;
        }
    }
  }
}

}  // namespace

FloatRowsFn float_rows(DType t) {
  if (t == DType::F32) return rows_neon<DType::F32>;
  if (t == DType::BF16) return rows_neon<DType::BF16>;
  if (t == DType::F16) return rows_neon<DType::F16>;
  return nullptr;
}

}  // namespace gemstage::neon
