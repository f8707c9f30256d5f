#include "parity/parity.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "audio/audio_decode.h"
#include "audio/audio_features.h"
#include "core/error.h"
#include "gemma4/multimodal.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "image/unified_image.h"
#include "trace/taps.h"

namespace gemstage {

using nlohmann::json;

const char* row_class_name(RowClass c) {
  switch (c) {
    case RowClass::Text:
      return "text";
    case RowClass::Image:
      return "image";
    case RowClass::Special:
      return "special";
    case RowClass::Audio:
      return "audio";
  }
  return "?";
}

RowClass classify_token(const ModelConfig& c, int64_t id) {
  if (id == c.audio_token_id) return RowClass::Audio;
  for (int p : c.placeholder_token_ids())
    if (id == p) return RowClass::Image;
  const TextConfig& t = c.text;
  if (id == t.pad_token_id || id == t.bos_token_id || id == c.boi_token_id ||
      id == c.eoi_token_id || id == c.boa_token_id || id == c.eoa_token_id)
    return RowClass::Special;
  for (int e : t.eos_token_ids)
    if (id == e) return RowClass::Special;
  return RowClass::Text;
}

namespace {

constexpr RowClass kClasses[] = {RowClass::Text, RowClass::Image, RowClass::Audio,
                                 RowClass::Special};

// JSON has no infinity: a non-finite error is reported as the largest double.
double finite_or_max(double v) {
  return std::isfinite(v) ? v : std::numeric_limits<double>::max();
}

// Statistics of one selection of rows (ours vs reference).
struct Acc {
  double max_abs = 0, max_ref = 0, dot = 0, na = 0, nb = 0, cos_min = 1, cos_sum = 0;
  int64_t rows = 0, nonfinite = 0;

