// Reference tap dumps in the fixture layout: DIR/manifest.json (files with shapes and meanings,
// free-text tolerances, inputs) plus one .npy per tap. This is what `gemstage parity` consumes and
// what scripts/hf_dump.py writes.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "io/npy.h"

namespace gemstage {

struct ReferenceDump {
  std::string dir;
  nlohmann::json manifest;
  // Tap name (file name without .npy) -> path, for every listed or present .npy file.
  std::map<std::string, std::string> taps;
  // Per-tap absolute tolerance parsed from the manifest ("tolerances": "atol X" entries, then
  // "tolerances_atol_computed"); absent: no tolerance stated.
  std::map<std::string, double> atol;
  // Image sources, in the order the tool prefers them (empty when absent).
  std::string image_file;                        // image.png (or image.jpg)
  std::string audio_file;                        // the clip (manifest inputs.wav / inputs.audio)
  std::string pixel_values, image_position_ids;  // preprocessed arrays
  int64_t num_patches = -1;                      // inputs.num_patches (-1: not stated)

  bool has(const std::string& tap) const { return taps.count(tap) != 0; }
  NpyArray load(const std::string& tap) const;
  std::optional<double> tolerance(const std::string& tap) const;
};

// Throws (naming the file and field) when the manifest is missing or malformed: it must be a JSON
// object with a "files" object whose entries have a "shape" array; every listed .npy that exists
// must have that shape. Listed files may be missing (a dump need not hold every tap), but
// input_ids.npy is required.
ReferenceDump load_reference(const std::string& dir);

// Parses one "tolerances" value: the number after "atol" ("atol 1e-2 (...)" -> 0.01).
std::optional<double> parse_atol(const std::string& text);

}  // namespace gemstage
