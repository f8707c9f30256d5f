#include "parity/gate.h"

#include <cctype>
#include <cstdlib>

#include "core/error.h"

namespace gemstage {

using nlohmann::json;

namespace {
const char* kUsage =
    "expected METRIC OP NUMBER with OP one of < <= > >= ==, e.g. logits.max_abs<1e-4, "
    "teacher_forced>=0.95, per_layer_inputs.image.cos_min>=0.999";

bool metric_char(char c) {
  return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.';
}
}  // namespace

Gate parse_gate(const std::string& expr) {
  Gate g;
  g.text = expr;
  size_t i = 0;
  auto skip_ws = [&] {
    while (i < expr.size() && std::isspace(static_cast<unsigned char>(expr[i]))) ++i;
  };
  skip_ws();
  const size_t m0 = i;
  while (i < expr.size() && metric_char(expr[i])) ++i;
  g.metric = expr.substr(m0, i - m0);
  if (g.metric.empty()) fail("bad --gate '", expr, "': no metric name; ", kUsage);
  if (g.metric.front() == '.' || g.metric.back() == '.' || g.metric.find("..") != std::string::npos)
    fail("bad --gate '", expr, "': malformed metric name '", g.metric, "'; ", kUsage);
  skip_ws();
  static const std::string kOps[] = {"<=", ">=", "==", "<", ">"};
  for (const std::string& op : kOps)
    if (expr.compare(i, op.size(), op) == 0) {
      g.op = op;
      i += op.size();
      break;
    }
  if (g.op.empty())
    fail("bad --gate '", expr, "': no comparison operator after '", g.metric, "'; ", kUsage);
  skip_ws();
  const std::string num = expr.substr(i);
  if (num.empty()) fail("bad --gate '", expr, "': no threshold after '", g.op, "'; ", kUsage);
  char* end = nullptr;
  g.value = std::strtod(num.c_str(), &end);
  while (end && *end && std::isspace(static_cast<unsigned char>(*end))) ++end;
  if (end == num.c_str() || (end && *end))
    fail("bad --gate '", expr, "': threshold '", num, "' is not a number; ", kUsage);
  return g;
}

std::map<std::string, double> gate_metrics(const json& r) {
  std::map<std::string, double> m;
  auto stats = [&](const std::string& prefix, const json& s) {
    for (const char* k : {"max_abs", "max_rel", "cos", "cos_min", "cos_mean"})
      if (s.contains(k) && s[k].is_number()) m[prefix + "." + k] = s[k].get<double>();
  };
  if (r.contains("taps"))
    for (const auto& [name, t] : r["taps"].items()) {
      if (t.contains("error")) continue;
      if (t.value("kind", "") == "ids") {
        m[name + ".mismatches"] = t["mismatches"].get<double>();
        continue;
      }
      stats(name, t);
      if (t.contains("classes"))
        for (const auto& [c, s] : t["classes"].items()) stats(name + "." + c, s);
      if (t.contains("layers"))
        for (const json& l : t["layers"]) {
          const std::string p = name + ".layer" + std::to_string(l["layer"].get<int64_t>());
          stats(p, l);
          if (l.contains("classes"))
            for (const auto& [c, s] : l["classes"].items()) stats(p + "." + c, s);
        }
    }
  if (r.contains("teacher_forced") && r["teacher_forced"].is_object()) {
    const json& tf = r["teacher_forced"];
    m["teacher_forced"] = tf["rate"].get<double>();
    m["teacher_forced.agree"] = tf["agree"].get<double>();
    m["teacher_forced.steps"] = tf["steps"].get<double>();
    if (tf.contains("prompt_and_steps"))
      m["teacher_forced_all"] = tf["prompt_and_steps"]["rate"].get<double>();
  }
  if (r.contains("image_gate") && r["image_gate"].is_object()) {
    const json& g = r["image_gate"];
    m["image_gate.on"] = g["on"]["rate"].get<double>();
    m["image_gate.off"] = g["off"]["rate"].get<double>();
    m["image_gate.delta"] = g["delta"].get<double>();
    if (g.contains("delta_all")) m["image_gate.delta_all"] = g["delta_all"].get<double>();
    m["image_gate.step_logits_change"] = g["step_logits_change_max_abs"].get<double>();
  }
  if (r.contains("audio_gate") && r["audio_gate"].is_object()) {
    const json& g = r["audio_gate"];
    m["audio_gate.on"] = g["on"]["rate"].get<double>();
    m["audio_gate.off"] = g["off"]["rate"].get<double>();
    m["audio_gate.delta"] = g["delta"].get<double>();
    m["audio_gate.step_logits_change"] = g["step_logits_change_max_abs"].get<double>();
  }
  if (r.contains("first_divergence"))
    m["first_divergence.found"] = r["first_divergence"].value("found", false) ? 1.0 : 0.0;
  return m;
}

std::vector<GateResult> evaluate_gates(const std::vector<Gate>& gates, const json& report) {
  const std::map<std::string, double> m = gate_metrics(report);
  std::vector<GateResult> out;
  for (const Gate& g : gates) {
    auto it = m.find(g.metric);
    if (it == m.end()) {
      std::string list;
      for (const auto& [k, v] : m)
        if (k.find(".layer") == std::string::npos) list += "\n  " + k;
      fail("unknown gate metric '", g.metric, "' in --gate '", g.text,
           "'; available metrics for this run:", list,
           "\n  (and <tap>.layer<k>.<stat> / <tap>.layer<k>.<class>.<stat> for per-layer taps)");
    }
    GateResult res{g, it->second, false};
    const double a = it->second, v = g.value;
    if (g.op == "<") res.pass = a < v;
    if (g.op == "<=") res.pass = a <= v;
    if (g.op == ">") res.pass = a > v;
    if (g.op == ">=") res.pass = a >= v;
    if (g.op == "==") res.pass = a == v;
    out.push_back(res);
  }
  return out;
}

}  // namespace gemstage
