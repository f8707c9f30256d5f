#include "kernels/ops.h"

#include <algorithm>
#include <cmath>

#include "core/cpu_features.h"
#include "kernels/vec_kernels.h"

namespace gemstage {

VecPath vector_ops_path([[maybe_unused]] CpuTier tier) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_tier_at_least(tier, CpuTier::Avx512)) return VecPath::Avx512;
  if (cpu_tier_at_least(tier, CpuTier::Avx2)) return VecPath::Avx2;
#endif
#if defined(__aarch64__)
  if (cpu_tier_is_arm(tier)) return VecPath::Neon;
#endif
  return VecPath::Scalar;
}

void rmsnorm_rows(CpuTier tier, const float* x, int64_t rows, int64_t n, const float* w, float eps,
                  float* y) {
  const VecKernels* k = vec_kernels(tier);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * n;
    float* yr = y + r * n;
    float ss = 0.0f;
    if (k) {
      ss = k->dot(xr, xr, n);
    } else {
      for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    }
    // HF: pow(mean + eps, -0.5), not rsqrt.
    const float inv = std::pow(ss / static_cast<float>(n) + eps, -0.5f);
    if (k) {
      k->scale_row(xr, inv, w, n, yr);
    } else if (w) {
      for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv * w[i];
    } else {
      for (int64_t i = 0; i < n; ++i) yr[i] = xr[i] * inv;
    }
  }
}

float gelu_tanh(float x) {
  constexpr float kSqrt2OverPi = 0.7978845608028654f;
  return 0.5f * x * (1.0f + std::tanh(kSqrt2OverPi * (x + 0.044715f * x * x * x)));
}

void gelu_tanh_mul(CpuTier tier, const float* gate, const float* up, int64_t n, float* out) {
  if (const VecKernels* k = vec_kernels(tier)) return k->gelu_tanh_mul(gate, up, n, out);
  for (int64_t i = 0; i < n; ++i) out[i] = gelu_tanh(gate[i]) * up[i];
}

void softcap(CpuTier tier, float* x, int64_t n, float cap) {
  if (const VecKernels* k = vec_kernels(tier)) return k->softcap(x, n, cap);
  for (int64_t i = 0; i < n; ++i) x[i] = cap * std::tanh(x[i] / cap);
}

RopeTable RopeTable::standard(int head_dim, double theta) {
  RopeTable t;
  t.head_dim = head_dim;
  t.n_rotated = head_dim / 2;
  t.inv_freq.resize(static_cast<size_t>(head_dim / 2));
  for (int i = 0; i < head_dim / 2; ++i)
    t.inv_freq[static_cast<size_t>(i)] =
        static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / head_dim));
  return t;
}

RopeTable RopeTable::proportional(int head_dim, double theta, double partial_rotary_factor) {
  RopeTable t;
  t.head_dim = head_dim;
  // HF: rope_angles = int(partial * head_dim // 2); exponent divides by the full head_dim.
  t.n_rotated = static_cast<int>(partial_rotary_factor * head_dim / 2.0);
  t.inv_freq.assign(static_cast<size_t>(head_dim / 2), 0.0f);
  for (int i = 0; i < t.n_rotated; ++i)
    t.inv_freq[static_cast<size_t>(i)] =
        static_cast<float>(1.0 / std::pow(theta, (2.0 * i) / head_dim));
  return t;
}

RopeAngles RopeAngles::at(const RopeTable& table, int64_t first, int64_t rows) {
  RopeAngles a;
  a.head_dim = table.head_dim;
  a.n_rotated = table.n_rotated;
  const size_t n = static_cast<size_t>(rows) * static_cast<size_t>(table.n_rotated);
  a.cos.resize(n);
  a.sin.resize(n);
  for (int64_t r = 0; r < rows; ++r)
    for (int i = 0; i < table.n_rotated; ++i) {
      // Angles in f32 as HF computes them (inv_freq @ position in float32).
      const float ang = static_cast<float>(first + r) * table.inv_freq[static_cast<size_t>(i)];
      const size_t at = static_cast<size_t>(r * table.n_rotated + i);
      a.cos[at] = std::cos(ang);
      a.sin[at] = std::sin(ang);
    }
  return a;
}

void apply_rope(const RopeAngles& angles, int64_t row, float* v, int n_heads) {
  const int half = angles.head_dim / 2, nr = angles.n_rotated;
  const float* c = angles.cos.data() + row * nr;
  const float* s = angles.sin.data() + row * nr;
  for (int h = 0; h < n_heads; ++h) {
    float* x = v + static_cast<int64_t>(h) * angles.head_dim;
    for (int i = 0; i < nr; ++i) {
      const float x1 = x[i], x2 = x[i + half];
      x[i] = x1 * c[i] - x2 * s[i];
      x[i + half] = x2 * c[i] + x1 * s[i];
    }
  }
}

void apply_rope(const RopeTable& table, int64_t pos, float* v, int n_heads) {
  apply_rope(RopeAngles::at(table, pos, 1), 0, v, n_heads);
}

void softmax_inplace(CpuTier tier, float* s, int64_t n) {
  if (const VecKernels* k = vec_kernels(tier)) return k->softmax_inplace(s, n);
  float m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = std::max(m, s[i]);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = std::exp(s[i] - m);
    sum += s[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

}  // namespace gemstage
