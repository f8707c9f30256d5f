#include "image/image_processor.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

namespace {

constexpr int kSupportedSoftTokens[] = {70, 140, 280, 560, 1120};

const char* json_type(const nlohmann::json& v) {
  return v.type_name();
}

void read_int(const nlohmann::json& j, const char* key, int* out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (!it->is_number_integer())
    fail(what, ": field \"", key, "\" must be an integer, found ", json_type(*it), " (", it->dump(),
         ")");
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) fail(what, ": field \"", key, "\" = ", v, " is out of range");
  *out = static_cast<int>(v);
}

void read_bool(const nlohmann::json& j, const char* key, bool* out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (!it->is_boolean())
    fail(what, ": field \"", key, "\" must be true or false, found ", json_type(*it), " (",
         it->dump(), ")");
  *out = it->get<bool>();
}

void read_double(const nlohmann::json& j, const char* key, double* out, const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (!it->is_number())
    fail(what, ": field \"", key, "\" must be a number, found ", json_type(*it), " (", it->dump(),
         ")");
  *out = it->get<double>();
}

// HF accepts one number (broadcast to the channels) or one per channel.
void read_triple(const nlohmann::json& j, const char* key, std::array<double, 3>* out,
                 const std::string& what) {
  auto it = j.find(key);
  if (it == j.end()) return;
  if (it->is_number()) {
    out->fill(it->get<double>());
    return;
  }
  if (!it->is_array() || it->size() != 3)
    fail(what, ": field \"", key, "\" must be a number or an array of 3 numbers, found ",
         it->dump());
  for (size_t c = 0; c < 3; ++c) {
    if (!(*it)[c].is_number())
      fail(what, ": field \"", key, "\"[", c, "] must be a number, found ", (*it)[c].dump());
    (*out)[c] = (*it)[c].get<double>();
  }
}

}  // namespace

void ImageProcessorConfig::validate(const std::string& what) const {
  bool supported = false;
  for (int s : kSupportedSoftTokens) supported |= s == max_soft_tokens;
  if (!supported)
    fail(what, ": max_soft_tokens = ", max_soft_tokens,
         " is not supported; Gemma 4 allows 70, 140, 280, 560 or 1120");
  if (patch_size < 1 || patch_size > 1024)
    fail(what, ": patch_size = ", patch_size, " must be in 1..1024");
  if (pooling_kernel_size < 1 || pooling_kernel_size > 64)
    fail(what, ": pooling_kernel_size = ", pooling_kernel_size, " must be in 1..64");
  if (resample != 3)
    fail(what, ": resample = ", resample,
         " is not implemented; only 3 (PIL BICUBIC, the Gemma 4 default) is supported");
  if (do_rescale && !(std::isfinite(rescale_factor) && rescale_factor > 0.0))
    fail(what, ": rescale_factor = ", rescale_factor, " must be a positive finite number");
  if (do_normalize) {
    for (int c = 0; c < 3; ++c) {
      if (!std::isfinite(image_mean[c]))
        fail(what, ": image_mean[", c, "] = ", image_mean[c], " is not finite");
      if (!std::isfinite(image_std[c]) || image_std[c] == 0.0)
        fail(what, ": image_std[", c, "] = ", image_std[c], " must be finite and non-zero");
    }
  }
}

ImageProcessorConfig ImageProcessorConfig::from_json(const nlohmann::json& root,
                                                     const std::string& what) {
  const nlohmann::json* j = &root;
  if (root.is_object() && root.contains("image_processor") && root["image_processor"].is_object())
    j = &root["image_processor"];
  if (!j->is_object()) fail(what, ": expected a JSON object, found ", json_type(*j));
  ImageProcessorConfig c;
  read_int(*j, "patch_size", &c.patch_size, what);
  read_int(*j, "max_soft_tokens", &c.max_soft_tokens, what);
  read_int(*j, "pooling_kernel_size", &c.pooling_kernel_size, what);
  read_bool(*j, "do_resize", &c.do_resize, what);
  read_int(*j, "resample", &c.resample, what);
  read_bool(*j, "do_rescale", &c.do_rescale, what);
  read_double(*j, "rescale_factor", &c.rescale_factor, what);
  read_bool(*j, "do_normalize", &c.do_normalize, what);
  read_triple(*j, "image_mean", &c.image_mean, what);
  read_triple(*j, "image_std", &c.image_std, what);
  read_bool(*j, "do_convert_rgb", &c.do_convert_rgb, what);
  c.validate(what);
  return c;
}

ImageProcessorConfig ImageProcessorConfig::from_json_file(const std::string& path) {
  const std::string text = read_text_file(path, size_t{16} << 20);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  return from_json(j, path);
}

