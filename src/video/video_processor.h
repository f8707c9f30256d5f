// Gemma 4 video preprocessing: a video file -> sampled frames -> pixel_values_videos
// [F, max_patches, 3*p*p] + video_position_ids [F, max_patches, 2], and the prompt text that
// replaces one <|video|> placeholder, matching transformers' Gemma4VideoProcessor (torchvision
// backend) and Gemma4Processor.replace_video_token. Revisions and the facts relied on:
// docs/video.md.
//
//  - Frame sampling (BaseVideoProcessor.sample_frames with num_frames):
//    indices = torch.arange(0, total, total / num_frames).int(), i.e. for i < ceil(total / step)
//    index_i = trunc(float32(i * step)), step = total / num_frames in double (the arange is
//    float32, the default dtype). transformers raises when num_frames > total; we sample every
//    frame instead (what it returns for num_frames = total). For some counts (13 of 15 frames)
//    the arange has one more element, equal to the frame count, on which transformers fails; we
//    drop it.
//  - Each frame is processed like an image (image/image_processor.h) with the video processor's
//    own defaults: max_soft_tokens 70 per frame (70/140/280/560/1120), the same
//    aspect-ratio-preserving size and bicubic antialiased resize, and do_rescale AND do_normalize
//    with mean 0 / std 1, which transformers fuses into (x - 0) / 255.0f (not x * (1/255) as the
//    image processor computes; the two differ in the last bit for some bytes).
//  - Prompt: each sampled frame becomes "MM:SS <|image>" + K x "<|video|>" + "<image|>", frames
//    joined by single spaces; MM:SS from index / fps, formatted as Python's
//    f"{int(s // 60):02d}:{int(s % 60):02d}" (minutes do not wrap into hours). An unknown fps
//    is taken as 24, as transformers does.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "image/image_processor.h"
#include "video/video_decode.h"

namespace gemstage {

struct VideoProcessorConfig {
  // Per-frame settings: patch_size 16, pooling_kernel_size 3, max_soft_tokens 70, resize,
  // rescale 1/255, normalize with mean 0 / std 1 (Gemma4VideoProcessor's class defaults).
  ImageProcessorConfig frame = default_frame_config();
  int num_frames = 32;  // frames sampled uniformly over the clip (do_sample_frames)

  static ImageProcessorConfig default_frame_config();
  // Throws with the field name when a value is out of range.
  void validate(const std::string& what) const;
  // Reads video_preprocessor_config.json (or processor_config.json's "video_processor"). Fields
  // we do not implement are refused when they ask for something else than the default:
  // do_sample_frames false, fps, do_center_crop, size.
  static VideoProcessorConfig from_json(const nlohmann::json& j, const std::string& what);
};

// video_preprocessor_config.json, else processor_config.json's "video_processor", else the
// Gemma4VideoProcessor defaults.
VideoProcessorConfig load_video_processor_config(const std::string& model_dir);

// The frame indices transformers samples (see above); num_frames is capped at total_frames.
std::vector<int64_t> uniform_frame_indices(int64_t total_frames, int64_t num_frames);

// "MM:SS" for a time in seconds, as Gemma4Processor formats it.
std::string format_timestamp(double seconds);

struct ProcessedVideo {
  VideoInfo info;
  double fps = 0.0;                    // for timestamps: info.fps, or 24 when unknown
  std::vector<int64_t> frame_indices;  // [F]
  std::vector<double> timestamps;      // [F] seconds = index / fps
  int num_frames = 0;                  // F
  int max_patches = 0;
  int patch_dim = 0;                  // 3 * p * p
  int num_soft_tokens_per_frame = 0;  // K: <|video|> tokens per frame
  int patches_h = 0, patches_w = 0;
  int resized_h = 0, resized_w = 0;
  std::vector<float> pixel_values;    // [F, max_patches, patch_dim]; 0 padding
  std::vector<int64_t> position_ids;  // [F, max_patches, 2] (x = column, y = row); -1 padding

  int64_t total_soft_tokens() const { return int64_t{num_frames} * num_soft_tokens_per_frame; }
  // The text that replaces one <|video|> in the rendered prompt; the three markers are passed in
  // as the tokenizer spells them.
  std::string prompt_text(const std::string& image_open, const std::string& video_soft,
                          const std::string& image_close) const;
};

// Samples, decodes and preprocesses the frames, one at a time (only one full-size RGB frame is
// alive at a time).
ProcessedVideo process_video(VideoDecoder& decoder, const VideoProcessorConfig& config,
                             VideoDecodeStats* stats = nullptr);
ProcessedVideo process_video_file(const std::string& path, const VideoProcessorConfig& config,
                                  const VideoLimits& limits = {});

// Preprocesses frames already decoded (tests, and frames from elsewhere): frame_indices and fps
// give the timestamps.
ProcessedVideo process_video_frames(const std::vector<RgbImage>& frames,
                                    const std::vector<int64_t>& frame_indices, double fps,
                                    const VideoProcessorConfig& config);

// Tokens one video adds to a prompt at most, before it is decoded: per frame at most the budget
// of soft tokens, the two markers, and the timestamp text (at most 8 tokens for "MMM:SS " and
// the joining space). Front ends check frames x this against the context.
int64_t max_video_prompt_tokens(const VideoProcessorConfig& config);

}  // namespace gemstage
