#include "stage/bundle.h"

#include <openssl/evp.h>

#include <charconv>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <sstream>

#include "audio/audio_features.h"
#include "core/error.h"
#include "gemma4/multimodal.h"
#include "gemma4/registry.h"
#include "gemma4/unified_embedder.h"
#include "image/image_processor.h"
#include "image/unified_image.h"
#include "io/file_writer.h"
#include "io/mapped_file.h"
#include "io/progress.h"
#include "io/safetensors.h"
#include "kernels/matmul.h"
#include "kernels/quant.h"
#include "kernels/weight_rows.h"
#include "stage/partition.h"
#include "stage/sequence.h"
#include "stage/weights_file.h"
#include "video/video_processor.h"

namespace gemstage {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const char* kCopiedFiles[] = {"config.json",
                              "tokenizer.json",
                              "tokenizer_config.json",
                              "preprocessor_config.json",
                              "processor_config.json",
                              "video_preprocessor_config.json",
                              "generation_config.json",
                              "special_tokens_map.json",
                              "chat_template.jinja",
                              "chat_template.json"};

DType weights_dtype(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "q8_0") return DType::Q8_0;
  if (s == "q4_0") return DType::Q4_0;
  fail("--weights must be f32, bf16, q8_0 or q4_0; got '", s, "'");
}

std::string stage_id(const LayerRange& r) {
  return "layers_" + std::to_string(r.begin) + "_" + std::to_string(r.end);
}

struct PlannedTensor {
  std::string key;
  DType dtype;
  Shape shape;             // the table's (loading checked the source against it)
  bool kept_bf16 = false;  // quantized in this bundle, but its input width is not a block multiple
};

// A Q8_0 / Q4_0 block covers 32 input columns. A matrix whose input width is not a multiple of
// that (a pruned or fine-tuned checkpoint, an MoE with a 48-wide expert MLP) is stored in bf16
// instead, as llama-quantize falls back per tensor, rather than refusing the whole export; the
// matmuls pick their kernel per tensor (kernels/matmul.cc), so the bundle runs as is.
DType stored_dtype(DType planned, const Shape& shape) {
  const bool quantized = planned == DType::Q8_0 || planned == DType::Q4_0;
  if (quantized && shape.size() >= 2 && shape.back() % 32 != 0) return DType::BF16;
  return planned;
}
bool kept_in_bf16(DType planned, const Shape& shape) {
  return stored_dtype(planned, shape) != planned;
}

// Which checkpoint tensors each stage holds, and in which format: the table's parts and storage
// classes, in the table's order.
std::vector<PlannedTensor> plan_stage_tensors(const StageDecl& d, const ModelConfig& c, DType w,
                                              DType ple) {
  std::vector<PlannedTensor> out;
  const PartSet held = stage_parts(d);
  for (const TensorSpec& s : tensor_table(c))
    if (s.role == TensorRole::Required && part_holds(held, s))
      out.push_back({s.key, stored_dtype(storage_dtype(s.storage, w, ple), s.shape), s.shape,
                     kept_in_bf16(storage_dtype(s.storage, w, ple), s.shape)});
  return out;
}

constexpr const char* kDrafterConfigFile = "drafter_config.json";
constexpr const char* kDrafterWeightsFile = "drafter.gsw";

// The drafter stage's contract: what one draft step takes and gives, and the target state it
// reads in place (the KV of two target layers, the target's embedding table).
json drafter_contract_json(const ModelConfig& c, const AssistantDonors& donors,
                           const std::string& placed_with) {
  const std::string Ht = std::to_string(c.text.hidden_size);
  StageContract k;
  k.inputs = {
      {"input_token",
       {"1"},
       "i32",
       "x_P: the newest token, not yet in the target's caches (its raw id, placeholders too)"},
      {"target_hidden",
       {Ht},
       "f32",
       "step 0: the target's post-final-norm hidden of row P-1; later steps: the previous "
       "step's next_hidden"},
      {"position", {"1"}, "i32", "P, the number of rows in the target's caches, for all steps"}};
  k.outputs = {{"draft_token", {"1"}, "i32", "the drafted id (argmax of the drafter's head)"},
               {"next_hidden", {Ht}, "f32", "post_projection output: the next step's h"}};
  json j = contract_to_json(k);
  json kv = json::array();
  for (const auto& [layer, kind] :
       {std::pair{donors.sliding, "sliding"}, std::pair{donors.full, "full"}})
    if (layer >= 0)
      kv.push_back(
          {{"layer", layer},
           {"kind", kind},
           {"stage", placed_with},
           {"meaning", std::string("K (after k_norm and RoPE) and V (after v_norm) of "
                                   "positions 0..P-1") +
                           (std::string(kind) == "sliding" ? ", the last W+1 of them" : "")}});
  j["reads_kv"] = std::move(kv);
  j["reads_target_weights"] =
      json::array({{{"tensor", "embed_tokens"},
                    {"stage", "embeddings"},
                    {"meaning", "the target's token embedding of x_P, times sqrt(hidden_size)"}}});
  return j;
}

void convert_rows(const WeightView& src, DType dst, WeightsFileWriter& out, Progress& progress) {
  const int64_t rows =
      src.shape.empty() ? 1 : shape_numel(src.shape) / std::max<int64_t>(1, src.shape.back());
  const int64_t cols = src.shape.empty() ? 1 : src.shape.back();
  WeightView flat = src;
  flat.shape = {rows, cols};
  std::vector<float> row(static_cast<size_t>(cols));
  std::vector<uint8_t> buf;
  for (int64_t r = 0; r < rows; ++r) {
    weight_row_to_f32(flat, r, row.data());
    switch (dst) {
      case DType::F32:
        out.write(row.data(), row.size() * 4);
        break;
      case DType::BF16:
      case DType::F16: {
        buf.resize(row.size() * 2);
        for (size_t i = 0; i < row.size(); ++i) {
          const uint16_t h = dst == DType::BF16 ? f32_to_bf16(row[i]) : f32_to_f16(row[i]);
          std::memcpy(&buf[i * 2], &h, 2);
        }
        out.write(buf.data(), buf.size());
        break;
      }
      case DType::Q8_0:
      case DType::Q4_0:
        buf.resize(quant_row_bytes(dst, cols));
        quantize_row(dst, row.data(), cols, buf.data());
        out.write(buf.data(), buf.size());
        break;
      default:
        fail("tensor ", src.name, ": no conversion to ", dtype_name(dst));
    }
    progress.advance(static_cast<uint64_t>(cols) * dtype_size(src.dtype));
  }
}

json cache_groups_json(const LayerRange& r, const TextConfig& t, int64_t max_context) {
  json sliding = {{"kind", "sliding"},
                  {"layers", json::array()},
                  {"capacity", t.sliding_window},
                  {"window", t.sliding_window}};
  json full = {{"kind", "full"}, {"layers", json::array()}, {"capacity", max_context}};
  for (int i = r.begin; i < r.end; ++i) {
    const LayerSpec& s = t.layers[static_cast<size_t>(i)];
    if (s.kv_shared) continue;
    (s.type == LayerType::Sliding ? sliding : full)["layers"].push_back(i);
  }
  json g = json::array();
  if (!sliding["layers"].empty()) g.push_back(sliding);
  if (!full["layers"].empty()) g.push_back(full);
  return g;
}

