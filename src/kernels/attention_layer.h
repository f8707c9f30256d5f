// One layer's attention for one call, scheduled over the pool: S query rows at positions
// start..start+S-1 against the keys their sequence's cache holds before `start` and the call's
// own fresh rows. It owns how the work is cut into tasks (kernels/attention.h has the per-task
// kernels), so the model code states what to attend and not how to spread it over threads.
#pragma once

#include <cstdint>
#include <vector>

#include "cache/kv_cache.h"
#include "core/thread_pool.h"

namespace gemstage {

struct LayerAttention {
  const float* q = nullptr;  // [rows, heads, head_dim], after the q norm and RoPE
  int64_t rows = 0, heads = 0, kv_heads = 0, head_dim = 0;
  int64_t start = 0;   // position of row 0; rows before it come from `past`
  int64_t window = 0;  // sliding window (keys in (pos - window, pos]); 0: full causal
  const LayerKvCache* past = nullptr;
  // [rows, kv_heads * head_dim] in past->kv_type()'s row type (float, bf16 bits as uint16_t,
  // or q8_0 KvQ8Block rows of kv_heads * head_dim / 32 blocks)
  const void* fresh_k = nullptr;
  const void* fresh_v = nullptr;
  float* out = nullptr;  // [rows, heads, head_dim]
  // Optional, [rows]: the last key position each row sees when that is past its own position
  // (the bidirectional image block of the large models: an image row on a sliding layer also
  // sees the later rows of its image, all among the call's fresh rows); null: causal.
  const int64_t* last_key = nullptr;
};

// Buffers reused from layer to layer (decode's partial softmax states).
struct AttentionWorkspace {
  std::vector<float> part_out, part_max, part_sum;
};

void attend_layer(ThreadPool& pool, const LayerAttention& a, AttentionWorkspace& ws);

}  // namespace gemstage
