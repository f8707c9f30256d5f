#include "kernels/attention.h"

#include <cmath>
#include <vector>

#include "kernels/vec_avx512.h"

namespace gemstage {

float dot_f32(const float* a, const float* b, int64_t n) {
  if (vector_ops_use_avx512()) return avx512::dot(a, b, n);
  // Four partial sums let the compiler vectorize without -ffast-math.
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

void axpy_f32(float a, const float* x, float* y, int64_t n) {
  if (vector_ops_use_avx512()) return avx512::axpy(a, x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void dot_heads(const float* q, int64_t G, int64_t hd, const float* k, float* scores,
               int64_t stride) {
  if (vector_ops_use_avx512()) return avx512::dot_heads(q, G, hd, k, scores, stride);
  for (int64_t g = 0; g < G; ++g) scores[g * stride] = dot_f32(q + g * hd, k, hd);
}

void accumulate_values(const float* p, int64_t pstride, int64_t G, const float* const* v,
                       int64_t nk, int64_t hd, float* out) {
  if (vector_ops_use_avx512()) return avx512::accumulate_values(p, pstride, G, v, nk, hd, out);
  for (int64_t j = 0; j < nk; ++j)
    for (int64_t g = 0; g < G; ++g) axpy_f32(p[g * pstride + j], v[j], out + g * hd, hd);
}

void attention_reference(const float* q, const float* k, const float* v, int64_t head_dim,
                         int64_t n_keys, float* out) {
  std::vector<double> s(static_cast<size_t>(n_keys));
  double m = -INFINITY;
  for (int64_t j = 0; j < n_keys; ++j) {
    double d = 0;
    for (int64_t i = 0; i < head_dim; ++i) d += static_cast<double>(q[i]) * k[j * head_dim + i];
    s[static_cast<size_t>(j)] = d;
    m = std::max(m, d);
  }
  double sum = 0;
  for (double& x : s) sum += (x = std::exp(x - m));
  for (int64_t i = 0; i < head_dim; ++i) {
    double o = 0;
    for (int64_t j = 0; j < n_keys; ++j) o += s[static_cast<size_t>(j)] / sum * v[j * head_dim + i];
    out[i] = static_cast<float>(o);
  }
}

}  // namespace gemstage
