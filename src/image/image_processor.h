// Gemma 4 image preprocessing: RGB image -> pixel_values [max_patches, 3*p*p] + position ids,
// matching transformers' Gemma4ImageProcessor (torchvision backend, the default) and, with
// ResizeBackend::kPil, Gemma4ImageProcessorPil. Spec: gemma4-spec.md sections 4.1, 4.6 and 5.1.
#pragma once

#include <array>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "image/image_decode.h"
#include "image/image_resize.h"

namespace gemstage {

struct ImageProcessorConfig {
  int patch_size = 16;
  int max_soft_tokens = 280;  // one of 70, 140, 280, 560, 1120
  int pooling_kernel_size = 3;
  bool do_resize = true;
  int resample = 3;  // PIL.Image.BICUBIC, the only filter implemented (and the Gemma 4 default)
  bool do_rescale = true;
  double rescale_factor = 1.0 / 255.0;
  bool do_normalize = false;
  std::array<double, 3> image_mean{0.0, 0.0, 0.0};
  std::array<double, 3> image_std{1.0, 1.0, 1.0};
  bool do_convert_rgb = true;  // decode_image always yields RGB; kept so the file round-trips
  // Not a JSON field: HF picks the backend by processor class, and the saved file names both
  // "Gemma4ImageProcessor".
  ResizeBackend backend = ResizeBackend::kTorchvision;

  int max_patches() const { return max_soft_tokens * pooling_kernel_size * pooling_kernel_size; }
  // Throws with the field name when a value is out of range.
  void validate(const std::string& what) const;

  // Reads preprocessor_config.json (or its "image_processor" sub-object, as processor_config.json
  // nests it). Missing fields keep the HF class defaults; present fields must have the right JSON
  // type. Unknown fields are ignored.
  static ImageProcessorConfig from_json(const nlohmann::json& j, const std::string& what);
  static ImageProcessorConfig from_json_file(const std::string& path);
};

struct ProcessedImage {
  std::vector<float> pixel_values;    // [max_patches, 3*p*p], (dy, dx, c) inside a patch; 0 padding
  std::vector<int64_t> position_ids;  // [max_patches, 2] (x = column, y = row); -1 padding
  int num_patches = 0;
  int max_patches = 0;
  int patches_h = 0;
  int patches_w = 0;
  int num_soft_tokens = 0;  // num_patches / pooling^2: the number of <|image|> tokens in the prompt
  int resized_h = 0;
  int resized_w = 0;
};

struct ResizeTarget {
  int height = 0;
  int width = 0;
};

// transformers' get_aspect_ratio_preserving_size, step for step (double arithmetic, floor to
// multiples of pooling*patch, the zero-side fallbacks and both errors).
ResizeTarget aspect_ratio_preserving_size(int64_t height, int64_t width, int patch_size,
                                          int max_patches, int pooling_kernel_size);

ProcessedImage preprocess_image(const RgbImage& image, const ImageProcessorConfig& config);

// The processor settings of a checkpoint or bundle directory: preprocessor_config.json, else
// processor_config.json's image_processor, else the Gemma 4 defaults (max_soft_tokens 280).
ImageProcessorConfig load_processor_config(const std::string& model_dir);

}  // namespace gemstage