json kv_donors_json(const LayerRange& r, const TextConfig& t) {
  json d = json::object();
  for (int i = r.begin; i < r.end; ++i)
    if (t.layers[static_cast<size_t>(i)].kv_shared)
      d[std::to_string(i)] = t.layers[static_cast<size_t>(i)].kv_donor;
  return d;
}

// Every stage's tensors, seen as one source: the "unstaged" model built from a bundle.
class UnionSource : public TensorSource {
 public:
  explicit UnionSource(std::vector<std::shared_ptr<TensorSource>> s) : sources_(std::move(s)) {}
  bool has(const std::string& k) const override {
    for (const auto& s : sources_)
      if (s->has(k)) return true;
    return false;
  }
  WeightView view(const std::string& k) const override {
    for (const auto& s : sources_)
      if (s->has(k)) return s->view(k);
    fail("bundle has no tensor ", k);
  }
  std::string file_of(const std::string& k) const override {
    for (const auto& s : sources_)
      if (s->has(k)) return s->file_of(k);
    return "(none)";
  }
  std::vector<std::string> keys() const override {
    std::vector<std::string> out;
    for (const auto& s : sources_)
      for (auto& k : s->keys()) out.push_back(k);
    return out;
  }

 private:
  std::vector<std::shared_ptr<TensorSource>> sources_;
};

