#include "kernels/arm/vec_neon.h"

#if defined(__aarch64__)

#include <arm_neon.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace gemstage::neon {

namespace {

// n (< 4 allowed, <= 0 gives zeros) floats from p, zero-filled past n.
inline float32x4_t load(const float* p, int64_t n) {
  if (n >= 4) return vld1q_f32(p);
  float t[4] = {};
  std::memcpy(t, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(float));
  return vld1q_f32(t);
}
inline void store(float* p, int64_t n, float32x4_t v) {
  if (n >= 4) return vst1q_f32(p, v);
  float t[4];
  vst1q_f32(t, v);
  std::memcpy(p, t, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(float));
}
// bf16 bit patterns widen exactly (shift into the high half of each f32).
inline float32x4_t load(const uint16_t* p, int64_t n) {
  uint16x4_t h;
  if (n >= 4) {
    h = vld1_u16(p);
  } else {
    uint16_t t[4] = {};
    std::memcpy(t, p, static_cast<size_t>(std::max<int64_t>(n, 0)) * sizeof(uint16_t));
    h = vld1_u16(t);
  }
  return vreinterpretq_f32_u32(vshll_n_u16(h, 16));
}
// Lanes [0, n) all ones (all lanes when n >= 4).
inline uint32x4_t tail_mask(int64_t n) {
  const int32_t c = static_cast<int32_t>(std::clamp<int64_t>(n, 0, 4));
  const int32_t idx[4] = {0, 1, 2, 3};
  return vcgtq_s32(vdupq_n_s32(c), vld1q_s32(idx));
}

// As avx2's exp_ps: Cody-Waite reduction, a degree-7 polynomial, 2^n as two exponent-field
// products so results below FLT_MIN underflow gradually to 0 as std::exp does.
inline float32x4_t exp_ps(float32x4_t x) {
  // vminnm/vmaxnm would drop a NaN; vmin/vmax propagate it, as the x86 twins do.
  x = vminq_f32(vdupq_n_f32(88.7f), x);
  x = vmaxq_f32(vdupq_n_f32(-103.9f), x);
  const float32x4_t n = vrndnq_f32(vmulq_n_f32(x, 1.44269504088896341f));
  float32x4_t r = vfmsq_f32(x, n, vdupq_n_f32(0.693145751953125f));
  r = vfmsq_f32(r, n, vdupq_n_f32(1.428606765330187e-6f));
  float32x4_t p = vdupq_n_f32(1.0f / 5040.0f);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 720.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 120.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 24.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f / 6.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(0.5f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  p = vfmaq_f32(vdupq_n_f32(1.0f), p, r);
  const int32x4_t ni = vcvtq_s32_f32(n);  // n is integral already
  const int32x4_t n1 = vshrq_n_s32(ni, 1), n2 = vsubq_s32(ni, n1);
  const int32x4_t bias = vdupq_n_s32(127);
  const float32x4_t s1 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n1, bias), 23));
  const float32x4_t s2 = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(n2, bias), 23));
  return vmulq_f32(vmulq_f32(p, s1), s2);
}

inline float32x4_t tanh_ps(float32x4_t u) {
  const float32x4_t a = vabsq_f32(u);
  const float32x4_t u2 = vmulq_f32(u, u);
  float32x4_t p = vdupq_n_f32(62.0f / 2835.0f);
  p = vfmaq_f32(vdupq_n_f32(-17.0f / 315.0f), p, u2);
  p = vfmaq_f32(vdupq_n_f32(2.0f / 15.0f), p, u2);
  p = vfmaq_f32(vdupq_n_f32(-1.0f / 3.0f), p, u2);
  p = vmulq_f32(p, u2);
  const float32x4_t small = vfmaq_f32(u, p, u);
  const float32x4_t e = exp_ps(vaddq_f32(a, a));
  const float32x4_t big =
      vsubq_f32(vdupq_n_f32(1.0f), vdivq_f32(vdupq_n_f32(2.0f), vaddq_f32(e, vdupq_n_f32(1.0f))));
  const uint32x4_t sign = vandq_u32(vreinterpretq_u32_f32(u), vdupq_n_u32(0x80000000u));
  const float32x4_t big_signed = vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(big), sign));
  return vbslq_f32(vcltq_f32(a, vdupq_n_f32(0.3f)), small, big_signed);
}

