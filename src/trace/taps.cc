#include "trace/taps.h"

#include <filesystem>

#include "core/error.h"
#include "io/npy.h"

namespace gemstage {

const std::vector<std::string>& known_tap_names() {
  static const std::vector<std::string> k = {"input_ids",
                                             "llm_input_ids",
                                             "ple_ids",
                                             "image_splice_mask",
                                             "embeds_scaled",
                                             "inputs_embeds",
                                             "ple_token_embeds",
                                             "per_layer_inputs",
                                             "hidden_after_attn",
                                             "hidden_after_mlp",
                                             "hidden_states",
                                             "final_hidden",
                                             "logits",
                                             "decode_ids",
                                             "decode_logits",
                                             "sequence_ids",
                                             "decode_top2_margin",
                                             "spec_new_ids",
                                             "spec_round_positions",
                                             "spec_round_input_tokens",
                                             "spec_round_num_drafts",
                                             "spec_round_accepted",
                                             "spec_round_drafts",
                                             "spec_round_target_ids",
                                             "pixel_values",
                                             "image_position_ids",
                                             "vision_patch_embeds",
                                             "vision_encoder_out",
                                             "vision_pooled",
                                             "vision_embedder_out",
                                             "pixel_values_videos",
                                             "video_position_ids",
                                             "video_soft_tokens",
                                             "router_probs",
                                             "router_topk_ids",
                                             "router_topk_weights",
                                             "audio_waveform",
                                             "audio_features",
                                             "audio_features_mask",
                                             "audio_subsample_out",
                                             "audio_subsample_mask",
                                             "audio_layer_out",
                                             "audio_encoder_out",
                                             "audio_tower_out",
                                             "audio_embedder_out",
                                             "audio_splice_mask"};
  return k;
}

TapRecorder::TapRecorder(const std::vector<std::string>& names) {
  for (const auto& n : names) {
    if (n == "all") {
      all_ = true;
      continue;
    }
    bool ok = false;
    for (const auto& k : known_tap_names()) ok = ok || k == n;
    if (!ok) {
      std::string list;
      for (const auto& k : known_tap_names()) list += " " + k;
      fail("unknown tap '", n, "'; known taps: all", list);
    }
    names_.insert(n);
  }
}

TapRecorder::Tap& TapRecorder::tap(const std::string& name, const Shape& row_shape,
                                   int num_layers) {
  auto [it, inserted] = taps_.try_emplace(name);
  Tap& t = it->second;
  if (inserted) {
    t.row_shape = row_shape;
    t.num_layers = num_layers;
    t.parts.resize(static_cast<size_t>(std::max(1, num_layers)));
  } else if (t.row_shape != row_shape) {
    fail("tap ", name, ": row shape changed from ", shape_str(t.row_shape), " to ",
         shape_str(row_shape));
  }
  return t;
}

void TapRecorder::append(const std::string& name, const Shape& row_shape, const float* data,
                         int64_t rows) {
  if (!wants(name)) return;
  Tap& t = tap(name, row_shape, 0);
  t.parts[0].insert(t.parts[0].end(), data, data + rows * shape_numel(row_shape));
}

void TapRecorder::append_ids(const std::string& name, const std::vector<int64_t>& ids) {
  append_ids(name, ids, {});
}

void TapRecorder::append_ids(const std::string& name, const std::vector<int64_t>& ids,
                             const Shape& row_shape) {
  if (!wants(name)) return;
  const int64_t row = shape_numel(row_shape);
  if (row <= 0 || static_cast<int64_t>(ids.size()) % row != 0)
    fail("tap ", name, ": ", ids.size(), " ids do not fill rows of shape ", shape_str(row_shape));
  Tap& t = tap(name, row_shape, 0);
  t.is_ids = true;
  t.ids.insert(t.ids.end(), ids.begin(), ids.end());
}

void TapRecorder::append_layer(const std::string& name, int layer, int num_layers,
                               const Shape& row_shape, const float* data, int64_t rows) {
  if (!wants(name)) return;
  Tap& t = tap(name, row_shape, num_layers);
  auto& p = t.parts.at(static_cast<size_t>(layer));
  p.insert(p.end(), data, data + rows * shape_numel(row_shape));
}

void TapRecorder::append_layer_ids(const std::string& name, int layer, int num_layers,
                                   const Shape& row_shape, const int64_t* ids, int64_t rows) {
  if (!wants(name)) return;
  Tap& t = tap(name, row_shape, num_layers);
  t.is_ids = true;
  t.id_layers.resize(static_cast<size_t>(num_layers));
  auto& p = t.id_layers.at(static_cast<size_t>(layer));
  p.insert(p.end(), ids, ids + rows * shape_numel(row_shape));
}

template <typename T>
std::vector<T> TapRecorder::stack_layers(const std::string& name,
                                         const std::vector<std::vector<T>>& layers, int64_t& rows,
                                         int64_t row) {
  rows = row && !layers.empty() ? static_cast<int64_t>(layers[0].size()) / row : 0;
  std::vector<T> out;
  for (const auto& p : layers) {
    if (static_cast<int64_t>(p.size()) != rows * row)
      fail("tap ", name, ": layers have different lengths (a layer range was skipped?)");
    out.insert(out.end(), p.begin(), p.end());
  }
  return out;
}

std::vector<std::string> TapRecorder::recorded() const {
  std::vector<std::string> r;
  for (const auto& [k, v] : taps_) r.push_back(k);
  return r;
}

FloatTensor TapRecorder::get(const std::string& name) const {
  auto it = taps_.find(name);
  if (it == taps_.end()) fail("tap ", name, " was not recorded");
  const Tap& t = it->second;
  if (t.is_ids) fail("tap ", name, " holds ids");
  FloatTensor out;
  const int64_t row = shape_numel(t.row_shape);
  const int64_t rows = row ? static_cast<int64_t>(t.parts[0].size()) / row : 0;
  if (t.num_layers > 0) {
    int64_t n = 0;
    out.data = stack_layers(name, t.parts, n, row);
    out.shape = {t.num_layers, n};
  } else {
    out.shape = {rows};
    out.data = t.parts[0];
  }
  out.shape.insert(out.shape.end(), t.row_shape.begin(), t.row_shape.end());
  return out;
}

std::vector<int64_t> TapRecorder::get_ids(const std::string& name) const {
  auto it = taps_.find(name);
  if (it == taps_.end() || !it->second.is_ids) fail("id tap ", name, " was not recorded");
  const Tap& t = it->second;
  if (t.num_layers == 0) return t.ids;
  int64_t rows = 0;
  return stack_layers(name, t.id_layers, rows, shape_numel(t.row_shape));
}

void TapRecorder::write_dir(const std::string& dir) const {
  std::filesystem::create_directories(dir);
  for (const auto& [name, t] : taps_) {
    const std::string path = (std::filesystem::path(dir) / (name + ".npy")).string();
    if (t.is_ids && t.num_layers > 0) {
      int64_t rows = 0;
      const std::vector<int64_t> ids =
          stack_layers(name, t.id_layers, rows, shape_numel(t.row_shape));
      Shape shape = {t.num_layers, rows};
      shape.insert(shape.end(), t.row_shape.begin(), t.row_shape.end());
      save_npy_i64(path, shape, ids);
    } else if (t.is_ids) {
      Shape shape = {static_cast<int64_t>(t.ids.size()) / shape_numel(t.row_shape)};
      shape.insert(shape.end(), t.row_shape.begin(), t.row_shape.end());
      save_npy_i64(path, shape, t.ids);
    } else {
      const FloatTensor f = get(name);
      save_npy_f32(path, f.shape, f.data);
    }
  }
}

}  // namespace gemstage