// The probe: a prompt with an image span. With a vision tower the image is a synthetic
// gradient through the real preprocessing and tower; without one, synthetic features fill the
// placeholder rows. Checks the PAD identity rule and staged == unstaged.
std::string run_probe(const std::string& dir, const BundleManifest& m) {
  const int64_t ctx = std::min<int64_t>(512, m.max_context);
  auto pipe = Sequence::open(dir, ctx);
  const ModelConfig& c = pipe->config();
  ThreadPool pool(default_thread_count());
  FloatTensor soft;
  std::string image_note;
  const UnifiedEmbedder* unified = pipe->model().embeddings().unified();
  if (unified && unified->has_vision()) {
    // gemma4_unified: a synthetic 144x96 image through the processor and the image embedder.
    ImageProcessorConfig pc = load_processor_config(dir);
    pc.max_soft_tokens = std::min(pc.max_soft_tokens, 70);
    RgbImage img{144, 96, std::vector<uint8_t>(144 * 96 * 3)};
    for (size_t i = 0; i < img.rgb.size(); ++i)
      img.rgb[i] = static_cast<uint8_t>((i * 7 + (i / 432) * 3) & 0xff);
    const UnifiedPatches up = preprocess_unified_image(img, pc);
    soft = unified->encode_images(
        pool, {UnifiedImageInput{up.max_soft_tokens, up.pixel_values, up.position_ids}}, nullptr);
    image_note = "a synthetic 144x96 image through the image embedder: ";
  } else if (const VisionTower* vision = pipe->vision()) {
    ImageProcessorConfig pc = load_processor_config(dir);
    pc.max_soft_tokens = std::min(pc.max_soft_tokens, 70);
    RgbImage img{144, 96, std::vector<uint8_t>(144 * 96 * 3)};
    for (int y = 0; y < img.height; ++y)
      for (int x = 0; x < img.width; ++x)
        for (int ch = 0; ch < 3; ++ch)
          img.rgb[static_cast<size_t>((y * img.width + x) * 3 + ch)] =
              static_cast<uint8_t>((x * 7 + y * 3 + ch * 50) & 0xff);
    const ProcessedImage pi = preprocess_image(img, pc);
    soft = vision->encode_all(pool, {VisionInput{pi.max_patches, pi.pixel_values, pi.position_ids}},
                              nullptr);
    image_note = "a synthetic 144x96 image through the vision tower: ";
  } else if (pipe->audio()) {
    soft = FloatTensor({0, c.text.hidden_size});  // no vision tower: the probe's span is audio
  } else {
    soft = FloatTensor({9, c.text.hidden_size});
    std::mt19937 frng(7);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    for (float& x : soft.data) x = nd(frng);
    image_note = "synthetic soft tokens (no vision tower): ";
  }
  const int64_t n_img = soft.dim(0);
  std::vector<int32_t> ids = {c.text.bos_token_id};
  std::mt19937 rng(1234);
  for (int i = 0; i < 5; ++i) ids.push_back(static_cast<int32_t>(10 + rng() % 200));
  ids.push_back(c.boi_token_id);
  for (int64_t i = 0; i < n_img; ++i) ids.push_back(c.image_token_id);
  ids.push_back(c.eoi_token_id);
  for (int i = 0; i < 4; ++i) ids.push_back(static_cast<int32_t>(10 + rng() % 200));
  // With a vision tower: a synthetic two-frame video through the video processor and the same
  // tower, each frame a block of video placeholders between the image markers.
  int64_t n_video = 0;
  if (const VisionTower* vision = pipe->vision(); vision && !unified) {
    VideoProcessorConfig vc = load_video_processor_config(dir);
    vc.frame.max_soft_tokens = std::min(vc.frame.max_soft_tokens, 70);
    std::vector<RgbImage> frames;
    for (int f = 0; f < 2; ++f) {
      RgbImage frame{96, 64, std::vector<uint8_t>(96 * 64 * 3)};
      for (size_t i = 0; i < frame.rgb.size(); ++i)
        frame.rgb[i] = static_cast<uint8_t>((i * 5 + static_cast<size_t>(f) * 40) & 0xff);
      frames.push_back(std::move(frame));
    }
    const ProcessedVideo v = process_video_frames(frames, {0, 12}, 24.0, vc);
    std::vector<VisionInput> inputs;
    const size_t values = static_cast<size_t>(v.max_patches) * v.patch_dim;
    const size_t positions = static_cast<size_t>(v.max_patches) * 2;
    for (size_t f = 0; f < 2; ++f)
      inputs.push_back({v.max_patches,
                        std::vector<float>(v.pixel_values.begin() + f * values,
                                           v.pixel_values.begin() + (f + 1) * values),
                        std::vector<int64_t>(v.position_ids.begin() + f * positions,
                                             v.position_ids.begin() + (f + 1) * positions)});
    const FloatTensor video_soft = vision->encode_all(pool, inputs, nullptr);
    n_video = video_soft.dim(0);
    FloatTensor both({n_img + n_video, c.text.hidden_size});
    std::copy(soft.data.begin(), soft.data.end(), both.data.begin());
    std::copy(video_soft.data.begin(), video_soft.data.end(),
              both.data.begin() + static_cast<ptrdiff_t>(soft.data.size()));
    soft = std::move(both);
    for (int f = 0; f < 2; ++f) {
      ids.push_back(c.boi_token_id);
      for (int64_t i = 0; i < n_video / 2; ++i) ids.push_back(c.video_token_id);
      ids.push_back(c.eoi_token_id);
    }
    image_note += "a synthetic two-frame video through the vision tower: ";
  }
  // With an audio tower: a synthetic 1 s clip through the feature extractor and the tower.
  FloatTensor audio_soft;
  if (const AudioTower* audio = pipe->audio()) {
    std::vector<float> wave(16000);
    for (size_t i = 0; i < wave.size(); ++i)
      wave[i] = 0.3f * std::sin(0.07f * static_cast<float>(i)) +
                0.1f * std::sin(0.9f * static_cast<float>(i % 977));
    const LogMelFeatures f = log_mel_features(wave, "probe clip");
    audio_soft = audio->encode_all(pool, {AudioInput{f.frames, f.values, f.mask}}, nullptr);
    ids.push_back(c.boa_token_id);
    for (int64_t i = 0; i < audio_soft.dim(0); ++i) ids.push_back(c.audio_token_id);
    ids.push_back(c.eoa_token_id);
    image_note += "a synthetic 1 s clip through the audio tower: ";
  }
  if (unified && unified->has_audio()) {
    // gemma4_unified: a synthetic 0.5 s clip (a partial last frame) through the audio embedder.
    std::vector<float> wave(8100);
    for (size_t i = 0; i < wave.size(); ++i)
      wave[i] = 0.3f * std::sin(0.07f * static_cast<float>(i));
    audio_soft = unified->encode_audio(
        pool, {unified_audio_frames(wave, unified->audio_config().frame_samples)}, nullptr);
    ids.push_back(c.boa_token_id);
    for (int64_t i = 0; i < audio_soft.dim(0); ++i) ids.push_back(c.audio_token_id);
    ids.push_back(c.eoa_token_id);
    image_note += "a synthetic 0.5 s clip through the audio embedder: ";
  }
  const int64_t n_audio = audio_soft.numel() ? audio_soft.dim(0) : 0;
  const FloatTensor all_soft =
      merge_soft_tokens(c, ids, n_img + n_video ? &soft : nullptr, n_audio ? &audio_soft : nullptr);
  const auto is_vision_row = [&](int32_t id) {
    return id == c.image_token_id || id == c.video_token_id;
  };
  TapRecorder taps({"ple_ids", "ple_token_embeds", "image_splice_mask", "audio_splice_mask"});
  const FloatTensor staged =
      pipe->forward(pool, ids, all_soft.numel() ? &all_soft : nullptr, true, &taps);

  const std::vector<int64_t> ple_ids = taps.get_ids("ple_ids");
  // The PLE identity of placeholder rows (models with per-layer embeddings).
  const int64_t LP = int64_t{c.text.num_hidden_layers} * c.text.ple_dim();
  FloatTensor tok;
  std::vector<float> pad_row(static_cast<size_t>(LP));
  if (c.text.has_ple()) {
    tok = taps.get("ple_token_embeds");
    weight_row_to_f32(pipe->embeddings_model().weights().embed_tokens_per_layer,
                      c.text.pad_token_id, pad_row.data());
  }
  const float scale = std::sqrt(static_cast<float>(c.text.ple_dim()));
  for (size_t r = 0; r < ids.size() && c.text.has_ple(); ++r) {
    if (!is_vision_row(ids[r]) && ids[r] != c.audio_token_id) continue;
    if (ple_ids[r] != c.text.pad_token_id)
      fail("row ", r, " is an image/video/audio placeholder but its PLE identity id is ",
           ple_ids[r], ", not pad ", c.text.pad_token_id);
    for (int64_t k = 0; k < LP; ++k)
      if (tok.data[static_cast<size_t>(static_cast<int64_t>(r) * LP + k)] !=
          pad_row[static_cast<size_t>(k)] * scale)
        fail("row ", r, ": PLE identity row differs from the PAD row at element ", k);
  }
  std::string block_note;
  if (c.text.bidirectional_vision) {
    // The image block: the image's rows see each other on sliding layers, so a prefill in chunks
    // smaller than the image must keep it whole and give the one-pass logits.
    auto chunked = Sequence::open(dir, ctx);
    const FloatTensor last =
        chunked->prefill(pool, ids, all_soft.numel() ? &all_soft : nullptr, 2, false, nullptr);
    const int64_t V = last.dim(1);
    double d = 0;
    for (int64_t v = 0; v < V; ++v)
      d = std::max(
          d, static_cast<double>(std::fabs(last.row(0)[v] - staged.row(staged.dim(0) - 1)[v])));
    // Quantized weights round a call's activations per call shape, so short and long calls
    // differ by more than a split block would on the real models' scale (measured on the MoE
    // fixture: q8_0 8e-3, q4_0 5.5e-2; f32 and bf16 1e-6): there the distance is reported.
    const bool exact = m.weights_format == "f32" || m.weights_format == "bf16";
    if (exact && d > 1e-3)
      fail("a prefill in chunks of 2 rows gives logits ", d,
           " away from the one-pass prefill: the image block was split across chunks");
    block_note = exact ? "; the image and video blocks survive chunks of 2 rows (max-abs " +
                             std::to_string(d) + ")"
                       : "; chunks of 2 rows give logits " + std::to_string(d) +
                             " from the one-pass prefill (" + m.weights_format +
                             " weights: reported; f32 and bf16 exports check it to 1e-3)";
  }
  // The splice mask the embeddings stage hands on marks exactly the placeholder rows.
  const auto mask = taps.get_ids("image_splice_mask");
  for (size_t r = 0; r < ids.size(); ++r)
    if ((mask[r] != 0) != is_vision_row(ids[r]))
      fail("row ", r, ": image_splice_mask is ", mask[r], " but the row ",
           is_vision_row(ids[r]) ? "is" : "is not", " an image or video placeholder");
  if (c.takes_audio()) {
    const auto amask = taps.get_ids("audio_splice_mask");
    for (size_t r = 0; r < ids.size(); ++r)
      if ((amask[r] != 0) != (ids[r] == c.audio_token_id))
        fail("row ", r, ": audio_splice_mask is ", amask[r], " but the row ",
             ids[r] == c.audio_token_id ? "is" : "is not", " an audio placeholder");
  }
  std::ostringstream os;
  os << image_note << n_img + n_video + n_audio
     << " placeholder rows carry the PAD identity and the splice mask; logits finite over "
     << staged.dim(0) << " rows" << block_note;
  for (float v : staged.data)
    if (!std::isfinite(v)) fail("the bundle's logits are not finite");
  return os.str();
}

constexpr const char* kPartialSuffix = ".gemstage-partial";

// A kv_donors key: a layer index written as a decimal string.
int layer_index_key(const std::string& key, const std::string& path, const std::string& where) {
  int v = 0;
  const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), v);
  if (ec != std::errc() || end != key.data() + key.size() || v < 0)
    fail(path, ": ", where, ".kv_donors key '", key, "' is not a layer index");
  return v;
}

bool is_partial_name(const std::string& name) {
  const std::string suf = kPartialSuffix;
  return name.size() > suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
}

