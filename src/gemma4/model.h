// A Gemma 4 checkpoint opened in place: config, memory-mapped tensors validated against the
// registry, and the text decoder (plus the vision tower, when configured) bound to them.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "gemma4/config.h"
#include "gemma4/text_model.h"
#include "gemma4/vision_model.h"
#include "io/safetensors.h"

namespace gemstage {

class Gemma4Model {
 public:
  static std::unique_ptr<Gemma4Model> open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  const ModelConfig& config() const { return config_; }
  const TensorStore& store() const { return store_; }
  const TextModel& text() const { return *text_; }
  // The vision tower + embed_vision, or null when the checkpoint has no vision_config.
  const VisionTower* vision() const { return vision_.get(); }
  // Config warnings and checkpoint tensors gemstage does not use, for the CLI to report.
  const std::vector<std::string>& notes() const { return notes_; }

 private:
  Gemma4Model() = default;

  std::string dir_;
  ModelConfig config_;
  TensorStore store_;
  std::unique_ptr<TextModel> text_;
  std::unique_ptr<VisionTower> vision_;
  std::vector<std::string> notes_;
};

}  // namespace gemstage