inline float32x4_t gelu_tanh_ps(float32x4_t x) {
  const float32x4_t x3 = vmulq_f32(vmulq_f32(x, x), x);
  const float32x4_t inner =
      vmulq_n_f32(vfmaq_f32(x, vdupq_n_f32(0.044715f), x3), 0.7978845608028654f);
  const float32x4_t half_x = vmulq_n_f32(x, 0.5f);
  return vfmaq_f32(half_x, half_x, tanh_ps(inner));
}

}  // namespace

void scale_row(const float* x, float inv, const float* w, int64_t n, float* y) {
  for (int64_t i = 0; i < n; i += 4) {
    float32x4_t v = vmulq_n_f32(load(x + i, n - i), inv);
    if (w) v = vmulq_f32(v, load(w + i, n - i));
    store(y + i, n - i, v);
  }
}

void gelu_tanh_mul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 4)
    store(out + i, n - i, vmulq_f32(gelu_tanh_ps(load(gate + i, n - i)), load(up + i, n - i)));
}

void softcap(float* x, int64_t n, float cap) {
  const float32x4_t c = vdupq_n_f32(cap);
  for (int64_t i = 0; i < n; i += 4)
    store(x + i, n - i, vmulq_f32(c, tanh_ps(vdivq_f32(load(x + i, n - i), c))));
}

void softmax_inplace(float* s, int64_t n) {
  if (n <= 0) return;
  const float32x4_t ninf = vdupq_n_f32(-INFINITY);
  float32x4_t mx = ninf;
  for (int64_t i = 0; i < n; i += 4)
    mx = vmaxq_f32(mx, vbslq_f32(tail_mask(n - i), load(s + i, n - i), ninf));
  const float32x4_t vmax = vdupq_n_f32(vmaxvq_f32(mx));
  float32x4_t sum = vdupq_n_f32(0.0f);
  for (int64_t i = 0; i < n; i += 4) {
    const float32x4_t e = vreinterpretq_f32_u32(vandq_u32(
        tail_mask(n - i), vreinterpretq_u32_f32(exp_ps(vsubq_f32(load(s + i, n - i), vmax)))));
    store(s + i, n - i, e);
    sum = vaddq_f32(sum, e);
  }
  const float inv = 1.0f / vaddvq_f32(sum);
  for (int64_t i = 0; i < n; i += 4) store(s + i, n - i, vmulq_n_f32(load(s + i, n - i), inv));
}

namespace {

template <typename T>
inline float dot_t(const float* a, const T* b, int64_t n) {
  // Four accumulators hide the FMA latency.
  float32x4_t s0 = vdupq_n_f32(0), s1 = s0, s2 = s0, s3 = s0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = vfmaq_f32(s0, vld1q_f32(a + i), load(b + i, 4));
    s1 = vfmaq_f32(s1, vld1q_f32(a + i + 4), load(b + i + 4, 4));
    s2 = vfmaq_f32(s2, vld1q_f32(a + i + 8), load(b + i + 8, 4));
    s3 = vfmaq_f32(s3, vld1q_f32(a + i + 12), load(b + i + 12, 4));
  }
  for (; i < n; i += 4) s0 = vfmaq_f32(s0, load(a + i, n - i), load(b + i, n - i));
  return vaddvq_f32(vaddq_f32(vaddq_f32(s0, s1), vaddq_f32(s2, s3)));
}

}  // namespace

float dot(const float* a, const float* b, int64_t n) {
  return dot_t(a, b, n);
}

void axpy(float a, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 4)
    store(y + i, n - i, vfmaq_n_f32(load(y + i, n - i), load(x + i, n - i), a));
}

