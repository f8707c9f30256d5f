// Prompt prefill with tower soft tokens: the k-th placeholder row of the prompt gets
// the k-th soft token, also when the prompt is prefilled in chunks — each chunk receives exactly
// the soft tokens of its own placeholder rows.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/tensor.h"
#include "gemma4/config.h"

namespace gemstage {

// Rows of input_ids holding an image / video / audio placeholder id.
int64_t count_placeholders(const ModelConfig& c, std::span<const int32_t> input_ids);

// The bidirectional image block's groups (TextConfig::bidirectional_vision): each maximal run of
// image / video placeholder rows is one group, numbered first_group, first_group + 1, ... in
// order; every other row is -1 (transformers derives the same from mm_token_type_ids 1 and 2).
std::vector<int32_t> vision_groups(const ModelConfig& c, std::span<const int32_t> input_ids,
                                   int32_t first_group = 0);

// Where a prompt chunk that would end at `end` must end instead so that it never splits an
// image block: the start of the image run that crosses `end`, or, when that run starts the
// chunk at `begin`, its end. Without the bidirectional block any end is fine.
int64_t chunk_end_keeping_images_whole(const ModelConfig& c, std::span<const int32_t> input_ids,
                                       int64_t begin, int64_t end);

// One soft-token list for the prompt's placeholder rows in row order: image/video rows take the
// vision soft tokens in order, audio rows the audio ones (HF splices each modality into its own
// rows with masked_scatter). Either may be null; each given list must match its rows' count
// exactly. Returns an empty tensor when neither is given.
FloatTensor merge_soft_tokens(const ModelConfig& c, std::span<const int32_t> input_ids,
                              const FloatTensor* vision_soft, const FloatTensor* audio_soft);

// Rows [begin, begin + n) of a [N, D] tensor.
FloatTensor slice_rows(const FloatTensor& t, int64_t begin, int64_t n);

// One chunk through the model: ids with the soft tokens of exactly their placeholder rows.
using ChunkForward =
    std::function<FloatTensor(std::span<const int32_t> ids, const FloatTensor* soft)>;

// Splits the prompt into chunks of `chunk` tokens (<= 0: one pass; never inside an image on the
// large models, chunk_end_keeping_images_whole), hands each chunk the soft tokens of its own
// placeholder rows, and returns the last chunk's result.
FloatTensor prefill_chunks(const ModelConfig& c, std::span<const int32_t> input_ids,
                           const FloatTensor* soft_tokens, int64_t chunk,
                           const ChunkForward& forward);

}  // namespace gemstage
