// Prompt prefill with tower soft tokens (spec §4.7): the k-th placeholder row of the prompt gets
// the k-th soft token, also when the prompt is prefilled in chunks — each chunk receives exactly
// the soft tokens of its own placeholder rows.
#pragma once

#include <cstdint>
#include <functional>
#include <span>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "gemma4/text_model.h"
#include "parity/taps.h"
#include "runtime/kv_cache.h"

namespace gemstage {

// Rows of input_ids holding an image / video / audio placeholder id.
int64_t count_placeholders(const ModelConfig& c, std::span<const int32_t> input_ids);

// Rows [begin, begin + n) of a [N, D] tensor.
FloatTensor slice_rows(const FloatTensor& t, int64_t begin, int64_t n);

// One chunk through the model: ids with the soft tokens of exactly their placeholder rows.
using ChunkForward =
    std::function<FloatTensor(std::span<const int32_t> ids, const FloatTensor* soft)>;

// Splits the prompt into chunks of `chunk` tokens (<= 0: one pass), hands each chunk the soft
// tokens of its own placeholder rows, and returns the last chunk's result.
FloatTensor prefill_chunks(const ModelConfig& c, std::span<const int32_t> input_ids,
                           const FloatTensor* soft_tokens, int64_t chunk,
                           const ChunkForward& forward);

// Runs the prompt through every layer in chunks of `chunk` tokens (<= 0: one pass), appending to
// cache. soft_tokens [N, D] (or null when N = 0) must match the prompt's placeholder count.
// Returns the logits of the last chunk: all of its rows if all_logits, else its last row.
FloatTensor prefill(ThreadPool& pool, const TextModel& text, const ModelConfig& c,
                    std::span<const int32_t> input_ids, const FloatTensor* soft_tokens,
                    KvCache& cache, const TextRunOptions& opt, int64_t chunk, bool all_logits,
                    TapRecorder* taps);

}  // namespace gemstage
