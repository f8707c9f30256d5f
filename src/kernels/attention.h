// One query head against a run of keys: out = softmax(q·k_j)·v_j, scaling 1.0 (Gemma 4 has no
// 1/sqrt(d) and no attention soft-cap). Keys and values are fetched through callables so the
// same kernel reads a sliding ring, a growing full cache, or the current chunk.
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/ops.h"

namespace gemstage {

float dot_f32(const float* a, const float* b, int64_t n);
// y += a * x
void axpy_f32(float a, const float* x, float* y, int64_t n);

// scores[g * stride] = dot(q + g * hd, k, hd) for the G heads of q: k is read once for all.
void dot_heads(const float* q, int64_t G, int64_t hd, const float* k, float* scores,
               int64_t stride);
// out[g * hd + d] += sum_j p[g * pstride + j] * v[j][d] over nk value rows: the AVX-512 path
// keeps a slice of every head's output in registers across all nk rows instead of re-reading and
// re-writing it once per row.
void accumulate_values(const float* p, int64_t pstride, int64_t G, const float* const* v,
                       int64_t nk, int64_t hd, float* out);

// G query heads that share one KV head (grouped-query attention), q and out holding the G heads
// back to back: every key and value row is read once for the whole group. At long context the
// full layers' caches are far larger than the L2 cache, so reading them once per group instead of
// once per query head is what keeps deep decode from slowing G-fold. scores holds G * n_keys.
template <typename KeyFn, typename ValFn>
void attend_group(const float* q, int64_t G, int64_t head_dim, int64_t n_keys, KeyFn key, ValFn val,
                  float* scores, float* out) {
  for (int64_t j = 0; j < n_keys; ++j) dot_heads(q, G, head_dim, key(j), scores + j, n_keys);
  for (int64_t g = 0; g < G; ++g) softmax_inplace(scores + g * n_keys, n_keys);
  for (int64_t d = 0; d < G * head_dim; ++d) out[d] = 0.0f;
  constexpr int64_t kRows = 16;  // value rows per accumulate_values call
  const float* rows[kRows];
  for (int64_t j0 = 0; j0 < n_keys; j0 += kRows) {
    const int64_t nk = std::min(kRows, n_keys - j0);
    for (int64_t j = 0; j < nk; ++j) rows[j] = val(j0 + j);
    accumulate_values(scores + j0, n_keys, G, rows, nk, head_dim, out);
  }
}

template <typename KeyFn, typename ValFn>
void attend_head(const float* q, int64_t head_dim, int64_t n_keys, KeyFn key, ValFn val,
                 float* scores, float* out) {
  attend_group(q, 1, head_dim, n_keys, key, val, scores, out);
}

// Double-precision reference over contiguous K/V [n_keys, head_dim].
void attention_reference(const float* q, const float* k, const float* v, int64_t head_dim,
                         int64_t n_keys, float* out);

}  // namespace gemstage
