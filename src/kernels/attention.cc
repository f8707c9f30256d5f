#include "kernels/attention.h"

#include <cmath>
#include <type_traits>
#include <vector>

#include "core/dtype.h"
#include "kernels/ops.h"
#include "kernels/vec_kernels.h"

namespace gemstage {

float dot_f32(CpuTier tier, const float* a, const float* b, int64_t n) {
  if (const VecKernels* k = vec_kernels(tier)) return k->dot(a, b, n);
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

void axpy_f32(CpuTier tier, float a, const float* x, float* y, int64_t n) {
  if (const VecKernels* k = vec_kernels(tier)) return k->axpy(a, x, y, n);
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

namespace {

// Value i of a row of each cache type.
inline float value_at(const float* row, int64_t i) {
  return row[i];
}
inline float value_at(const uint16_t* row, int64_t i) {
  return bf16_to_f32(row[i]);
}
inline float value_at(const KvQ8Block* row, int64_t i) {
  return kv_q8_value(row, i);
}

template <typename T>
float portable_dot(const float* a, const T* b, int64_t n) {
  double s = 0;  // the reference: no reordering question at all
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * value_at(b, i);
  return static_cast<float>(s);
}

template <typename T>
void portable_key_block(const QueryBlock& qb, int64_t head_dim, const T* const* k,
                        const T* const* v, int64_t nk, int64_t first, AttentionScratch& s) {
  for (int64_t m = 0; m < qb.size(); ++m) {
    const size_t mi = static_cast<size_t>(m);
    const int64_t a = std::max<int64_t>(qb.lo[mi] - first, 0);
    const int64_t b = std::min<int64_t>(qb.hi[mi] - first, nk - 1);
    if (a > b) continue;  // none of this block's keys is visible to this query
    float* row = s.scores.data() + m * kKeyBlock;
    float block_max = -INFINITY;
    for (int64_t j = a; j <= b; ++j) {
      row[j] = portable_dot(qb.q[mi], k[j], head_dim);
      block_max = std::max(block_max, row[j]);
    }
    const float new_max = std::max(s.max[mi], block_max);
    const float scale = std::exp(s.max[mi] - new_max);  // 0 for the first visible block
    float* o = qb.out[mi];
    for (int64_t d = 0; d < head_dim; ++d) o[d] *= scale;
    float added = 0;
    for (int64_t j = a; j <= b; ++j) {
      const float p = std::exp(row[j] - new_max);
      added += p;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * value_at(v[j], d);
    }
    s.sum[mi] = s.sum[mi] * scale + added;
    s.max[mi] = new_max;
  }
}

// One dispatch for both row types: the twin of the queries' tier, else the portable loops.
template <typename T>
void dispatch_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<T>& rows,
                        int64_t nk, const KeyBlockRows<T>& next, int64_t next_nk, int64_t first,
                        AttentionScratch& s) {
  if (const VecKernels* kt = vec_kernels(qb.tier)) {
    AttendKeyBlockFn<T> fn;
    if constexpr (std::is_same_v<T, float>)
      fn = kt->attend_key_block_f32;
    else if constexpr (std::is_same_v<T, uint16_t>)
      fn = kt->attend_key_block_bf16;
    else
      fn = kt->attend_key_block_q8;
    // A tier without a q8_0 twin (NEON) runs the portable loops.
    if (fn)
      return fn(qb.q.data(), qb.out.data(), qb.lo.data(), qb.hi.data(), qb.size(), head_dim,
                rows.keys, rows.values, nk, first, s.scores.data(), kKeyBlock, s.max.data(),
                s.sum.data(), next.keys, next.values, next_nk);
  }
  portable_key_block(qb, head_dim, rows.keys, rows.values, nk, first, s);  // the reference
}

}  // namespace

void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<float>& rows,
                      int64_t nk, const KeyBlockRows<float>& next, int64_t next_nk, int64_t first,
                      AttentionScratch& s) {
  dispatch_key_block(qb, head_dim, rows, nk, next, next_nk, first, s);
}

void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<uint16_t>& rows,
                      int64_t nk, const KeyBlockRows<uint16_t>& next, int64_t next_nk,
                      int64_t first, AttentionScratch& s) {
  dispatch_key_block(qb, head_dim, rows, nk, next, next_nk, first, s);
}

void attend_key_block(const QueryBlock& qb, int64_t head_dim, const KeyBlockRows<KvQ8Block>& rows,
                      int64_t nk, const KeyBlockRows<KvQ8Block>& next, int64_t next_nk,
                      int64_t first, AttentionScratch& s) {
  dispatch_key_block(qb, head_dim, rows, nk, next, next_nk, first, s);
}

void merge_partial_attention(CpuTier tier, const float* part_out, const float* max,
                             const float* sum, int64_t n_parts, int64_t stride, int64_t head_dim,
                             float* out) {
  float m = -INFINITY;
  for (int64_t i = 0; i < n_parts; ++i)
    if (sum[i * stride] > 0) m = std::max(m, max[i * stride]);
  std::fill_n(out, head_dim, 0.0f);
  float total = 0;
  for (int64_t i = 0; i < n_parts; ++i) {
    if (!(sum[i * stride] > 0)) continue;  // its output was never written
    const float w = std::exp(max[i * stride] - m);
    total += w * sum[i * stride];
    axpy_f32(tier, w, part_out + i * stride * head_dim, out, head_dim);
  }
  const float inv = 1.0f / total;
  for (int64_t d = 0; d < head_dim; ++d) out[d] *= inv;
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
