#include "parity/reference.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/error.h"

namespace gemstage {

namespace fs = std::filesystem;

NpyArray ReferenceDump::load(const std::string& tap) const {
  auto it = taps.find(tap);
  if (it == taps.end()) fail(dir, ": the reference has no ", tap, ".npy");
  return load_npy(it->second);
}

std::optional<double> ReferenceDump::tolerance(const std::string& tap) const {
  auto it = atol.find(tap);
  if (it == atol.end()) return std::nullopt;
  return it->second;
}

std::optional<double> parse_atol(const std::string& text) {
  // The first word "atol" followed by optional spaces or '=' and a number ("atol 1e-2 (...)").
  for (size_t at = text.find("atol"); at != std::string::npos; at = text.find("atol", at + 1)) {
    if (at > 0 && (std::isalnum(static_cast<unsigned char>(text[at - 1])) || text[at - 1] == '_'))
      continue;
    size_t i = at + 4;
    while (i < text.size() && (text[i] == ' ' || text[i] == '=')) ++i;
    if (i == at + 4 || i >= text.size()) continue;
    const char* begin = text.c_str() + i;
    char* end = nullptr;
    const double v = std::strtod(begin, &end);
    if (end != begin && std::isfinite(v) && v >= 0) return v;
  }
  return std::nullopt;
}

namespace {

std::vector<std::string> split_names(const std::string& key) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : key + ",") {
    if (c == ',' || c == ' ' || c == '/' || c == '(' || c == ')') {
      if (!cur.empty()) out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  return out;
}

// "../multimodal/pixel_values.npy (same image ...)" -> the path, relative to dir.
std::string path_field(const std::string& dir, const std::string& v) {
  const std::string first = v.substr(0, v.find(' '));
  if (first.empty()) return "";
  const fs::path p = fs::path(first).is_absolute() ? fs::path(first) : fs::path(dir) / first;
  return fs::exists(p) ? p.lexically_normal().string() : "";
}

}  // namespace

ReferenceDump load_reference(const std::string& dir) {
  ReferenceDump r;
  r.dir = dir;
  const fs::path mpath = fs::path(dir) / "manifest.json";
  std::ifstream in(mpath);
  if (!in)
    fail(mpath.string(),
         ": cannot open the reference manifest (a reference dir holds manifest.json plus one .npy "
         "per tap; scripts/hf_dump.py writes one)");
  try {
    r.manifest = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(mpath.string(), ": not valid JSON: ", e.what());
  }
  const auto& m = r.manifest;
  if (!m.is_object()) fail(mpath.string(), ": expected a JSON object");
  if (!m.contains("files") || !m["files"].is_object())
    fail(mpath.string(), ": missing the \"files\" object (file name -> {shape, dtype, meaning})");
  for (const auto& [name, entry] : m["files"].items()) {
    if (!entry.is_object() || !entry.contains("shape") || !entry["shape"].is_array())
      fail(mpath.string(), ": files.", name, " must be an object with a \"shape\" array");
    if (name.size() < 4 || name.substr(name.size() - 4) != ".npy") continue;
    const fs::path p = fs::path(dir) / name;
    if (!fs::exists(p)) continue;
    Shape want;
    for (const auto& d : entry["shape"]) {
      if (!d.is_number_integer())
        fail(mpath.string(), ": files.", name, ".shape holds a non-integer");
      want.push_back(d.get<int64_t>());
    }
    const NpyArray a = load_npy(p.string());
    if (a.shape != want)
      fail(p.string(), ": shape ", shape_str(a.shape), " but the manifest says ", shape_str(want));
    r.taps[name.substr(0, name.size() - 4)] = p.string();
  }
  // .npy files present but not listed are taps too (a hand-made dump may list only some).
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n.size() > 4 && n.substr(n.size() - 4) == ".npy" &&
        !r.taps.count(n.substr(0, n.size() - 4)))
      r.taps[n.substr(0, n.size() - 4)] = e.path().string();
  }
  if (!r.has("input_ids")) fail(dir, ": the reference has no input_ids.npy");

  if (m.contains("tolerances") && m["tolerances"].is_object())
    for (const auto& [key, v] : m["tolerances"].items()) {
      if (!v.is_string()) continue;
      const auto tol = parse_atol(v.get<std::string>());
      if (!tol) continue;
      for (const std::string& n : split_names(key)) r.atol[n] = *tol;
    }
  if (m.contains("tolerances_atol_computed") && m["tolerances_atol_computed"].is_object())
    for (const auto& [key, v] : m["tolerances_atol_computed"].items())
      if (v.is_number() && !r.atol.count(key)) r.atol[key] = v.get<double>();

  const nlohmann::json inputs = m.value("inputs", nlohmann::json::object());
  if (inputs.is_object()) {
    if (inputs.contains("num_patches") && inputs["num_patches"].is_number_integer())
      r.num_patches = inputs["num_patches"].get<int64_t>();
    if (inputs.contains("pixel_values") && inputs["pixel_values"].is_string())
      r.pixel_values = path_field(dir, inputs["pixel_values"].get<std::string>());
    if (inputs.contains("image_position_ids") && inputs["image_position_ids"].is_string())
      r.image_position_ids = path_field(dir, inputs["image_position_ids"].get<std::string>());
    if (inputs.contains("image") && inputs["image"].is_string())
      r.image_file = path_field(dir, inputs["image"].get<std::string>());
    for (const char* key : {"wav", "audio"})
      if (r.audio_file.empty() && inputs.contains(key) && inputs[key].is_string())
        r.audio_file = path_field(dir, inputs[key].get<std::string>());
  }
  if (r.has("pixel_values")) r.pixel_values = r.taps["pixel_values"];
  if (r.has("image_position_ids")) r.image_position_ids = r.taps["image_position_ids"];
  if (!r.pixel_values.empty() && r.image_position_ids.empty()) {
    const fs::path sib = fs::path(r.pixel_values).parent_path() / "image_position_ids.npy";
    if (fs::exists(sib)) r.image_position_ids = sib.string();
  }
  for (const char* n : {"image.png", "image.jpg", "image.jpeg"})
    if (r.image_file.empty() && fs::exists(fs::path(dir) / n))
      r.image_file = (fs::path(dir) / n).string();
  // The gemma4-tiny-unified fixtures name their clip audio.wav.
  if (r.audio_file.empty() && fs::exists(fs::path(dir) / "audio.wav"))
    r.audio_file = (fs::path(dir) / "audio.wav").string();
  return r;
}

}  // namespace gemstage