// The files an existing bundle's manifest names (so replacing it removes exactly those), or
// nothing when the manifest cannot be read.
std::vector<std::string> files_of_existing_bundle(const std::string& dir) {
  std::vector<std::string> out;
  try {
    const json j =
        json::parse(read_text_file((fs::path(dir) / "manifest.json").string(), size_t{64} << 20));
    if (j.contains("stages") && j["stages"].is_array())
      for (const json& st : j["stages"])
        if (st.is_object() && st.contains("weights") && st["weights"].is_object() &&
            st["weights"].contains("file") && st["weights"]["file"].is_string())
          out.push_back(st["weights"]["file"].get<std::string>());
    if (j.contains("copied_files") && j["copied_files"].is_object())
      for (auto it = j["copied_files"].begin(); it != j["copied_files"].end(); ++it)
        out.push_back(it.key());
    if (j.contains("drafter") && j["drafter"].is_object())
      for (const char* part : {"weights", "config"})
        if (j["drafter"].contains(part) && j["drafter"][part].is_object() &&
            j["drafter"][part].contains("file") && j["drafter"][part]["file"].is_string())
          out.push_back(j["drafter"][part]["file"].get<std::string>());
  } catch (const std::exception&) {
    out.clear();
  }
  // Only plain names inside the folder: a manifest is input, and must not steer removals.
  std::erase_if(out, [](const std::string& f) {
    return f.empty() || f.find('/') != std::string::npos || f == "." || f == "..";
  });
  return out;
}

// Refuses an output folder that holds something other than a gemstage bundle (unless forced),
// and removes partial files a previous interrupted export left. Returns the files of the bundle
// that is already there (empty when none), to remove once the new one is complete.
std::vector<std::string> prepare_output_dir(const std::string& out_dir, bool force) {
  std::error_code ec;
  const fs::file_status st = fs::status(out_dir, ec);
  if (fs::exists(st) && !fs::is_directory(st))
    fail("--out ", out_dir, " exists and is not a folder; choose a new folder name");
  if (!fs::exists(st)) {
    fs::create_directories(out_dir, ec);
    if (ec) fail("--out ", out_dir, ": cannot create the folder (", ec.message(), ")");
    return {};
  }
  std::vector<std::string> others;
  for (const auto& e : fs::directory_iterator(out_dir)) {
    const std::string name = e.path().filename().string();
    if (is_partial_name(name)) {
      fs::remove(e.path(), ec);
      continue;
    }
    others.push_back(name);
  }
  if (is_bundle_dir(out_dir)) return files_of_existing_bundle(out_dir);
  if (!others.empty() && !force)
    fail("--out ", out_dir, " already holds ", others.size(), " file(s) (such as '", others.front(),
         "') and no gemstage bundle manifest; choose an empty or new folder, or pass --force to "
         "write the bundle beside those files");
  return {};
}

// Removes the partial files of an export that failed, so its folder holds nothing half-written.
class PartialFiles {
 public:
  ~PartialFiles() { remove_now(); }
  void remove_now() {
    std::error_code ec;
    for (const std::string& p : paths_) fs::remove(p, ec);
    paths_.clear();
  }
  std::string add(const std::string& final_path) {
    paths_.push_back(final_path + kPartialSuffix);
    return paths_.back();
  }
  void committed() { paths_.clear(); }

 private:
  std::vector<std::string> paths_;
};

}  // namespace

std::string sha256_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open to hash");
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  if (!ctx || EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr) != 1)
    fail("sha256: OpenSSL init failed");
  std::vector<char> buf(size_t{4} << 20);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    if (n > 0) EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(n));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  std::ostringstream os;
  for (unsigned i = 0; i < len; ++i)
    os << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(md[i]);
  return os.str();
}

std::shared_ptr<TensorSource> open_bundle_tensors(const std::string& dir, const BundleManifest& m) {
  std::vector<std::shared_ptr<TensorSource>> files;
  for (const BundleStage& s : m.stages)
    files.push_back(std::make_shared<WeightsFile>((fs::path(dir) / s.weights_file).string()));
  return std::make_shared<UnionSource>(std::move(files));
}

std::unique_ptr<AssistantModel> open_bundle_drafter(const std::string& dir,
                                                    const BundleManifest& m) {
  if (!m.drafter) return nullptr;
  const BundleDrafter& d = *m.drafter;
  const std::string cfg_path = (fs::path(dir) / d.config_file).string();
  const std::string weights = (fs::path(dir) / d.weights_file).string();
  auto model =
      AssistantModel::open_from(weights, parse_assistant_config(read_text_file(cfg_path), cfg_path),
                                std::make_shared<WeightsFile>(weights));
  check_assistant_matches(model->config(), m.config, weights, dir);
  return model;
}

std::unique_ptr<AssistantModel> open_drafter(const std::string& path) {
  if (!is_bundle_dir(path)) return AssistantModel::open(path);
  auto d = open_bundle_drafter(path, read_bundle_manifest(path));
  if (!d)
    fail("-md ", path,
         ": this bundle has no drafter stage; pass a gemma4_assistant checkpoint directory, or a "
         "bundle exported with --model-draft");
  return d;
}

bool is_bundle_dir(const std::string& path) {
  const fs::path m = fs::path(path) / "manifest.json";
  if (!fs::exists(m)) return false;
  try {
    const json j = json::parse(read_text_file(m.string(), size_t{64} << 20));
    return j.is_object() && j.value("format", "") == "gemstage-bundle";
  } catch (const std::exception&) {
    return false;
  }
}

