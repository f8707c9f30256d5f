// Architecture presets with the real E2B / E4B / 26B-A4B / 31B dimensions, written as the hub's
// config.json so random checkpoints load through exactly the same path as real ones.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace gemstage {

// preset: "tiny" (the fixture's shape), "e2b", "e4b", "26b-a4b" (mixture of experts), "31b" or
// "12b" (gemma4_unified: no towers, image and audio embedders).
// num_layers > 0 shortens the text stack (keeping the sliding/full pattern and the share of
// KV-shared layers) for tests.
nlohmann::json preset_config(const std::string& preset, int num_layers = 0,
                             const std::string& dtype = "bfloat16");

// A gemma4_assistant (MTP drafter) config.json for a large target preset ("26b-a4b-assistant",
// "31b-assistant"): 4 layers [S, S, S, F] of width 1024 and MLP 4096, the target's attention
// heads, KV heads, head dims, sliding window and vocabulary (what the drafter must share with it),
// a tied head. The real drafters' widths are not published in the repository's docs; these are
// for speed measurements (bench -md) at the targets' real attention and vocabulary shapes.
nlohmann::json assistant_preset_config(const std::string& preset,
                                       const std::string& dtype = "bfloat16");
// True for the presets assistant_preset_config takes.
bool is_assistant_preset(const std::string& preset);

}  // namespace gemstage