  void add(double row_max_abs, double row_max_ref, double d, double a2, double b2, double cos,
           int64_t bad) {
    max_abs = std::max(max_abs, row_max_abs);
    max_ref = std::max(max_ref, row_max_ref);
    dot += d;
    na += a2;
    nb += b2;
    cos_min = std::min(cos_min, cos);
    cos_sum += cos;
    nonfinite += bad;
    ++rows;
  }
  double cos() const {
    if (na == 0 && nb == 0) return 1.0;
    if (na == 0 || nb == 0) return 0.0;
    return dot / std::sqrt(na * nb);
  }
  json to_json() const {
    json j;
    j["rows"] = rows;
    j["max_abs"] = finite_or_max(max_abs);
    // Max-abs relative to the largest reference magnitude in the selection.
    j["max_rel"] = finite_or_max(max_ref > 0 ? max_abs / max_ref : (max_abs > 0 ? max_abs : 0.0));
    j["cos"] = rows ? cos() : 1.0;
    j["cos_min"] = rows ? cos_min : 1.0;
    j["cos_mean"] = rows ? cos_sum / static_cast<double>(rows) : 1.0;
    if (nonfinite) j["nonfinite"] = nonfinite;
    return j;
  }
};

struct RowStat {
  double max_abs = 0, max_ref = 0, dot = 0, a2 = 0, b2 = 0, cos = 1;
  int64_t bad = 0;
};

RowStat row_stat(const float* a, const float* b, int64_t w) {
  RowStat r;
  for (int64_t i = 0; i < w; ++i) {
    const double x = a[i], y = b[i];
    if (!std::isfinite(x) || !std::isfinite(y)) {
      ++r.bad;
      r.max_abs = std::numeric_limits<double>::infinity();
      continue;
    }
    r.max_abs = std::max(r.max_abs, std::fabs(x - y));
    r.max_ref = std::max(r.max_ref, std::fabs(y));
    r.dot += x * y;
    r.a2 += x * x;
    r.b2 += y * y;
  }
  if (r.a2 == 0 && r.b2 == 0)
    r.cos = 1.0;
  else if (r.a2 == 0 || r.b2 == 0)
    r.cos = 0.0;
  else
    r.cos = r.dot / std::sqrt(r.a2 * r.b2);
  if (r.bad) r.cos = 0.0;
  return r;
}

Shape squeeze_leading(Shape s) {
  while (s.size() > 1 && s.front() == 1) s.erase(s.begin());
  return s;
}

bool is_layered(const std::string& n) {
  return n == "hidden_after_attn" || n == "hidden_after_mlp" || n == "hidden_states" ||
         n == "router_probs" || n == "router_topk_weights";
}
bool is_per_layer_slice(const std::string& n) {
  return n == "per_layer_inputs" || n == "ple_token_embeds";
}
bool is_patch_tap(const std::string& n) {
  return n == "vision_patch_embeds" || n == "vision_encoder_out";
}
// Audio tower taps whose rows are encoder rows; only the valid ones are compared (manifest).
bool is_audio_row_tap(const std::string& n) {
  return n == "audio_subsample_out" || n == "audio_encoder_out" || n == "audio_tower_out";
}

// Compares one float tap. token_class: class per prompt row (for taps whose rows are prompt rows);
// patch_valid: the real (non-padding) patch rows of vision patch taps; audio_valid: the valid
// encoder rows of audio tower taps.
json compare_float_tap(const std::string& name, const FloatTensor& ours, const NpyArray& ref_npy,
                       std::optional<double> tol, const std::vector<RowClass>& token_class,
                       const std::vector<uint8_t>& patch_valid,
                       const std::vector<uint8_t>& audio_valid) {
  json j;
  const Shape rs = squeeze_leading(ref_npy.shape), os = squeeze_leading(ours.shape);
  j["shape"] = ref_npy.shape;
  j["tolerance"] = tol ? json(*tol) : json(nullptr);
  if (rs != os) {
    j["error"] =
        "shape mismatch: ours " + shape_str(ours.shape) + ", reference " + shape_str(ref_npy.shape);
    j["pass"] = false;
    return j;
  }
  const std::vector<float> ref = ref_npy.to_f32();
  const int64_t S_prompt = static_cast<int64_t>(token_class.size());
  int64_t nL = 1, nS = rs.empty() ? 1 : rs[0];
  std::string kind = "sequence";
  if (is_layered(name) && rs.size() >= 2) {
    kind = "layered";
    nL = rs[0];
    nS = rs[1];
  } else if (is_per_layer_slice(name) && rs.size() >= 2) {
    kind = "per_layer";
    nS = rs[0];
    nL = rs[1];
  } else if (is_patch_tap(name)) {
    kind = "vision_patches";
  } else if (name.rfind("vision_", 0) == 0 || name == "pixel_values") {
    kind = "vision";
  } else if (name == "audio_layer_out" && rs.size() >= 2) {
    kind = "audio_rows";
    nL = rs[0];
    nS = rs[1];
  } else if (is_audio_row_tap(name)) {
    kind = "audio_rows";
  } else if (name.rfind("audio_", 0) == 0) {
    kind = "audio";
  }
  const int64_t total = shape_numel(rs);
  const int64_t W = nL * nS != 0 ? total / (nL * nS) : 0;
  const bool by_token = nS == S_prompt && kind != "vision" && kind != "vision_patches" &&
                        kind.rfind("audio", 0) != 0 && name.rfind("decode_", 0) != 0;
  const bool by_layer = kind == "layered" || kind == "per_layer";
  const bool mask_patches =
      (kind == "vision_patches" && static_cast<int64_t>(patch_valid.size()) == nS) ||
      (kind == "audio_rows" && static_cast<int64_t>(audio_valid.size()) == nS);
  const std::vector<uint8_t>& row_valid = kind == "audio_rows" ? audio_valid : patch_valid;
  j["kind"] = kind;

  Acc all;
  std::vector<Acc> layers(static_cast<size_t>(by_layer ? nL : 0));
  std::map<RowClass, Acc> classes;
  std::vector<std::map<RowClass, Acc>> layer_classes(layers.size());
  int64_t skipped = 0;
  for (int64_t l = 0; l < nL; ++l)
    for (int64_t s = 0; s < nS; ++s) {
      if (mask_patches && !row_valid[static_cast<size_t>(s)]) {
        if (l == 0) ++skipped;
        continue;
      }
      const int64_t off = kind == "per_layer" ? (s * nL + l) * W : (l * nS + s) * W;
      const RowStat r = row_stat(ours.data.data() + off, ref.data() + off, W);
      auto add = [&](Acc& a) { a.add(r.max_abs, r.max_ref, r.dot, r.a2, r.b2, r.cos, r.bad); };
      add(all);
      if (by_layer) add(layers[static_cast<size_t>(l)]);
      if (by_token) {
        const RowClass c = token_class[static_cast<size_t>(s)];
        add(classes[c]);
        if (by_layer) add(layer_classes[static_cast<size_t>(l)][c]);
      }
    }
  const json a = all.to_json();
  for (auto it = a.begin(); it != a.end(); ++it) j[it.key()] = it.value();
  if (mask_patches) j["padding_rows_skipped"] = skipped;
  if (by_token) {
    json cj = json::object();
    for (RowClass c : kClasses)
      if (classes.count(c)) cj[row_class_name(c)] = classes[c].to_json();
    j["classes"] = cj;
  }
  if (by_layer) {
    json lj = json::array();
    for (size_t l = 0; l < layers.size(); ++l) {
      json e = layers[l].to_json();
      e["layer"] = l;
      if (by_token) {
        json cj = json::object();
        for (RowClass c : kClasses)
          if (layer_classes[l].count(c)) cj[row_class_name(c)] = layer_classes[l][c].to_json();
        e["classes"] = cj;
      }
      lj.push_back(e);
    }
    j["layers"] = lj;
  }
  j["pass"] = tol ? json(all.max_abs <= *tol && all.nonfinite == 0) : json(nullptr);
  return j;
}

json compare_id_tap(const std::vector<int64_t>& ours, const NpyArray& ref_npy) {
  json j;
  j["kind"] = "ids";
  j["shape"] = ref_npy.shape;
  const std::vector<int64_t> ref = ref_npy.to_i64();
  if (ours.size() != ref.size()) {
    j["error"] = "length mismatch: ours " + std::to_string(ours.size()) + ", reference " +
                 std::to_string(ref.size());
    j["pass"] = false;
    return j;
  }
  int64_t mism = 0, first = -1;
  for (size_t i = 0; i < ref.size(); ++i)
    if (ours[i] != ref[i]) {
      if (first < 0) first = static_cast<int64_t>(i);
      ++mism;
    }
  j["count"] = ref.size();
  j["mismatches"] = mism;
  j["first_mismatch"] = first < 0 ? json(nullptr) : json(first);
  // Layered ids ([L, S, k]: the experts each row chose per layer): rows whose choice differs,
  // per layer.
  if (ref_npy.shape.size() == 3 && ref_npy.shape[0] > 0 && ref_npy.shape[1] > 0) {
    const int64_t nL = ref_npy.shape[0], nS = ref_npy.shape[1], k = ref_npy.shape[2];
    json lj = json::array();
    for (int64_t l = 0; l < nL; ++l) {
      int64_t rows = 0, first_row = -1;
      for (int64_t r = 0; r < nS; ++r)
        for (int64_t i = 0; i < k; ++i)
          if (ours[static_cast<size_t>((l * nS + r) * k + i)] !=
              ref[static_cast<size_t>((l * nS + r) * k + i)]) {
            ++rows;
            if (first_row < 0) first_row = r;
            break;
          }
      lj.push_back({{"layer", l},
                    {"rows_differing", rows},
                    {"first_row", first_row < 0 ? json(nullptr) : json(first_row)}});
    }
    j["layers"] = lj;
  }
  j["pass"] = mism == 0;
  return j;
}

int64_t argmax_first(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

// Top-1 agreement of our logit rows with the reference rows.
json agreement(const std::vector<float>& ours, const std::vector<float>& ref, int64_t rows,
               int64_t V, double tie_tol, int64_t keep_steps, const char* first_key) {
  int64_t agree = 0, ties = 0, first = -1;
  json steps = json::array();
  for (int64_t r = 0; r < rows; ++r) {
    const float* o = ours.data() + r * V;
    const float* f = ref.data() + r * V;
    const int64_t ot = argmax_first(o, V), rt = argmax_first(f, V);
    const bool exact = ot == rt;
    const bool ok = exact || static_cast<double>(f[ot]) >= static_cast<double>(f[rt]) - tie_tol;
    agree += ok;
    ties += ok && !exact;
    if (!ok && first < 0) first = r;
    if (r < keep_steps)
      steps.push_back({{"step", r},
                       {"ours", ot},
                       {"ref", rt},
                       {"agree", ok},
                       {"tie", ok && !exact},
                       {"ref_gap", static_cast<double>(f[rt]) - f[ot]}});
  }
  json j;
  j["steps"] = rows;
  j["agree"] = agree;
  j["ties"] = ties;
  j["rate"] = rows ? static_cast<double>(agree) / static_cast<double>(rows) : 1.0;
  j[first_key] = first < 0 ? json(nullptr) : json(first);
  if (keep_steps > 0) j["per_step"] = steps;
  return j;
}

struct ImageSet {
  std::vector<VisionInput> images, blanks;
  std::string source;
};

VisionInput blank_from_arrays(const VisionInput& in, int64_t patch_dim) {
  VisionInput b = in;
  // Mid-gray as the processor would emit it: float32(128) * float32(1/255) on real patches.
  const float gray = 128.0f * static_cast<float>(1.0 / 255.0);
  for (int64_t p = 0; p < in.max_patches; ++p) {
    const bool real = in.position_ids[static_cast<size_t>(2 * p)] >= 0;
    std::fill_n(b.pixel_values.begin() + p * patch_dim, patch_dim, real ? gray : 0.0f);
  }
  return b;
}

ImageSet load_images(const Sequence& model, const ReferenceDump& ref, const ParityOptions& opt) {
  ImageSet s;
  const VisionTower* vision = model.vision();
  std::vector<std::string> files = opt.images;
  if (files.empty() && !ref.image_file.empty()) files.push_back(ref.image_file);
  const UnifiedEmbedder* unified = model.model().embeddings().unified();
  if (!files.empty() && unified) {
    // gemma4_unified: 48-px patches for the image embedder (VisionInput carries the same three
    // fields: max_patches = the max_soft_tokens rows).
    const ImageProcessorConfig pc = load_processor_config(model.assets_dir());
    unified->vision_config();  // refuses a model without vision_config
    for (const std::string& f : files) {
      const RgbImage img = decode_image_file(f);
      const UnifiedPatches p = preprocess_unified_image(img, pc);
      s.images.push_back({p.max_soft_tokens, p.pixel_values, p.position_ids});
      RgbImage gray = img;
      std::fill(gray.rgb.begin(), gray.rgb.end(), uint8_t{128});
      const UnifiedPatches g = preprocess_unified_image(gray, pc);
      s.blanks.push_back({g.max_soft_tokens, g.pixel_values, g.position_ids});
      s.source += (s.source.empty() ? "" : ", ") + f;
    }
    return s;
  }
  if (!ref.pixel_values.empty() && files.empty() && unified) {
    const int64_t pd = unified->vision_config().patch_dim();
    s.images =
        vision_inputs_from_arrays(load_npy(ref.pixel_values), load_npy(ref.image_position_ids), pd,
                                  ref.pixel_values, ref.image_position_ids);
    for (const VisionInput& in : s.images) s.blanks.push_back(blank_from_arrays(in, pd));
    s.source = ref.pixel_values + " + " + ref.image_position_ids;
    return s;
  }
  if (!files.empty()) {
    if (!vision) fail(model.path(), ": this model has no vision tower, so it cannot take images");
    const ImageProcessorConfig pc = load_processor_config(model.assets_dir());
    for (const std::string& f : files) {
      const RgbImage img = decode_image_file(f);
      const ProcessedImage p = preprocess_image(img, pc);
      s.images.push_back({p.max_patches, p.pixel_values, p.position_ids});
      RgbImage gray = img;
      std::fill(gray.rgb.begin(), gray.rgb.end(), uint8_t{128});
      const ProcessedImage g = preprocess_image(gray, pc);
      s.blanks.push_back({g.max_patches, g.pixel_values, g.position_ids});
      s.source += (s.source.empty() ? "" : ", ") + f;
    }
    return s;
  }
  if (!ref.pixel_values.empty()) {
    if (ref.image_position_ids.empty())
      fail(ref.dir, ": the reference has pixel values (", ref.pixel_values,
           ") but no image_position_ids.npy next to them");
    if (!vision) fail(model.path(), ": this model has no vision tower, so it cannot take images");
    s.images =
        vision_inputs_from_arrays(load_npy(ref.pixel_values), load_npy(ref.image_position_ids),
                                  vision->patch_dim(), ref.pixel_values, ref.image_position_ids);
    for (const VisionInput& in : s.images)
      s.blanks.push_back(blank_from_arrays(in, vision->patch_dim()));
    s.source = ref.pixel_values + " + " + ref.image_position_ids;
  }
  return s;
}

// The prompt's audio clips (the reference's, or --audio files) and, for the audio gate, the
// same-length silence through the same feature extractor and tower.
struct AudioSet {
  std::vector<AudioInput> clips, blanks;
  std::string source;
};

AudioSet load_audio(const Sequence& model, const ReferenceDump& ref, const ParityOptions& opt) {
  AudioSet s;
  std::vector<std::string> files = opt.audios;
  if (files.empty() && !ref.audio_file.empty()) files.push_back(ref.audio_file);
  if (files.empty()) return s;
  if (const UnifiedEmbedder* unified = model.model().embeddings().unified()) {
    // gemma4_unified: the raw frames for the audio embedder, carried in AudioInput (features =
    // [frames, frame_samples] samples, every frame real).
    const int F = unified->audio_config().frame_samples;
    for (const std::string& f : files) {
      const AudioClip clip = decode_audio_file(f);
      const UnifiedAudioInput on = unified_audio_frames(clip.samples, F);
      s.clips.push_back({on.frames, on.samples, on.mask});
      const UnifiedAudioInput off =
          unified_audio_frames(std::vector<float>(clip.samples.size(), 0.0f), F);
      s.blanks.push_back({off.frames, off.samples, off.mask});
      s.source += (s.source.empty() ? "" : ", ") + f;
    }
    return s;
  }
  if (!model.audio())
    fail(model.path(),
         ": this model has no audio tower (no audio_config), so it cannot take audio");
  for (const std::string& f : files) {
    const AudioClip clip = decode_audio_file(f);
    const LogMelFeatures on = log_mel_features(clip.samples, f.c_str());
    s.clips.push_back({on.frames, on.values, on.mask});
    const std::vector<float> silence(clip.samples.size(), 0.0f);
    const LogMelFeatures off = log_mel_features(silence, f.c_str());
    s.blanks.push_back({off.frames, off.values, off.mask});
    s.source += (s.source.empty() ? "" : ", ") + f;
  }
  return s;
}

struct Run {
  FloatTensor prompt_logits;       // [S, V]
  std::vector<float> step_logits;  // [N, V]: row 0 = last prompt row, row i after feeding ref i-1
};

Run teacher_force(Sequence& model, ThreadPool& pool, const std::vector<int32_t>& prompt,
                  const std::vector<int32_t>& fed, int64_t n_steps,
                  const std::vector<VisionInput>& images, const std::vector<AudioInput>& clips,
                  const TextRunOptions& topt, TapRecorder* taps) {
  const int64_t S = static_cast<int64_t>(prompt.size());
  const int64_t V = model.config().text.vocab_size;
  model.reset(S + std::max<int64_t>(n_steps, 1) + 1);
  FloatTensor soft, audio_soft;
  const UnifiedEmbedder* unified = model.model().embeddings().unified();
  if (!images.empty() && unified) {
    std::vector<UnifiedImageInput> u;
    for (const VisionInput& in : images)
      u.push_back({in.max_patches, in.pixel_values, in.position_ids});
    soft = unified->encode_images(pool, u, taps);
  } else if (!images.empty()) {
    soft = model.vision()->encode_all(pool, images, taps);
  }
  if (!clips.empty()) {
    if (unified) {
      std::vector<UnifiedAudioInput> u;
      for (const AudioInput& a : clips) u.push_back({a.frames, a.features, a.mask});
      audio_soft = unified->encode_audio(pool, u, taps);
    } else {
      audio_soft = model.audio()->encode_all(pool, clips, taps);
    }
    soft = merge_soft_tokens(model.config(), prompt, images.empty() ? nullptr : &soft, &audio_soft);
  }
  Run r;
  r.prompt_logits =
      model.prefill(pool, prompt, soft.numel() ? &soft : nullptr, S, true, taps, topt);
  if (n_steps > 0) {
    const float* last = r.prompt_logits.row(r.prompt_logits.dim(0) - 1);
    r.step_logits.assign(last, last + V);
    for (int64_t i = 0; i + 1 < n_steps; ++i) {
      const int32_t tok = fed[static_cast<size_t>(i)];
      const FloatTensor l =
          model.forward(pool, std::span<const int32_t>(&tok, 1), nullptr, false, nullptr, topt);
      r.step_logits.insert(r.step_logits.end(), l.row(0), l.row(0) + V);
    }
  }
  return r;
}

// Rows [0, S) of the prompt logits then rows [1, N) of the step logits: every position of the
// reference sequence that has a next-token prediction.
std::vector<float> all_positions(const FloatTensor& prompt, const std::vector<float>& steps,
                                 int64_t V) {
  std::vector<float> v = prompt.data;
  if (steps.size() > static_cast<size_t>(V)) v.insert(v.end(), steps.begin() + V, steps.end());
  return v;
}

const std::vector<std::string> kVisionOrder = {"pixel_values", "vision_patch_embeds",
                                               "vision_encoder_out", "vision_pooled",
                                               "vision_embedder_out"};
const std::vector<std::string> kAudioOrder = {"audio_features", "audio_subsample_out",
                                              "audio_encoder_out", "audio_tower_out",
                                              "audio_embedder_out"};
const std::vector<std::string> kEmbedOrder = {"embeds_scaled", "inputs_embeds", "ple_token_embeds",
                                              "per_layer_inputs"};
const std::vector<std::string> kLayerOrder = {"hidden_after_attn", "hidden_after_mlp",
                                              "hidden_states"};
const std::vector<std::string> kHeadOrder = {"final_hidden", "logits", "decode_logits"};

std::string fmt(double v, int prec = 3) {
  std::ostringstream os;
  os << std::scientific << std::setprecision(prec) << v;
  return os.str();
}
std::string fixed(double v, int prec = 6) {
  std::ostringstream os;
  os << std::fixed << std::setprecision(prec) << v;
  return os.str();
}

}  // namespace

json find_first_divergence(const json& taps, double diverge_cos) {
  auto check = [&](const json& s, const json& tol, std::string& why) {
    const double ma = s.value("max_abs", 0.0), cos = s.value("cos", 1.0);
    if (tol.is_number() && ma > tol.get<double>()) {
      why = "max-abs " + fmt(ma) + " > atol " + fmt(tol.get<double>(), 1);
      return true;
    }
    if (cos < diverge_cos) {
      why = "cosine " + fixed(cos) + " < " + fixed(diverge_cos, 4);
      return true;
    }
    return false;
  };
  auto found = [&](const std::string& stage, int64_t layer, const std::string& tap, const json& s,
                   const std::string& why) {
    json j;
    j["found"] = true;
    j["stage"] = stage;
    j["layer"] = layer < 0 ? json(nullptr) : json(layer);
    j["tap"] = tap;
    j["max_abs"] = s.value("max_abs", 0.0);
    j["cos"] = s.value("cos", 1.0);
    j["reason"] = why;
    j["text"] =
        (layer >= 0 ? "first diverging at layer " + std::to_string(layer)
                    : "first diverging in the " + (stage == "vision"  ? std::string("vision tower")
                                                   : stage == "audio" ? std::string("audio tower")
                                                                      : stage)) +
        " (" + tap + ": " + why + ")";
    return j;
  };
  auto usable = [&](const std::string& n) {
    return taps.contains(n) && taps[n].is_object() && taps[n].contains("max_abs");
  };
  std::string why;
  for (const auto& [stage, order] :
       std::vector<std::pair<std::string, const std::vector<std::string>*>>{
           {"vision", &kVisionOrder}, {"audio", &kAudioOrder}, {"embeddings", &kEmbedOrder}})
    for (const std::string& n : *order)
      if (usable(n) && check(taps[n], taps[n]["tolerance"], why))
        return found(stage, -1, n, taps[n], why);
  int64_t L = 0;
  for (const std::string& n : kLayerOrder)
    if (usable(n) && taps[n].contains("layers"))
      L = std::max<int64_t>(L, static_cast<int64_t>(taps[n]["layers"].size()));
  for (int64_t l = 0; l < L; ++l)
    for (const std::string& n : kLayerOrder)
      if (usable(n) && taps[n].contains("layers") &&
          l < static_cast<int64_t>(taps[n]["layers"].size()) &&
          check(taps[n]["layers"][static_cast<size_t>(l)], taps[n]["tolerance"], why))
        return found("layer", l, n, taps[n]["layers"][static_cast<size_t>(l)], why);
  for (const std::string& n : kHeadOrder)
    if (usable(n) && check(taps[n], taps[n]["tolerance"], why))
      return found("head", -1, n, taps[n], why);
  return json{{"found", false}, {"text", "no divergence: every tap within tolerance"}};
}

json run_parity(Sequence& model, const ReferenceDump& ref, const ParityOptions& opt,
                ThreadPool& pool) {
  const ModelConfig& cfg = model.config();
  const int64_t V = cfg.text.vocab_size;
  std::vector<int32_t> prompt;
  for (int64_t v : ref.load("input_ids").to_i64()) {
    if (v < 0 || v >= V)
      fail(ref.taps.at("input_ids"), ": token id ", v, " is outside the model's vocabulary (", V,
           ")");
    prompt.push_back(static_cast<int32_t>(v));
  }
  const int64_t S = static_cast<int64_t>(prompt.size());

  // The reference continuation: sequence_ids after the prompt (else decode_ids).
  std::vector<int32_t> cont;
  if (ref.has("sequence_ids")) {
    const auto seq = ref.load("sequence_ids").to_i64();
    if (static_cast<int64_t>(seq.size()) < S)
      fail(ref.taps.at("sequence_ids"), ": shorter than input_ids");
    for (size_t i = static_cast<size_t>(S); i < seq.size(); ++i)
      cont.push_back(static_cast<int32_t>(seq[i]));
  } else if (ref.has("decode_ids")) {
    for (int64_t v : ref.load("decode_ids").to_i64()) cont.push_back(static_cast<int32_t>(v));
  }
  std::vector<float> ref_steps;
  int64_t n_steps = 0;
  if (ref.has("decode_logits")) {
    const NpyArray dl = ref.load("decode_logits");
    if (dl.shape.size() != 2 || dl.shape[1] != V)
      fail(ref.taps.at("decode_logits"), ": expected [N, ", V, "], found ", shape_str(dl.shape));
    n_steps = std::min<int64_t>(dl.shape[0], static_cast<int64_t>(cont.size()) + 1);
    ref_steps = dl.to_f32();
    ref_steps.resize(static_cast<size_t>(n_steps * V));
  }

  std::vector<RowClass> classes;
  json row_counts = {{"text", 0}, {"image", 0}, {"audio", 0}, {"special", 0}};
  for (int32_t id : prompt) {
    classes.push_back(classify_token(cfg, id));
    row_counts[row_class_name(classes.back())] =
        row_counts[row_class_name(classes.back())].get<int64_t>() + 1;
  }

  int64_t n_audio_rows = 0;
  for (int32_t id : prompt) n_audio_rows += id == cfg.audio_token_id ? 1 : 0;
  const int64_t n_placeholders = count_placeholders(cfg, prompt) - n_audio_rows;
  ImageSet imgs;
  if (n_placeholders > 0) {
    imgs = load_images(model, ref, opt);
    if (imgs.images.empty())
      fail(ref.dir, ": the reference prompt has ", n_placeholders,
           " image placeholder tokens but no image was found (no image.png or pixel_values.npy "
           "in the reference); give --image FILE");
  }
  AudioSet auds;
  if (n_audio_rows > 0) {
    auds = load_audio(model, ref, opt);
    if (auds.clips.empty())
      fail(ref.dir, ": the reference prompt has ", n_audio_rows,
           " audio placeholder tokens but no clip was found (no inputs.wav in the reference "
           "manifest); give --audio FILE");
  }

  TextRunOptions topt;
  topt.ple_identity = opt.ple_identity;
  TapRecorder taps({"all"});
  const Run on =
      teacher_force(model, pool, prompt, cont, n_steps, imgs.images, auds.clips, topt, &taps);

  json report;
  report["schema"] = "gemstage-parity";
  report["schema_version"] = kParityReportVersion;
  report["model"] = model.path();
  report["bundle"] = model.is_bundle();
  report["stages"] = json::array();
  for (const StageDecl& d : model.stages())
    report["stages"].push_back({{"id", d.id},
                                {"role", stage_role_name(d.role)},
                                {"layers", {d.layers.begin, d.layers.end}}});
  report["reference"] = ref.dir;
  report["options"] = {{"ple_identity", opt.ple_identity == PleIdentity::Raw ? "raw" : "pad"},
                       {"tie_tol", opt.tie_tol},
                       {"diverge_cos", opt.diverge_cos}};
  report["inputs"] = {{"n_prompt", S},
                      {"n_steps", n_steps},
                      {"images", imgs.images.size()},
                      {"image_source", imgs.source},
                      {"audios", auds.clips.size()},
                      {"audio_source", auds.source},
                      {"rows", row_counts}};

  // Our taps: the recorded prefill taps plus the teacher-forced step logits.
  std::map<std::string, FloatTensor> ours_f;
  std::map<std::string, std::vector<int64_t>> ours_i;
  for (const std::string& n : taps.recorded()) {
    try {
      ours_f[n] = taps.get(n);
    } catch (const Error&) {
      ours_i[n] = taps.get_ids(n);
    }
  }
  if (n_steps > 0) {
    FloatTensor dl({n_steps, V});
    dl.data = on.step_logits;
    ours_f["decode_logits"] = dl;
    std::vector<int64_t> ids;
    FloatTensor margin({n_steps});
    for (int64_t i = 0; i < n_steps; ++i) {
      const float* row = dl.row(i);
      ids.push_back(argmax_first(row, V));
      float second = -INFINITY;
      for (int64_t v = 0; v < V; ++v)
        if (v != ids.back()) second = std::max(second, row[v]);
      margin.data[static_cast<size_t>(i)] = row[ids.back()] - second;
    }
    ours_i["decode_ids"] = ids;
    ours_f["decode_top2_margin"] = margin;  // under teacher forcing, as the reference's
  }
  std::vector<uint8_t> patch_valid;
  if (ours_i.count("image_position_ids")) {
    const auto& p = ours_i["image_position_ids"];
    for (size_t i = 0; i + 1 < p.size(); i += 2) patch_valid.push_back(p[i] >= 0 ? 1 : 0);
  } else if (ref.num_patches > 0 && ref.has("vision_patch_embeds")) {
    const int64_t rows = ref.load("vision_patch_embeds").shape.at(0);
    for (int64_t i = 0; i < rows; ++i) patch_valid.push_back(i < ref.num_patches ? 1 : 0);
  }

  std::vector<uint8_t> audio_valid;
  if (ours_i.count("audio_subsample_mask"))
    for (int64_t v : ours_i["audio_subsample_mask"]) audio_valid.push_back(v ? 1 : 0);

  json tj = json::object();
  json skipped = json::array();
  for (const auto& [name, path] : ref.taps) {
    if (ours_f.count(name)) {
      const NpyArray r = load_npy(path);
      tj[name] = compare_float_tap(name, ours_f[name], r, ref.tolerance(name), classes, patch_valid,
                                   audio_valid);
    } else if (ours_i.count(name)) {
      tj[name] = compare_id_tap(ours_i[name], load_npy(path));
    } else {
      skipped.push_back(name);
    }
  }
  report["taps"] = tj;
  report["reference_only"] = skipped;  // present in the reference, not produced by this run
  json ours_only = json::array();
  for (const auto& [n, t] : ours_f)
    if (!ref.has(n)) ours_only.push_back(n);
  report["ours_only"] = ours_only;

  // Teacher forcing over the reference sequence.
  if (n_steps > 0) {
    json tf = agreement(on.step_logits, ref_steps, n_steps, V, opt.tie_tol, opt.max_step_rows,
                        "first_divergent_step");
    if (ref.has("logits")) {
      const NpyArray rl = ref.load("logits");
      if (squeeze_leading(rl.shape) == Shape{S, V}) {
        std::vector<float> r_all = rl.to_f32();
        if (ref_steps.size() > static_cast<size_t>(V))
          r_all.insert(r_all.end(), ref_steps.begin() + V, ref_steps.end());
        const std::vector<float> o_all = all_positions(on.prompt_logits, on.step_logits, V);
        tf["prompt_and_steps"] =
            agreement(o_all, r_all, S + n_steps - 1, V, opt.tie_tol, 0, "first_divergent_position");
      }
    }
    report["teacher_forced"] = tf;
  } else {
    report["teacher_forced"] = nullptr;
  }

  // The image gate: the same teacher forcing with a blank image of the same size.
  if (!imgs.images.empty() && opt.image_gate && n_steps > 0) {
    const Run off =
        teacher_force(model, pool, prompt, cont, n_steps, imgs.blanks, auds.clips, topt, nullptr);
    json g;
    g["blank"] =
        "mid-gray RGB (128,128,128) of the same size, through the same preprocessing "
        "and vision tower";
    g["on"] =
        agreement(on.step_logits, ref_steps, n_steps, V, opt.tie_tol, 0, "first_divergent_step");
    g["off"] =
        agreement(off.step_logits, ref_steps, n_steps, V, opt.tie_tol, 0, "first_divergent_step");
    g["delta"] = g["on"]["rate"].get<double>() - g["off"]["rate"].get<double>();
    if (report["teacher_forced"].contains("prompt_and_steps")) {
      std::vector<float> r_all = ref.load("logits").to_f32();
      if (ref_steps.size() > static_cast<size_t>(V))
        r_all.insert(r_all.end(), ref_steps.begin() + V, ref_steps.end());
      g["on_all"] = report["teacher_forced"]["prompt_and_steps"];
      g["off_all"] = agreement(all_positions(off.prompt_logits, off.step_logits, V), r_all,
                               S + n_steps - 1, V, opt.tie_tol, 0, "first_divergent_position");
      g["delta_all"] = g["on_all"]["rate"].get<double>() - g["off_all"]["rate"].get<double>();
    }
    // How much our own logits move when the image is blanked (0: the image is ignored).
    double change = 0;
    for (size_t i = 0; i < on.step_logits.size(); ++i)
      change = std::max(change, std::fabs(static_cast<double>(on.step_logits[i]) -
                                          static_cast<double>(off.step_logits[i])));
    g["step_logits_change_max_abs"] = change;
    g["image_ignored"] = change == 0.0;
    report["image_gate"] = g;
  } else {
    report["image_gate"] = nullptr;
  }

  // The audio gate: the same teacher forcing with each clip replaced by silence of its length.
  if (!auds.clips.empty() && opt.audio_gate && n_steps > 0) {
    const Run off =
        teacher_force(model, pool, prompt, cont, n_steps, imgs.images, auds.blanks, topt, nullptr);
    json g;
    g["blank"] = "digital silence of the same length, through the same feature extractor and tower";
    g["on"] =
        agreement(on.step_logits, ref_steps, n_steps, V, opt.tie_tol, 0, "first_divergent_step");
    g["off"] =
        agreement(off.step_logits, ref_steps, n_steps, V, opt.tie_tol, 0, "first_divergent_step");
    g["delta"] = g["on"]["rate"].get<double>() - g["off"]["rate"].get<double>();
    double change = 0;
    for (size_t i = 0; i < on.step_logits.size(); ++i)
      change = std::max(change, std::fabs(static_cast<double>(on.step_logits[i]) -
                                          static_cast<double>(off.step_logits[i])));
    g["step_logits_change_max_abs"] = change;
    g["audio_ignored"] = change == 0.0;
    report["audio_gate"] = g;
  } else {
    report["audio_gate"] = nullptr;
  }

  report["first_divergence"] = find_first_divergence(tj, opt.diverge_cos);
  return report;
}

namespace {

std::string pad(const std::string& s, size_t w) {
  return s.size() >= w ? s + " " : s + std::string(w - s.size(), ' ');
}
std::string lpad(const std::string& s, size_t w) {
  return s.size() >= w ? " " + s : std::string(w - s.size(), ' ') + s;
}

std::string stat_line(const std::string& label, const json& s, const json& tol, const json& pass) {
  std::string line = pad(label, 34) + lpad(std::to_string(s.value("rows", int64_t{0})), 6) +
                     lpad(fmt(s.value("max_abs", 0.0)), 12) +
                     lpad(fmt(s.value("max_rel", 0.0)), 12) + lpad(fixed(s.value("cos", 1.0)), 11) +
                     lpad(fixed(s.value("cos_min", 1.0)), 11);
  line += lpad(tol.is_number() ? fmt(tol.get<double>(), 1) : "-", 10);
  line += lpad(pass.is_boolean() ? (pass.get<bool>() ? "ok" : "FAIL") : "-", 6);
  return line;
}

std::string agree_str(const json& a) {
  std::string s =
      std::to_string(a["agree"].get<int64_t>()) + "/" + std::to_string(a["steps"].get<int64_t>());
  if (a.value("ties", int64_t{0}) > 0)
    s += " (" + std::to_string(a["ties"].get<int64_t>()) + " ties)";
  return s;
}

}  // namespace

void print_parity_table(const json& r, std::ostream& os) {
  os << "parity: " << r["model"].get<std::string>()
     << (r["bundle"].get<bool>() ? " (bundle, " : " (") << r["stages"].size() << " stages) vs "
     << r["reference"].get<std::string>() << "\n";
  const json& in = r["inputs"];
  os << "inputs: " << in["n_prompt"] << " prompt rows (text " << in["rows"]["text"] << ", image "
     << in["rows"]["image"] << ", "
     << (in["rows"].contains("audio") ? "audio " + in["rows"]["audio"].dump() + ", " : "")
     << "special " << in["rows"]["special"] << "), " << in["n_steps"] << " reference steps, "
     << in["images"] << " image(s)"
     << (in["image_source"].get<std::string>().empty()
             ? ""
             : " from " + in["image_source"].get<std::string>())
     << (in.value("audios", 0) > 0 ? ", " + in["audios"].dump() + " audio clip(s) from " +
                                         in["audio_source"].get<std::string>()
                                   : "")
     << "; ple-identity " << r["options"]["ple_identity"].get<std::string>() << "\n\n";
  os << pad("tap", 34) << lpad("rows", 6) << lpad("max_abs", 12) << lpad("max_rel", 12)
     << lpad("cos", 11) << lpad("cos_min", 11) << lpad("atol", 10) << lpad("", 6) << "\n";
  os << std::string(102, '-') << "\n";
  std::vector<std::string> order;
  for (const auto* v : {&kVisionOrder, &kAudioOrder, &kEmbedOrder, &kLayerOrder, &kHeadOrder})
    order.insert(order.end(), v->begin(), v->end());
  for (const auto& [n, t] : r["taps"].items())
    if (std::find(order.begin(), order.end(), n) == order.end()) order.push_back(n);
  const std::set<std::string> class_taps = {"per_layer_inputs", "ple_token_embeds",
                                            "hidden_states"};
  for (const std::string& n : order) {
    if (!r["taps"].contains(n)) continue;
    const json& t = r["taps"][n];
    if (t.contains("error")) {
      os << pad(n, 34) << " ERROR " << t["error"].get<std::string>() << "\n";
      continue;
    }
    if (t["kind"] == "ids") {
      os << pad(n, 34) << lpad(std::to_string(t["count"].get<int64_t>()), 6)
         << "  ids: " << pad(t["mismatches"].dump() + " mismatches", 54)
         << lpad(t["pass"].get<bool>() ? "ok" : "FAIL", 6) << "\n";
      continue;
    }
    os << stat_line(n, t, t["tolerance"], t["pass"]) << "\n";
    if (class_taps.count(n) && t.contains("classes"))
      for (RowClass c : kClasses)
        if (t["classes"].contains(row_class_name(c)))
          os << stat_line(std::string("  ") + row_class_name(c) + " rows",
                          t["classes"][row_class_name(c)], nullptr, nullptr)
             << "\n";
    if (t.contains("layers") && (class_taps.count(n) || is_layered(n)))
      for (const json& l : t["layers"]) {
        std::string label = "  L" + std::to_string(l["layer"].get<int64_t>());
        if (l.contains("classes") && class_taps.count(n)) {
          label += "  cos_min";
          for (const char* c : {"text", "image", "audio"})
            if (l["classes"].contains(c))
              label += std::string(" ") + c[0] + "=" + fixed(l["classes"][c]["cos_min"], 4);
        }
        const double tol = t["tolerance"].is_number() ? t["tolerance"].get<double>() : -1;
        const json pass = tol >= 0 ? json(l["max_abs"].get<double>() <= tol) : json(nullptr);
        os << stat_line(label, l, nullptr, pass) << "\n";
      }
  }
  os << "\n";
  if (r["teacher_forced"].is_object()) {
    const json& tf = r["teacher_forced"];
    os << "teacher-forced top-1 (tie-tol " << r["options"]["tie_tol"].get<double>()
       << "): " << agree_str(tf) << " steps agree; first divergent step: "
       << (tf["first_divergent_step"].is_null() ? "none" : tf["first_divergent_step"].dump())
       << "\n";
    if (tf.contains("prompt_and_steps"))
      os << "  over every position (prompt + steps): " << agree_str(tf["prompt_and_steps"])
         << "; first divergent position: "
         << (tf["prompt_and_steps"]["first_divergent_position"].is_null()
                 ? "none"
                 : tf["prompt_and_steps"]["first_divergent_position"].dump())
         << "\n";
  } else {
    os << "teacher-forced: the reference has no decode_logits\n";
  }
  if (r["image_gate"].is_object()) {
    const json& g = r["image_gate"];
    os << "image gate (blank = mid-gray): steps with image " << agree_str(g["on"]) << ", without "
       << agree_str(g["off"]) << ", delta " << fixed(g["delta"], 3);
    if (g.contains("on_all"))
      os << "; every position " << agree_str(g["on_all"]) << " vs " << agree_str(g["off_all"])
         << ", delta " << fixed(g["delta_all"], 3);
    os << (g["image_ignored"].get<bool>() ? "  -- THE IMAGE IS IGNORED" : "") << "\n";
  }
  if (r.contains("audio_gate") && r["audio_gate"].is_object()) {
    const json& g = r["audio_gate"];
    os << "audio gate (blank = silence): steps with audio " << agree_str(g["on"]) << ", without "
       << agree_str(g["off"]) << ", delta " << fixed(g["delta"], 3)
       << (g["audio_ignored"].get<bool>() ? "  -- THE AUDIO IS IGNORED" : "") << "\n";
  }
  os << r["first_divergence"]["text"].get<std::string>() << "\n";
}

}  // namespace gemstage