BundleManifest read_bundle_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / "manifest.json").string();
  BundleManifest m;
  try {
    m.raw = json::parse(read_text_file(path, size_t{64} << 20));
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  // Checked fields fail with their own message; a field of the wrong JSON type deeper down
  // (a cache group that is not an object, say) makes nlohmann throw, and that too must name the
  // manifest rather than escape as a bare library exception.
  try {
    const json& j = m.raw;
    auto need = [&](const json& o, const char* k, const std::string& where) -> const json& {
      if (!o.is_object() || !o.contains(k)) fail(path, ": ", where, " is missing '", k, "'");
      return o[k];
    };
    if (need(j, "format", "manifest") != "gemstage-bundle")
      fail(path, ": format is not gemstage-bundle");
    const json& ver = need(j, "schema_version", "manifest");
    if (!ver.is_number_integer() ||
        (ver.get<int>() != kBundleSchemaVersion && ver.get<int>() != kBundleSchemaVersionV1))
      fail(path, ": schema_version ", ver.dump(), " is not supported (this gemstage reads version ",
           kBundleSchemaVersion, "); re-export the bundle");
    m.config =
        parse_model_config(need(j, "model_config", "manifest").dump(), path + ": model_config");
    const json& w = need(j, "weights", "manifest");
    if (!w.is_string()) fail(path, ": weights must be a string");
    m.weights_format = w.get<std::string>();
    m.ple_weights_format = j.value("ple_weights", "bf16");
    if (j.contains("kept_bf16")) {
      const json& kept = j["kept_bf16"];
      if (!kept.is_array()) fail(path, ": kept_bf16 must be a list of tensor names");
      for (const json& k : kept) {
        if (!k.is_string()) fail(path, ": kept_bf16 must be a list of tensor names");
        m.kept_bf16.push_back(k.get<std::string>());
      }
    }
    const json& mc = need(j, "max_context", "manifest");
    if (!mc.is_number_unsigned() || mc.get<int64_t>() <= 0)
      fail(path, ": max_context must be a positive integer");
    m.max_context = mc.get<int64_t>();
    if (j.contains("copied_files")) {
      if (!j["copied_files"].is_object()) fail(path, ": copied_files must be an object");
      for (auto it = j["copied_files"].begin(); it != j["copied_files"].end(); ++it)
        m.copied_files.emplace_back(it.key(), it.value().value("sha256", ""));
    }
    const json& stages = need(j, "stages", "manifest");
    if (!stages.is_array() || stages.empty()) fail(path, ": stages must be a non-empty list");
    for (size_t i = 0; i < stages.size(); ++i) {
      const json& s = stages[i];
      const std::string where = "stages[" + std::to_string(i) + "]";
      BundleStage bs;
      const json& id = need(s, "id", where);
      if (!id.is_string()) fail(path, ": ", where, ".id must be a string");
      bs.decl.id = id.get<std::string>();
      const json& role = need(s, "role", where);
      bs.decl.role = stage_role_from_name(role.is_string() ? role.get<std::string>() : role.dump(),
                                          path + ": " + where);
      if (bs.decl.role == StageRole::TransformerLayers) {
        const json& l = need(s, "layers", where);
        if (!l.is_array() || l.size() != 2 || !l[0].is_number_integer() ||
            !l[1].is_number_integer())
          fail(path, ": ", where, ".layers must be [begin, end]");
        bs.decl.layers = {l[0].get<int>(), l[1].get<int>()};
      }
      bs.decl.contract =
          contract_from_json(need(s, "contract", where), path + ": " + where + ".contract");
      // Version 1 declared positions as an embeddings input (it never used them) and had no
      // image_soft_tokens; its weights and every other field are the same, so it runs under the
      // current contract of its role.
      if (ver.get<int>() == kBundleSchemaVersionV1)
        bs.decl.contract = contract_for(bs.decl.role, bs.decl.layers, m.config);
      const json& wf = need(s, "weights", where);
      const json& file = need(wf, "file", where + ".weights");
      if (!file.is_string()) fail(path, ": ", where, ".weights.file must be a string");
      bs.weights_file = file.get<std::string>();
      if (bs.weights_file.find('/') != std::string::npos ||
          bs.weights_file.find("..") != std::string::npos)
        fail(path, ": ", where, ".weights.file '", bs.weights_file,
             "' must be a plain file name inside the bundle");
      bs.sha256 = wf.value("sha256", "");
      const json& bytes = need(wf, "bytes", where + ".weights");
      if (!bytes.is_number_unsigned())
        fail(path, ": ", where, ".weights.bytes must be a non-negative integer");
      bs.bytes = bytes.get<uint64_t>();
      if (s.contains("cache_groups")) {
        if (!s["cache_groups"].is_array()) fail(path, ": ", where, ".cache_groups must be a list");
        for (const json& g : s["cache_groups"]) {
          CacheGroup cg;
          cg.kind = g.value("kind", "");
          if (g.contains("layers") && g["layers"].is_array())
            for (const json& l : g["layers"])
              if (l.is_number_integer()) cg.layers.push_back(l.get<int>());
          cg.capacity = g.value("capacity", int64_t{0});
          cg.window = g.value("window", int64_t{0});
          bs.cache_groups.push_back(cg);
        }
      }
      if (s.contains("kv_donors") && s["kv_donors"].is_object())
        for (auto it = s["kv_donors"].begin(); it != s["kv_donors"].end(); ++it)
          if (it.value().is_number_integer())
            bs.kv_donors.emplace_back(layer_index_key(it.key(), path, where),
                                      it.value().get<int>());
      m.stages.push_back(std::move(bs));
    }
    if (j.contains("drafter")) {
      const json& d = j["drafter"];
      const std::string where = "drafter";
      BundleDrafter bd;
      bd.id = need(d, "id", where).get<std::string>();
      bd.placed_with = need(d, "placed_with", where).get<std::string>();
      bd.config_file = need(need(d, "config", where), "file", where + ".config").get<std::string>();
      bd.config_sha256 = d["config"].value("sha256", "");
      const json& wf = need(d, "weights", where);
      bd.weights_file = need(wf, "file", where + ".weights").get<std::string>();
      bd.sha256 = wf.value("sha256", "");
      bd.bytes = need(wf, "bytes", where + ".weights").get<uint64_t>();
      for (const std::string& f : {bd.config_file, bd.weights_file})
        if (f.find('/') != std::string::npos || f.find("..") != std::string::npos)
          fail(path, ": drafter file '", f, "' must be a plain file name inside the bundle");
      for (const json& r : need(need(d, "contract", where), "reads_kv", where + ".contract")) {
        const std::string kind = need(r, "kind", where + ".contract.reads_kv").get<std::string>();
        const int layer = need(r, "layer", where + ".contract.reads_kv").get<int>();
        if (kind == "sliding")
          bd.reads_sliding = layer;
        else if (kind == "full")
          bd.reads_full = layer;
        else
          fail(path, ": drafter.contract.reads_kv kind '", kind, "' is not sliding or full");
      }
      m.drafter = std::move(bd);
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(path, ": malformed manifest (", e.what(), "); re-export the bundle");
  }
  return m;
}

void export_bundle(const std::string& hf_dir, const std::string& out_dir,
                   const ExportOptions& opt) {
  const ModelConfig cfg = load_model_config(hf_dir);
  TensorStore store = TensorStore::open_dir(hf_dir);
  canonicalize_checkpoint_keys(cfg, store);
  validate_tensors(tensor_table(cfg), store, cfg);
  export_bundle_from(store, hf_dir, out_dir, opt);
}

void export_bundle_from(const TensorSource& store, const std::string& hf_dir,
                        const std::string& out_dir, const ExportOptions& opt) {
  const ModelConfig cfg = load_model_config(hf_dir);
  const DType w = weights_dtype(opt.weights);
  DType ple;
  if (opt.ple_weights == "auto")
    ple = w == DType::F32 ? DType::F32 : DType::BF16;
  else if (opt.ple_weights == "bf16")
    ple = DType::BF16;
  else if (opt.ple_weights == "int8")
    ple = DType::Q8_0;
  else if (opt.ple_weights == "f32")
    ple = DType::F32;
  else
    fail("--ple-weights must be bf16, int8 or f32; got '", opt.ple_weights, "'");
  const int64_t max_context =
      opt.max_context > 0 ? opt.max_context : cfg.text.max_position_embeddings;
  if (max_context > cfg.text.max_position_embeddings)
    fail("--max-context ", max_context, " exceeds the model's max_position_embeddings ",
         cfg.text.max_position_embeddings);
  const std::vector<LayerRange> ranges = parse_stage_spec(opt.stages, cfg.text);

  std::vector<StageDecl> decls;
  decls.push_back({"embeddings",
                   StageRole::Embeddings,
                   {0, 0},
                   contract_for(StageRole::Embeddings, {0, 0}, cfg)});
  for (const LayerRange& r : ranges)
    decls.push_back({stage_id(r), StageRole::TransformerLayers, r,
                     contract_for(StageRole::TransformerLayers, r, cfg)});
  decls.push_back({"head",
                   StageRole::FinalNormHead,
                   {0, 0},
                   contract_for(StageRole::FinalNormHead, {0, 0}, cfg)});
  check_contract_chain(decls, cfg);

  // -md: the drafter stage, placed with the last transformer stage, whose caches it reads.
  std::unique_ptr<AssistantModel> drafter;
  std::optional<TensorStore> drafter_store;
  AssistantDonors donors;
  const StageDecl& last_layers = decls[decls.size() - 2];
  if (!opt.drafter.empty()) {
    drafter = AssistantModel::open(opt.drafter);
    check_assistant_matches(drafter->config(), cfg, opt.drafter, hf_dir);
    drafter_store.emplace(TensorStore::open_dir(opt.drafter));
    donors = assistant_donor_layers(cfg.text);
    for (const int layer : {donors.sliding, donors.full})
      if (layer >= 0 && (layer < last_layers.layers.begin || layer >= last_layers.layers.end))
        fail("the drafter ", opt.drafter, " reads the KV cache of layer ", layer,
             ", which is not in the last transformer stage ", last_layers.id,
             " (the drafter stage is placed with it)");
  }

  const std::vector<std::string> old_files = prepare_output_dir(out_dir, opt.force);
  PartialFiles partial;
  bool old_retired = false;  // the old bundle's files are being removed: it is no longer whole
  try {
    // (partial name, final name) of every file written, renamed only once all are complete.
    std::vector<std::pair<std::string, std::string>> written;
    std::vector<std::vector<PlannedTensor>> plans;
    uint64_t total = 0;
    for (const StageDecl& d : decls) {
      plans.push_back(plan_stage_tensors(d, cfg, w, ple));
      for (const PlannedTensor& t : plans.back()) total += store.nbytes(t.key);
    }
    Progress progress("export", total, opt.progress);
    std::vector<std::string> kept_bf16;  // quantized matrices stored in bf16 instead (see above)
    json stages = json::array();
    for (size_t i = 0; i < decls.size(); ++i) {
      const StageDecl& d = decls[i];
      const std::string file = d.id + ".gsw";
      const std::string final_path = (fs::path(out_dir) / file).string();
      const std::string path = partial.add(final_path);
      WeightsFileWriter writer(path);
      for (const PlannedTensor& t : plans[i]) {
        writer.declare(t.key, t.dtype, t.shape);
        if (t.kept_bf16) kept_bf16.push_back(t.key);
      }
      writer.begin_data();
      for (const PlannedTensor& t : plans[i]) {
        const WeightView v = store.view(t.key);
        if (v.shape != t.shape)
          fail("tensor ", t.key, " of ", store.file_of(t.key), " has shape ", shape_str(v.shape),
               ", expected ", shape_str(t.shape));
        convert_rows(v, t.dtype, writer, progress);
        writer.end_tensor();
      }
      writer.finish();
      written.emplace_back(path, final_path);
      json s = {{"id", d.id},
                {"role", stage_role_name(d.role)},
                {"contract", contract_to_json(d.contract)},
                {"weights",
                 {{"file", file}, {"sha256", sha256_file(path)}, {"bytes", fs::file_size(path)}}}};
      if (d.role == StageRole::TransformerLayers) {
        s["layers"] = {d.layers.begin, d.layers.end};
        s["cache_groups"] = cache_groups_json(d.layers, cfg.text, max_context);
        s["kv_donors"] = kv_donors_json(d.layers, cfg.text);
      } else {
        s["layers"] = nullptr;
      }
      stages.push_back(s);
    }
    progress.finish();
    json drafter_json;
    if (drafter) {
      // Matrices in the bundle's format, vectors f32, the token ordering as stored (i64).
      const std::string final_path = (fs::path(out_dir) / kDrafterWeightsFile).string();
      const std::string path = partial.add(final_path);
      WeightsFileWriter writer(path);
      auto stored = [&](const WeightView& v) {
        if (v.dtype == DType::I64) return DType::I64;
        return v.shape.size() == 2 ? stored_dtype(w, v.shape) : DType::F32;
      };
      uint64_t bytes = 0;
      for (const std::string& key : drafter->tensor_keys()) {
        const WeightView v = drafter_store->view(key);
        writer.declare(key, stored(v), v.shape);
        if (v.shape.size() == 2 && kept_in_bf16(w, v.shape)) kept_bf16.push_back(key);
        bytes += v.nbytes;
      }
      writer.begin_data();
      Progress dp("export drafter", bytes, opt.progress);
      for (const std::string& key : drafter->tensor_keys()) {
        const WeightView v = drafter_store->view(key);
        if (stored(v) == DType::I64) {
          writer.write(v.data, v.nbytes);
          dp.advance(v.nbytes);
        } else {
          convert_rows(v, stored(v), writer, dp);
        }
        writer.end_tensor();
      }
      writer.finish();
      dp.finish();
      written.emplace_back(path, final_path);
      const std::string cfg_final = (fs::path(out_dir) / kDrafterConfigFile).string();
      const std::string cfg_path = partial.add(cfg_final);
      write_file_synced(cfg_path, read_text_file((fs::path(opt.drafter) / "config.json").string()));
      written.emplace_back(cfg_path, cfg_final);
      drafter_json = {{"id", "drafter"},
                      {"role", "mtp_drafter"},
                      {"source", fs::absolute(opt.drafter).string()},
                      {"placed_with", last_layers.id},
                      {"config", {{"file", kDrafterConfigFile}, {"sha256", sha256_file(cfg_path)}}},
                      {"weights",
                       {{"file", kDrafterWeightsFile},
                        {"sha256", sha256_file(path)},
                        {"bytes", fs::file_size(path)}}},
                      {"contract", drafter_contract_json(cfg, donors, last_layers.id)}};
    }
    json copied = json::object();
    for (const char* f : kCopiedFiles) {
      const fs::path src = fs::path(hf_dir) / f;
      if (!fs::exists(src)) continue;
      const std::string final_path = (fs::path(out_dir) / f).string();
      const std::string path = partial.add(final_path);
      write_file_synced(path, read_text_file(src.string()));
      written.emplace_back(path, final_path);
      copied[f] = {{"sha256", sha256_file(path)}};
    }
    const json model_config =
        json::parse(read_text_file((fs::path(hf_dir) / "config.json").string()));
    json manifest = {{"format", "gemstage-bundle"},
                     {"schema_version", kBundleSchemaVersion},
                     {"generator", "gemstage export"},
                     {"source_model", opt.source_description.empty() ? fs::absolute(hf_dir).string()
                                                                     : opt.source_description},
                     {"weights", opt.weights},
                     {"ple_weights", ple == DType::F32    ? "f32"
                                     : ple == DType::Q8_0 ? "int8"
                                                          : "bf16"},
                     {"max_context", max_context},
                     {"num_layers", cfg.text.num_hidden_layers},
                     {"model_config", model_config},
                     {"copied_files", copied},
                     {"stages", stages}};
    if (drafter) manifest["drafter"] = drafter_json;
    if (!kept_bf16.empty()) {
      manifest["kept_bf16"] = kept_bf16;
      {
        std::cerr << "export: " << kept_bf16.size() << " tensor(s) kept in bf16, their input width "
                  << "not being a multiple of the 32-wide " << opt.weights << " block:";
        for (const std::string& k : kept_bf16) std::cerr << " " << k;
        std::cerr << "\n";
      }
    }
    const std::string manifest_final = (fs::path(out_dir) / "manifest.json").string();
    const std::string manifest_path = partial.add(manifest_final);
    write_file_synced(manifest_path, manifest.dump(2) + "\n");

    // Everything is on disk. Retire the old bundle's manifest first (so the folder never pairs it
    // with new files), then its files the new bundle does not replace, then rename the new files
    // into place, manifest.json last.
    std::error_code ec;
    if (!old_files.empty()) {
      old_retired = true;
      fs::remove(manifest_final, ec);
      std::set<std::string> replaced;
      for (const auto& [from, to] : written) replaced.insert(fs::path(to).filename().string());
      for (const std::string& f : old_files)
        if (!replaced.count(f)) fs::remove(fs::path(out_dir) / f, ec);
    }
    for (const auto& [from, to] : written) rename_into_place(from, to);
    sync_dir(out_dir);
    rename_into_place(manifest_path, manifest_final);
    sync_dir(out_dir);
    partial.committed();
  } catch (const std::exception& e) {
    // Remove the partial files before saying so: a user looking at the folder after a disk-full
    // error wants to know what is (not) there.
    partial.remove_now();
    fail(e.what(), "\nexport stopped: its partial files were removed and ", out_dir,
         " holds no new bundle",
         old_files.empty() ? ""
         : old_retired     ? " (the bundle that was there is partly replaced: export again)"
                           : " (the bundle already there is unchanged)");
  }
}

int check_bundle(const std::string& dir, const CheckOptions& opt, std::ostream& log) {
  int failures = 0;
  auto run = [&](const std::string& name, const std::function<std::string()>& fn) {
    try {
      const std::string detail = fn();
      log << "PASS  " << name << (detail.empty() ? "" : ": " + detail) << "\n";
    } catch (const std::exception& e) {
      log << "FAIL  " << name << ": " << e.what() << "\n";
      ++failures;
    }
  };
  BundleManifest m;
  bool schema_ok = false;
  run("manifest schema", [&] {
    m = read_bundle_manifest(dir);
    schema_ok = true;
    return "version " + std::to_string(kBundleSchemaVersion) + ", " +
           std::to_string(m.stages.size()) + " stages, weights " + m.weights_format;
  });
  if (!schema_ok) return failures;
  const TextConfig& t = m.config.text;

  run("copied files match their hashes", [&] {
    for (const auto& [name, sha] : m.copied_files) {
      const std::string p = (fs::path(dir) / name).string();
      if (!fs::exists(p)) fail(name, " is listed in copied_files but missing");
      if (sha256_file(p) != sha)
        fail(name, " does not match its SHA-256 in the manifest (edited after export?)");
    }
    return std::to_string(m.copied_files.size()) + " files";
  });
  bool weights_ok = true;
  run("stage weights: size and SHA-256", [&] {
    weights_ok = false;
    for (const BundleStage& s : m.stages) {
      const std::string p = (fs::path(dir) / s.weights_file).string();
      if (!fs::exists(p))
        fail("stage '", s.decl.id, "': weights file ", s.weights_file, " is missing");
      const uint64_t size = fs::file_size(p);
      if (size != s.bytes)
        fail("stage '", s.decl.id, "': ", s.weights_file, " is ", size,
             " bytes, the manifest says ", s.bytes, " (truncated?)");
      if (sha256_file(p) != s.sha256)
        fail("stage '", s.decl.id, "': ", s.weights_file, " does not match its SHA-256");
    }
    weights_ok = true;
    return std::string();
  });
  run("stage weights: tensors present with the right shapes", [&] {
    const DType w = weights_dtype(m.weights_format);
    const DType ple = m.ple_weights_format == "int8"  ? DType::Q8_0
                      : m.ple_weights_format == "f32" ? DType::F32
                                                      : DType::BF16;
    size_t n = 0;
    std::map<std::string, Shape> want_shape;
    for (const TensorSpec& s : tensor_table(m.config)) want_shape[s.key] = s.shape;
    for (const BundleStage& s : m.stages) {
      WeightsFile f((fs::path(dir) / s.weights_file).string());
      for (const PlannedTensor& pt : plan_stage_tensors(s.decl, m.config, w, ple)) {
        if (!f.has(pt.key))
          fail("stage '", s.decl.id, "': ", s.weights_file, " lacks tensor ", pt.key);
        const WeightView v = f.view(pt.key);
        if (v.shape != want_shape[pt.key])
          fail("stage '", s.decl.id, "': tensor ", pt.key, " has shape ", shape_str(v.shape),
               ", expected ", shape_str(want_shape[pt.key]));
        ++n;
      }
    }
    return std::to_string(n) + " tensors";
  });
  if (m.drafter)
    run("drafter stage: files, placement, the KV it reads, tensors", [&] {
      const BundleDrafter& d = *m.drafter;
      for (const auto& [file, sha] :
           {std::pair{d.weights_file, d.sha256}, std::pair{d.config_file, d.config_sha256}}) {
        const std::string p = (fs::path(dir) / file).string();
        if (!fs::exists(p)) fail("drafter: ", file, " is missing");
        if (sha256_file(p) != sha) fail("drafter: ", file, " does not match its SHA-256");
      }
      if (fs::file_size(fs::path(dir) / d.weights_file) != d.bytes)
        fail("drafter: ", d.weights_file, " is not the ", d.bytes, " bytes the manifest says");
      // It reads the caches of the last transformer stage, so it runs where that stage does.
      const BundleStage* last = nullptr;
      for (const BundleStage& s : m.stages)
        if (s.decl.role == StageRole::TransformerLayers &&
            (!last || s.decl.layers.end > last->decl.layers.end))
          last = &s;
      if (!last) fail("drafter: the bundle has no transformer stage");
      if (d.placed_with != last->decl.id)
        fail("drafter stage '", d.id, "' is placed with '", d.placed_with,
             "', but it reads the KV caches of the last transformer stage '", last->decl.id,
             "' and must be placed with it");
      const AssistantDonors donors = assistant_donor_layers(t);
      if (d.reads_sliding != donors.sliding || d.reads_full != donors.full)
        fail("drafter: its contract reads the KV of layers ", d.reads_sliding, " (sliding) and ",
             d.reads_full, " (full); the model's donor layers are ", donors.sliding, " and ",
             donors.full);
      for (const int layer : {donors.sliding, donors.full})
        if (layer >= 0 && (layer < last->decl.layers.begin || layer >= last->decl.layers.end))
          fail("drafter: layer ", layer, " whose KV it reads is not in stage '", last->decl.id,
               "'");
      const auto drafter = open_bundle_drafter(dir, m);
      return "placed with " + last->decl.id + ", reads the KV of layers " +
             std::to_string(donors.sliding) + " (sliding) and " + std::to_string(donors.full) +
             " (full), " + std::to_string(drafter->tensor_keys().size()) + " tensors";
    });
  run("layer coverage and KV donor placement", [&] {
    std::vector<LayerRange> ranges;
    for (const BundleStage& s : m.stages)
      if (s.decl.role == StageRole::TransformerLayers) ranges.push_back(s.decl.layers);
    validate_stage_ranges(ranges, t);
    for (const BundleStage& s : m.stages)
      for (const auto& [layer, donor] : s.kv_donors)
        if (layer < 0 || layer >= t.num_hidden_layers ||
            t.layers[static_cast<size_t>(layer)].kv_donor != donor)
          fail("stage '", s.decl.id, "': kv_donors says layer ", layer, " reads layer ", donor,
               ", the config says ",
               layer >= 0 && layer < t.num_hidden_layers
                   ? t.layers[static_cast<size_t>(layer)].kv_donor
                   : -1);
    std::string r;
    for (const auto& x : ranges) {
      if (!r.empty()) r.push_back(',');
      r.append(x.str());
    }
    return r;
  });
  run("contracts match their roles and chain stage to stage", [&] {
    for (const BundleStage& s : m.stages) {
      const StageContract want = contract_for(s.decl.role, s.decl.layers, m.config);
      if (contract_to_json(want) != contract_to_json(s.decl.contract)) {
        // Name the first differing tensor before the generic message.
        std::vector<StageDecl> one = {s.decl};
        if (s.decl.role != StageRole::Embeddings) {
          StageDecl emb{"embeddings",
                        StageRole::Embeddings,
                        {0, 0},
                        contract_for(StageRole::Embeddings, {0, 0}, m.config)};
          one.insert(one.begin(), emb);
        }
        try {
          check_contract_chain(one, m.config);
        } catch (const Error& e) {
          if (std::string(e.what()).find("no stage produces logits") == std::string::npos) throw;
        }
        fail("stage '", s.decl.id, "': its contract differs from the ",
             stage_role_name(s.decl.role), " contract this gemstage runs (edited manifest?)");
      }
    }
    std::vector<StageDecl> decls;
    for (const BundleStage& s : m.stages) decls.push_back(s.decl);
    check_contract_chain(decls, m.config);
    return std::string();
  });
  run("cache groups sized for the window and the declared context", [&] {
    for (const BundleStage& s : m.stages) {
      if (s.decl.role != StageRole::TransformerLayers) continue;
      std::set<int> covered;
      for (const CacheGroup& g : s.cache_groups) {
        for (int l : g.layers) {
          if (l < s.decl.layers.begin || l >= s.decl.layers.end)
            fail("stage '", s.decl.id, "': cache group holds layer ", l, " outside its range ",
                 s.decl.layers.str());
          const LayerSpec& ls = t.layers[static_cast<size_t>(l)];
          if (ls.kv_shared)
            fail("stage '", s.decl.id, "': KV-shared layer ", l, " must not own a cache");
          if ((ls.type == LayerType::Sliding) != (g.kind == "sliding"))
            fail("stage '", s.decl.id, "': layer ", l, " is ", layer_type_name(ls.type),
                 " but sits in a ", g.kind, " cache group");
          covered.insert(l);
        }
        if (g.kind == "sliding" && (g.window != t.sliding_window || g.capacity < t.sliding_window))
          fail("stage '", s.decl.id, "': sliding cache capacity ", g.capacity, " / window ",
               g.window, " must hold the model's window of ", t.sliding_window);
        if (g.kind == "full" && g.capacity < m.max_context)
          fail("stage '", s.decl.id, "': full cache capacity ", g.capacity,
               " is below max_context ", m.max_context);
      }
      for (int l = s.decl.layers.begin; l < s.decl.layers.end; ++l)
        if (!t.layers[static_cast<size_t>(l)].kv_shared && !covered.count(l))
          fail("stage '", s.decl.id, "': layer ", l, " has no cache group");
    }
    return "max_context " + std::to_string(m.max_context);
  });
  if (!weights_ok || failures) return failures;

  run(std::string("probe: the bundle's stages on a prompt with an image (and a clip, with an "
                  "audio tower): PLE identity at placeholder rows is the PAD row, the splice "
                  "masks mark them") +
          (opt.reference_model.empty()
               ? " (the bundle against itself only: give --reference DIR to compare it with the "
                 "source checkpoint)"
               : ""),
      [&] { return run_probe(dir, m); });
  if (!opt.reference_model.empty()) {
    run("reference model: logits against " + opt.reference_model, [&] {
      auto ref = Sequence::open(opt.reference_model, 64);
      auto pipe = Sequence::open(dir, 64);
      std::vector<int32_t> ids = {ref->config().text.bos_token_id};
      std::mt19937 rng(99);
      for (int i = 0; i < 31; ++i)
        ids.push_back(static_cast<int32_t>(10 + rng() % 1000 % ref->config().text.vocab_size));
      ThreadPool pool(default_thread_count());
      const FloatTensor a = pipe->forward(pool, ids, nullptr, true, nullptr);
      const FloatTensor b = ref->forward(pool, ids, nullptr, true, nullptr);
      const int64_t V = ref->config().text.vocab_size;
      double d = 0;
      int agree = 0;
      for (size_t r = 0; r < ids.size(); ++r) {
        int64_t ia = 0, ib = 0;
        for (int64_t v = 0; v < V; ++v) {
          const size_t k = r * static_cast<size_t>(V) + static_cast<size_t>(v);
          d = std::max(d, static_cast<double>(std::fabs(a.data[k] - b.data[k])));
          if (a.data[k] > a.data[r * V + ia]) ia = v;
          if (b.data[k] > b.data[r * V + ib]) ib = v;
        }
        agree += ia == ib;
      }
      const double atol = opt.reference_atol >= 0      ? opt.reference_atol
                          : m.weights_format == "f32"  ? 1e-4
                          : m.weights_format == "bf16" ? 5e-2
                                                       : 1e9;
      std::ostringstream os;
      os << "max-abs " << d << ", top-1 agreement " << agree << "/" << ids.size();
      if (d > atol) fail(os.str(), " exceeds the tolerance ", atol);
      return os.str();
    });
  }
  return failures;
}

}  // namespace gemstage
