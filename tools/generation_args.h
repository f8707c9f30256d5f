// The generation flags generate, chat and serve share (model, sampling, limits, context,
// threads), so all three spell and default them the same way.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/assistant.h"
#include "runtime/generation.h"

namespace gemstage::cli {

struct CommonArgs {
  std::string model;
  int max_tokens = 256;
  int threads = 0;
  int64_t ctx = 0;
  std::string cache_type = "auto";
  int64_t chunk = 512;
  float temperature = 1.0f, top_p = 0.95f, min_p = 0.0f, repeat_penalty = 1.0f;
  int top_k = 64, repeat_last_n = 64;
  uint64_t seed = 0;
  bool seed_given = false;
  std::vector<std::string> stop;
  bool think = false, verbose = false, ignore_eos = false;
};

void add_common(CLI::App* sub, CommonArgs& a);

// --video-frames / --video-budget: the sampling of --video files (docs/video.md); 0 keeps the
// model's video processor setting.
struct VideoArgs {
  int frames = 0;
  int budget = 0;
  // A --video FILE with these settings, for Assistant::load_video.
  VideoSource source(const std::string& path) const {
    return {path, nullptr, path, frames, budget};
  }
};
void add_video_options(CLI::App* sub, VideoArgs& a);

// max_tokens, sampling, stop strings and the prefill chunk from the flags. The seed is the given
// one or 0, and there are no stop ids: each caller decides those.
GenerationOptions generation_defaults(const CommonArgs& a);

// generate / chat: the defaults plus the model's stop ids (unless --ignore-eos) and the given
// seed or a fresh one for this run.
GenerationOptions generation_options(const CommonArgs& a, const Assistant& as);

}  // namespace gemstage::cli
