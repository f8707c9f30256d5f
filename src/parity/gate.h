// --gate expressions for `gemstage parity`: METRIC OP NUMBER, e.g. logits.max_abs<1e-4,
// teacher_forced>=0.95, per_layer_inputs.image.cos_min>=0.999. Metrics are read from the report.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace gemstage {

struct Gate {
  std::string text;    // as given
  std::string metric;  // e.g. per_layer_inputs.image.cos_min
  std::string op;      // < <= > >= ==
  double value = 0;
};

// Throws gemstage::Error with a usage hint on malformed expressions.
Gate parse_gate(const std::string& expr);

// Every gateable metric of a report, by name:
//   <tap>.max_abs|max_rel|cos|cos_min|cos_mean, <tap>.<text|image|special>.<stat>,
//   <tap>.layer<k>.<stat>, <tap>.layer<k>.<class>.<stat>, <id tap>.mismatches,
//   teacher_forced (agreement rate), teacher_forced.agree, teacher_forced_all,
//   image_gate.on, image_gate.off, image_gate.delta (rates), image_gate.delta_all,
//   first_divergence.found (0/1).
std::map<std::string, double> gate_metrics(const nlohmann::json& report);

struct GateResult {
  Gate gate;
  double actual = 0;
  bool pass = false;
};

// Throws for an unknown metric, listing the available ones.
std::vector<GateResult> evaluate_gates(const std::vector<Gate>& gates,
                                       const nlohmann::json& report);

}  // namespace gemstage