ResizeTarget aspect_ratio_preserving_size(int64_t height, int64_t width, int patch_size,
                                          int max_patches, int pooling_kernel_size) {
  if (height < 1 || width < 1)
    fail("image resize: image is ", height, "x", width, "; both sides must be at least 1");
  // Same double operations as the Python: true division, sqrt, multiply, floor.
  const double total_px = static_cast<double>(height) * static_cast<double>(width);
  const int64_t target_px = int64_t{max_patches} * patch_size * patch_size;
  const double factor = std::sqrt(static_cast<double>(target_px) / total_px);
  const double ideal_h = factor * static_cast<double>(height);
  const double ideal_w = factor * static_cast<double>(width);
  const int64_t side = int64_t{pooling_kernel_size} * patch_size;
  int64_t th = static_cast<int64_t>(std::floor(ideal_h / static_cast<double>(side))) * side;
  int64_t tw = static_cast<int64_t>(std::floor(ideal_w / static_cast<double>(side))) * side;
  if (th == 0 && tw == 0)
    fail("image resize: a ", height, "x", width,
         " image would be resized to 0x0; sides must be multiples of pooling_kernel_size * "
         "patch_size = ",
         side);
  const int64_t max_side =
      (max_patches / (int64_t{pooling_kernel_size} * pooling_kernel_size)) * side;
  // A very thin image: keep one block on the short side and as many as the aspect ratio (capped
  // by the budget) on the long one.
  if (th == 0) {
    th = side;
    tw = std::min(
        static_cast<int64_t>(std::floor(static_cast<double>(width) / static_cast<double>(height))) *
            side,
        max_side);
  } else if (tw == 0) {
    tw = side;
    th = std::min(
        static_cast<int64_t>(std::floor(static_cast<double>(height) / static_cast<double>(width))) *
            side,
        max_side);
  }
  if (th * tw > target_px)
    fail("image resize: resizing ", height, "x", width, " to ", th, "x", tw, " exceeds ",
         max_patches, " patches of ", patch_size, "x", patch_size);
  return {static_cast<int>(th), static_cast<int>(tw)};
}

ProcessedImage preprocess_image(const RgbImage& image, const ImageProcessorConfig& config) {
  config.validate("image processor config");
  if (image.width < 1 || image.height < 1 ||
      image.rgb.size() != size_t(image.width) * image.height * 3)
    fail("image preprocess: image is ", image.width, "x", image.height, " with ", image.rgb.size(),
         " bytes; expected a non-empty width*height*3 RGB buffer");
  const int p = config.patch_size;
  const int max_patches = config.max_patches();

  const RgbImage* src = &image;
  RgbImage resized;
  if (config.do_resize) {
    const ResizeTarget t = aspect_ratio_preserving_size(image.height, image.width, p, max_patches,
                                                        config.pooling_kernel_size);
    if (t.height != image.height || t.width != image.width) {
      resized = resize_bicubic_aa(image, t.width, t.height, config.backend);
      src = &resized;
    }
  }
  const int h = src->height, w = src->width;
  if (h % p != 0 || w % p != 0)
    fail("image preprocess: image is ", h, "x", w, ", not a multiple of patch_size ", p,
         "; enable do_resize or resize the image first");
  ProcessedImage out;
  out.resized_h = h;
  out.resized_w = w;
  out.patches_h = h / p;
  out.patches_w = w / p;
  out.num_patches = out.patches_h * out.patches_w;
  out.max_patches = max_patches;
  if (out.num_patches > max_patches)
    fail("image preprocess: ", h, "x", w, " gives ", out.num_patches,
         " patches, more than max_patches = ", max_patches, "; enable do_resize");
  const int k2 = config.pooling_kernel_size * config.pooling_kernel_size;
  out.num_soft_tokens = out.num_patches / k2;

  // Per-byte lookup table: the value of every uint8 after rescale/normalize, computed with the
  // backend's float arithmetic.
  //  torchvision: rescale only -> float32(x) * float32(r); with normalize it fuses the two into
  //    (float32(x) - float32(float32(mean) * float32(1/r))) / float32(float32(std) * float32(1/r)).
  //  PIL: rescale -> float32(double(x) * r); normalize -> (x - float32(mean)) / float32(std).
  std::array<std::array<float, 256>, 3> lut{};
  for (int c = 0; c < 3; ++c) {
    for (int v = 0; v < 256; ++v) {
      float x = static_cast<float>(v);
      if (config.backend == ResizeBackend::kTorchvision) {
        if (config.do_rescale && config.do_normalize) {
          const float inv = static_cast<float>(1.0 / config.rescale_factor);
          const float m = static_cast<float>(config.image_mean[c]) * inv;
          const float s = static_cast<float>(config.image_std[c]) * inv;
          x = (x - m) / s;
        } else if (config.do_rescale) {
          x = x * static_cast<float>(config.rescale_factor);
        } else if (config.do_normalize) {
          x = (x - static_cast<float>(config.image_mean[c])) /
              static_cast<float>(config.image_std[c]);
        }
      } else {
        if (config.do_rescale) x = static_cast<float>(double(v) * config.rescale_factor);
        if (config.do_normalize)
          x = (x - static_cast<float>(config.image_mean[c])) /
              static_cast<float>(config.image_std[c]);
      }
      lut[c][v] = x;
    }
  }

  const size_t dim = size_t(3) * p * p;
  out.pixel_values.assign(size_t(max_patches) * dim, 0.0f);
  out.position_ids.assign(size_t(max_patches) * 2, -1);
  const uint8_t* px = src->rgb.data();
  for (int py = 0; py < out.patches_h; ++py) {
    for (int pxi = 0; pxi < out.patches_w; ++pxi) {
      const size_t n = size_t(py) * out.patches_w + pxi;
      float* dst = &out.pixel_values[n * dim];
      // (C, Hp, p, Wp, p) permuted to (Hp, Wp, p, p, C): rows of the patch, then columns, then
      // channels.
      for (int dy = 0; dy < p; ++dy) {
        const uint8_t* row = px + (size_t(py * p + dy) * w + size_t(pxi) * p) * 3;
        for (int dx = 0; dx < p; ++dx)
          for (int c = 0; c < 3; ++c) *dst++ = lut[c][row[dx * 3 + c]];
      }
      out.position_ids[n * 2] = pxi;
      out.position_ids[n * 2 + 1] = py;
    }
  }
  return out;
}

ImageProcessorConfig load_processor_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  for (const char* name : {"preprocessor_config.json", "processor_config.json"}) {
    const fs::path p = fs::path(model_dir) / name;
    if (fs::exists(p)) return ImageProcessorConfig::from_json_file(p.string());
  }
  return ImageProcessorConfig{};
}

}  // namespace gemstage
