// One query head against a run of keys: out = softmax(q·k_j)·v_j, scaling 1.0 (Gemma 4 has no
// 1/sqrt(d) and no attention soft-cap). Keys and values are fetched through callables so the
// same kernel reads a sliding ring, a growing full cache, or the current chunk.
#pragma once

#include <cstdint>

#include "kernels/ops.h"

namespace gemstage {

float dot_f32(const float* a, const float* b, int64_t n);
// y += a * x
void axpy_f32(float a, const float* x, float* y, int64_t n);

template <typename KeyFn, typename ValFn>
void attend_head(const float* q, int64_t head_dim, int64_t n_keys, KeyFn key, ValFn val,
                 float* scores, float* out) {
  for (int64_t j = 0; j < n_keys; ++j) scores[j] = dot_f32(q, key(j), head_dim);
  softmax_inplace(scores, n_keys);
  for (int64_t d = 0; d < head_dim; ++d) out[d] = 0.0f;
  for (int64_t j = 0; j < n_keys; ++j) axpy_f32(scores[j], val(j), out, head_dim);
}

// Double-precision reference over contiguous K/V [n_keys, head_dim].
void attention_reference(const float* q, const float* k, const float* v, int64_t head_dim,
                         int64_t n_keys, float* out);

}  // namespace gemstage
