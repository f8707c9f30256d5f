// How a model splits into stages: layer ranges over [0, L), the valid cut points (a KV-shared
// layer must sit in the same stage as its donor), and the stage contracts.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "gemma4/config.h"

namespace gemstage {

struct LayerRange {
  int begin = 0, end = 0;  // [begin, end)
  std::string str() const { return std::to_string(begin) + ":" + std::to_string(end); }
};

// Cut points c in (0, L) where splitting [0, c) | [c, L) keeps every shared layer with its donor.
std::vector<int> valid_cut_points(const TextConfig& t);

// The matrix parameters of one decoder layer (attention, MLP, experts, per-layer input): what
// balances stages by weight bytes.
double layer_parameters(const TextConfig& t, int layer);

// "0:21,21:42" (explicit ranges) or "N" (N stages at valid cuts balanced by weight bytes).
// Validates coverage of [0, L) exactly once and donor placement; errors name the layers and list
// the valid cuts.
std::vector<LayerRange> parse_stage_spec(const std::string& spec, const TextConfig& t);
void validate_stage_ranges(const std::vector<LayerRange>& ranges, const TextConfig& t);

}  // namespace gemstage
