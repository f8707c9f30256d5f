// A self-contained SVG of a parity report: per-layer cosine (top) and max-abs (bottom, log
// scale) for hidden_states and per_layer_inputs, text rows vs image rows, with the tolerance and
// the first diverging layer marked. Hand-written SVG 1.1, no external assets or fonts.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace gemstage {

std::string render_parity_svg(const nlohmann::json& report);

}  // namespace gemstage
