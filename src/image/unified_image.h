// The image processor of gemma4_unified (Gemma4UnifiedImageProcessor, docs/
// gemma4-unified.md): the same aspect-preserving resize as Gemma 4's (fill the soft-token budget,
// small images scaled up, sides floored to multiples of patch_size * pooling_kernel_size), values
// uint8/255 without normalisation, then one vector per (patch·pooling)-px block in (row, column,
// channel) order, blocks row-major, position (x = block column, y = block row), padded to
// max_soft_tokens rows with zeros and (-1, -1).
#pragma once

#include <cstdint>
#include <vector>

#include "image/image_decode.h"
#include "image/image_processor.h"

namespace gemstage {

struct UnifiedPatches {
  std::vector<float> pixel_values;    // [max_soft_tokens, block·block·3]
  std::vector<int64_t> position_ids;  // [max_soft_tokens, 2]
  int max_soft_tokens = 0;
  int num_soft_tokens = 0;  // grid_h · grid_w: the <|image|> count in the prompt
  int grid_h = 0, grid_w = 0;
  int resized_h = 0, resized_w = 0;
};

// The size an image is resized to (the Gemma 4 rule with max_patches = budget · pooling²).
ResizeTarget unified_resize_target(int64_t height, int64_t width, const ImageProcessorConfig& c);

UnifiedPatches preprocess_unified_image(const RgbImage& image, const ImageProcessorConfig& c);

}  // namespace gemstage