namespace {

// Up to 4 queries' outputs, one 8-column slice at a time, stay in registers across all nk value
// rows: each value vector is loaded once per slice and used by every query of the group.
template <int NG, typename T>
void accumulate_values(const float* p, int64_t pstride, const T* const* v, int64_t nk, int64_t hd,
                       float* const* out) {
  for (int64_t d = 0; d < hd; d += 8) {
    const int64_t n0 = hd - d, n1 = hd - d - 4;
    float32x4_t a0[NG], a1[NG];
    for (int g = 0; g < NG; ++g) {
      a0[g] = load(out[g] + d, n0);
      a1[g] = n1 > 0 ? load(out[g] + d + 4, n1) : vdupq_n_f32(0);
    }
    for (int64_t j = 0; j < nk; ++j) {
      const float32x4_t v0 = load(v[j] + d, n0);
      const float32x4_t v1 = n1 > 0 ? load(v[j] + d + 4, n1) : vdupq_n_f32(0);
      for (int g = 0; g < NG; ++g) {
        const float s = p[g * pstride + j];
        a0[g] = vfmaq_n_f32(a0[g], v0, s);
        a1[g] = vfmaq_n_f32(a1[g], v1, s);
      }
    }
    for (int g = 0; g < NG; ++g) {
      store(out[g] + d, n0, a0[g]);
      if (n1 > 0) store(out[g] + d + 4, n1, a1[g]);
    }
  }
}

// Scores of up to 2 queries against one key: the key row is loaded once for both.
template <typename T>
void score_pair(const float* q0, const float* q1, const T* k, int64_t hd, float* s0, float* s1) {
  float32x4_t a0 = vdupq_n_f32(0), a1 = vdupq_n_f32(0);
  for (int64_t d = 0; d < hd; d += 4) {
    const float32x4_t kv = load(k + d, hd - d);
    a0 = vfmaq_f32(a0, load(q0 + d, hd - d), kv);
    a1 = vfmaq_f32(a1, load(q1 + d, hd - d), kv);
  }
  *s0 = vaddvq_f32(a0);
  *s1 = vaddvq_f32(a1);
}

template <typename T>
void key_block(const float* const* q, float* const* out, const int64_t* lo, const int64_t* hi,
               int64_t M, int64_t hd, const T* const* k, const T* const* v, int64_t nk,
               int64_t first, float* scores, int64_t ss, float* max, float* sum) {
  // Scores of every (query, key) pair; masked ones are overwritten by the softmax pass below.
  for (int64_t m = 0; m < M; m += 2) {
    const int64_t m1 = std::min(m + 1, M - 1);
    float discard = 0;
    for (int64_t j = 0; j < nk; ++j)
      score_pair(q[m], q[m1], k[j], hd, scores + m * ss + j,
                 m1 != m ? scores + m1 * ss + j : &discard);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t a = std::max<int64_t>(lo[m] - first, 0),
                  b = std::min<int64_t>(hi[m] - first, nk - 1);
    float* row = scores + m * ss;
    if (a > b) {  // nothing visible in this block: p = 0, the running state stays
      std::fill_n(row, nk, 0.0f);
      continue;
    }
    float block_max = -INFINITY;
    for (int64_t j = a; j <= b; ++j) block_max = std::max(block_max, row[j]);
    const float new_max = std::max(max[m], block_max);
    const float scale = std::exp(max[m] - new_max);  // 0 for the first visible block
    std::fill_n(row, a, 0.0f);
    std::fill(row + b + 1, row + nk, 0.0f);
    const float32x4_t vmax = vdupq_n_f32(new_max);
    float32x4_t added = vdupq_n_f32(0);
    for (int64_t j = a; j <= b; j += 4) {
      const int64_t n = b + 1 - j;
      const float32x4_t e = vreinterpretq_f32_u32(vandq_u32(
          tail_mask(n), vreinterpretq_u32_f32(exp_ps(vsubq_f32(load(row + j, n), vmax)))));
      store(row + j, n, e);
      added = vaddq_f32(added, e);
    }
    sum[m] = sum[m] * scale + vaddvq_f32(added);
    max[m] = new_max;
    if (scale != 1.0f)
      for (int64_t d = 0; d < hd; d += 4)
        store(out[m] + d, hd - d, vmulq_n_f32(load(out[m] + d, hd - d), scale));
  }
  for (int64_t g0 = 0; g0 < M; g0 += 4) {
    const float* p = scores + g0 * ss;
    switch (std::min<int64_t>(M - g0, 4)) {
      case 1:
        accumulate_values<1>(p, ss, v, nk, hd, out + g0);
        break;
      case 2:
        accumulate_values<2>(p, ss, v, nk, hd, out + g0);
        break;
      case 3:
        accumulate_values<3>(p, ss, v, nk, hd, out + g0);
        break;
      default:
        accumulate_values<4>(p, ss, v, nk, hd, out + g0);
        break;
    }
  }
}

}  // namespace

void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const float* const* k,
                      const float* const* v, int64_t nk, int64_t first, float* scores, int64_t ss,
                      float* max, float* sum) {
  key_block(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum);
}

void attend_key_block(const float* const* q, float* const* out, const int64_t* lo,
                      const int64_t* hi, int64_t M, int64_t hd, const uint16_t* const* k,
                      const uint16_t* const* v, int64_t nk, int64_t first, float* scores,
                      int64_t ss, float* max, float* sum) {
  key_block(q, out, lo, hi, M, hd, k, v, nk, first, scores, ss, max, sum);
}

}  // namespace gemstage::neon

#endif  // aarch64
