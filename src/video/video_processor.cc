#include "video/video_processor.h"

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

namespace {

// Gemma4VideoProcessor's class attributes, in the JSON spelling, so that a config file
// overrides exactly the fields it names.
nlohmann::json default_video_fields() {
  return {{"patch_size", 16},
          {"max_soft_tokens", 70},
          {"pooling_kernel_size", 3},
          {"do_resize", true},
          {"resample", 3},
          {"do_rescale", true},
          {"rescale_factor", 1.0 / 255.0},
          {"do_normalize", true},
          {"image_mean", {0.0, 0.0, 0.0}},
          {"image_std", {1.0, 1.0, 1.0}},
          {"do_convert_rgb", true}};
}

constexpr int kMaxFrames = 1024;

// Python's float floor division and modulo by a positive divisor (CPython float_divmod).
double python_floordiv(double a, double b) {
  const double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0.0 && ((b < 0) != (mod < 0))) div -= 1.0;
  if (div == 0.0) return std::copysign(0.0, a / b);
  double floordiv = std::floor(div);
  if (div - floordiv > 0.5) floordiv += 1.0;
  return floordiv;
}

double python_mod(double a, double b) {
  double mod = std::fmod(a, b);
  if (mod != 0.0) {
    if ((b < 0) != (mod < 0)) mod += b;
  } else {
    mod = std::copysign(0.0, b);
  }
  return mod;
}

void two_digits(std::string& out, int64_t v) {
  if (v < 0) {
    out += '-';
    v = -v;
    // Python pads the sign into the width: f"{-5:02d}" is "-5".
    out += std::to_string(v);
    return;
  }
  if (v < 10) out += '0';
  out += std::to_string(v);
}

}  // namespace

ImageProcessorConfig VideoProcessorConfig::default_frame_config() {
  return ImageProcessorConfig::from_json(default_video_fields(), "video processor defaults");
}

void VideoProcessorConfig::validate(const std::string& what) const {
  frame.validate(what);
  if (num_frames < 1 || num_frames > kMaxFrames)
    fail(what, ": num_frames = ", num_frames, " must be in 1..", kMaxFrames);
}

VideoProcessorConfig VideoProcessorConfig::from_json(const nlohmann::json& root,
                                                     const std::string& what) {
  const nlohmann::json* j = &root;
  if (root.is_object() && root.contains("video_processor") && root["video_processor"].is_object())
    j = &root["video_processor"];
  if (!j->is_object()) fail(what, ": expected a JSON object, found ", j->type_name());
  auto is_unset = [&](const char* key) {
    auto it = j->find(key);
    return it == j->end() || it->is_null();
  };
  auto bool_field = [&](const char* key, bool fallback) {
    auto it = j->find(key);
    if (it == j->end() || it->is_null()) return fallback;
    if (!it->is_boolean())
      fail(what, ": field \"", key, "\" must be true or false, found ", it->dump());
    return it->get<bool>();
  };
  if (!bool_field("do_sample_frames", true))
    fail(what,
         ": do_sample_frames = false (every frame of the clip) is not implemented; frames are "
         "sampled uniformly (num_frames)");
  if (!is_unset("fps"))
    fail(what, ": fps = ", (*j)["fps"].dump(),
         " (sampling by frame rate) is not implemented; use num_frames");
  if (bool_field("do_center_crop", false)) fail(what, ": do_center_crop is not implemented");
  if (bool_field("do_pad", false)) fail(what, ": do_pad is not implemented");
  nlohmann::json fields = default_video_fields();
  for (const char* key : {"patch_size", "max_soft_tokens", "pooling_kernel_size", "do_resize",
                          "resample", "do_rescale", "rescale_factor", "do_normalize", "image_mean",
                          "image_std", "do_convert_rgb"}) {
    auto it = j->find(key);
    if (it != j->end() && !it->is_null()) fields[key] = *it;
  }
  VideoProcessorConfig c;
  c.frame = ImageProcessorConfig::from_json(fields, what);
  auto it = j->find("num_frames");
  if (it != j->end() && !it->is_null()) {
    if (!it->is_number_integer())
      fail(what, ": field \"num_frames\" must be an integer, found ", it->dump());
    const int64_t n = it->get<int64_t>();
    if (n < 1 || n > kMaxFrames) fail(what, ": num_frames = ", n, " must be in 1..", kMaxFrames);
    c.num_frames = static_cast<int>(n);
  }
  c.validate(what);
  return c;
}

VideoProcessorConfig load_video_processor_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  for (const char* name : {"video_preprocessor_config.json", "processor_config.json"}) {
    const fs::path p = fs::path(model_dir) / name;
    if (!fs::exists(p)) continue;
    const std::string text = read_text_file(p.string(), size_t{16} << 20);
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      fail(p.string(), ": not valid JSON (", e.what(), ")");
    }
    if (std::string(name) == "processor_config.json" &&
        !(j.is_object() && j.contains("video_processor")))
      continue;
    return VideoProcessorConfig::from_json(j, p.string());
  }
  return VideoProcessorConfig{};
}

std::vector<int64_t> uniform_frame_indices(int64_t total_frames, int64_t num_frames) {
  if (total_frames < 1) fail("video sampling: the clip has ", total_frames, " frames");
  if (num_frames < 1) fail("video sampling: num_frames = ", num_frames, " must be at least 1");
  num_frames = std::min(num_frames, total_frames);
  // torch.arange(0, total, step): length ceil((end - start) / step) in double; element i is
  // start + i * step in double (the CPU kernel's accumulate type), stored as float32; .int()
  // truncates toward zero.
  const double step = static_cast<double>(total_frames) / static_cast<double>(num_frames);
  const auto count = static_cast<int64_t>(std::ceil(static_cast<double>(total_frames) / step));
  std::vector<int64_t> indices;
  indices.reserve(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const auto v = static_cast<int64_t>(static_cast<float>(static_cast<double>(i) * step));
    // When total / step rounds above num_frames (15 frames, 13 asked), the extra element is
    // num_frames * step, which float32 rounds to `total`: an index past the last frame, on which
    // transformers fails. It is dropped.
    if (v < total_frames) indices.push_back(v);
  }
  return indices;
}

std::string format_timestamp(double seconds) {
  if (!std::isfinite(seconds)) fail("video timestamp: ", seconds, " seconds is not finite");
  std::string out;
  two_digits(out, static_cast<int64_t>(python_floordiv(seconds, 60.0)));
  out += ':';
  two_digits(out, static_cast<int64_t>(python_mod(seconds, 60.0)));
  return out;
}

std::string ProcessedVideo::prompt_text(const std::string& image_open,
                                        const std::string& video_soft,
                                        const std::string& image_close) const {
  std::string out;
  for (int f = 0; f < num_frames; ++f) {
    if (f) out += ' ';
    out += format_timestamp(timestamps[static_cast<size_t>(f)]);
    out += ' ';
    out += image_open;
    for (int k = 0; k < num_soft_tokens_per_frame; ++k) out += video_soft;
    out += image_close;
  }
  return out;
}

namespace {

void start_output(ProcessedVideo& out, const std::vector<int64_t>& indices, double fps,
                  const VideoProcessorConfig& config) {
  config.validate("video processor config");
  // transformers' replace_video_token: "Defaulting to fps=24" when the fps is unknown.
  out.fps = fps > 0.0 && std::isfinite(fps) ? fps : 24.0;
  out.frame_indices = indices;
  out.timestamps.clear();
  for (int64_t i : indices) out.timestamps.push_back(static_cast<double>(i) / out.fps);
  out.num_frames = static_cast<int>(indices.size());
  out.max_patches = config.frame.max_patches();
  out.patch_dim = 3 * config.frame.patch_size * config.frame.patch_size;
  out.pixel_values.assign(
      static_cast<size_t>(out.num_frames) * out.max_patches * static_cast<size_t>(out.patch_dim),
      0.0f);
  out.position_ids.assign(static_cast<size_t>(out.num_frames) * out.max_patches * 2, -1);
}

void add_frame(ProcessedVideo& out, size_t k, const RgbImage& rgb,
               const VideoProcessorConfig& config) {
  const ProcessedImage pi = preprocess_image(rgb, config.frame);
  if (k == 0) {
    out.num_soft_tokens_per_frame = pi.num_soft_tokens;
    out.patches_h = pi.patches_h;
    out.patches_w = pi.patches_w;
    out.resized_h = pi.resized_h;
    out.resized_w = pi.resized_w;
  } else if (pi.num_soft_tokens != out.num_soft_tokens_per_frame) {
    fail("video frame ", k, " gives ", pi.num_soft_tokens, " soft tokens but frame 0 gave ",
         out.num_soft_tokens_per_frame, "; every frame must have the same size");
  }
  const size_t pixels = static_cast<size_t>(out.max_patches) * out.patch_dim;
  std::copy(pi.pixel_values.begin(), pi.pixel_values.end(),
            out.pixel_values.begin() + static_cast<ptrdiff_t>(k * pixels));
  std::copy(pi.position_ids.begin(), pi.position_ids.end(),
            out.position_ids.begin() + static_cast<ptrdiff_t>(k * out.max_patches * 2));
}

}  // namespace

ProcessedVideo process_video(VideoDecoder& decoder, const VideoProcessorConfig& config,
                             VideoDecodeStats* stats) {
  ProcessedVideo out;
  out.info = decoder.info();
  const std::vector<int64_t> indices =
      uniform_frame_indices(out.info.total_frames, config.num_frames);
  start_output(out, indices, out.info.fps, config);
  const VideoDecodeStats s = decoder.decode_frames(
      indices, [&](size_t k, const RgbImage& rgb) { add_frame(out, k, rgb, config); });
  if (stats) *stats = s;
  return out;
}

ProcessedVideo process_video_file(const std::string& path, const VideoProcessorConfig& config,
                                  const VideoLimits& limits) {
  auto decoder = VideoDecoder::open_file(path, limits);
  return process_video(*decoder, config);
}

ProcessedVideo process_video_frames(const std::vector<RgbImage>& frames,
                                    const std::vector<int64_t>& frame_indices, double fps,
                                    const VideoProcessorConfig& config) {
  if (frames.empty() || frames.size() != frame_indices.size())
    fail("video frames: ", frames.size(), " frames for ", frame_indices.size(),
         " indices; need the same non-zero number");
  ProcessedVideo out;
  start_output(out, frame_indices, fps, config);
  for (size_t k = 0; k < frames.size(); ++k) add_frame(out, k, frames[k], config);
  return out;
}

int64_t max_video_prompt_tokens(const VideoProcessorConfig& config) {
  constexpr int64_t kMarkersAndTimestamp = 2 + 8;
  return int64_t{config.num_frames} * (config.frame.max_soft_tokens + kMarkersAndTimestamp);
}

}  // namespace gemstage
