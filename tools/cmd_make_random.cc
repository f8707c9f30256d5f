// gemstage make-random: a random-weight Gemma 4 checkpoint in the exact hub layout and shapes,
// streamed to disk tensor by tensor (a 10 GB E2B never sits in memory).
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "gemma4/config.h"
#include "gemma4/presets.h"
#include "gemma4/registry.h"
#include "io/progress.h"
#include "stage/bundle.h"
#include "tools/commands.h"

namespace gemstage::cli {

namespace {

struct MakeRandomArgs {
  std::string preset = "tiny", dtype = "bf16", out;
  // Write a bundle with these weights (f32 | bf16 | q8_0 | q4_0) instead of a checkpoint.
  std::string bundle_weights, stages = "1";
  uint64_t seed = 1;
  int layers = 0;
  double shard_gb = 0;
  bool force = false;
  bool audio = false;  // add the E-series audio tower (Gemma4AudioConfig defaults)
};

// splitmix64: fast, seedable per tensor so output does not depend on write order.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Approximately N(0, 1): sum of four uniforms, rescaled (Irwin-Hall); plenty for random weights.
  float normal() {
    const uint64_t a = next(), b = next();
    const float u =
        static_cast<float>((a & 0xffffffffu) + (a >> 32) + (b & 0xffffffffu) + (b >> 32)) *
        (1.0f / 4294967296.0f);
    return (u - 2.0f) * 1.7320508f;
  }
};

uint64_t hash_key(const std::string& k, uint64_t seed) {
  uint64_t h = 1469598103934665603ull ^ seed;
  for (unsigned char c : k) h = (h ^ c) * 1099511628211ull;
  return h;
}

bool ends_with(const std::string& s, const std::string& suf) {
  return s.size() >= suf.size() && s.compare(s.size() - suf.size(), suf.size(), suf) == 0;
}

// The value of element i of tensor `key` (same init family as the fixture generator).
struct Init {
  float mean = 0, std = 0.02f;
  bool constant = false;
};
Init init_for(const std::string& key) {
  if (ends_with(key, "norm.weight") || key.find(".norm_") != std::string::npos ||
      ends_with(key, "_ln1.weight") || ends_with(key, "_ln2.weight"))
    return {1.0f, 0.05f};
  if (ends_with(key, "layer_scalar")) return {1.0f, 0.0f};
  // Multipliers around 1: the router's scales and the vision standardization.
  if (ends_with(key, "scale")) return {1.0f, 0.05f};
  if (ends_with(key, "position_embedding_table")) return {0.0f, 0.1f};
  if (ends_with(key, "input_min") || ends_with(key, "output_min")) return {-8.0f, 0, true};
  if (ends_with(key, "input_max") || ends_with(key, "output_max")) return {8.0f, 0, true};
  return {0.0f, 0.02f};
}

// The values of one tensor, in order: what the checkpoint stores (before its dtype's rounding).
struct ValueStream {
  Init init;
  Rng rng;
  bool unit;  // layer_scalar: 1
  ValueStream(const std::string& key, uint64_t seed)
      : init(init_for(key)), rng{hash_key(key, seed)}, unit(ends_with(key, "layer_scalar")) {}
  float next() {
    const float v = init.constant ? init.mean : init.mean + init.std * rng.normal();
    return unit ? 1.0f : v;
  }
};

// The same tensors as the checkpoint make-random writes (the same values, rounded to the same
// dtype), generated one tensor at a time when export asks for it: a random model goes straight
// into a (4-bit) bundle without its 50-60 GB bf16 checkpoint on disk first.
class RandomSource : public TensorSource {
 public:
  RandomSource(const std::vector<TensorSpec>& specs, uint64_t seed, DType dt)
      : seed_(seed), dt_(dt) {
    for (const TensorSpec& s : specs) shapes_[s.key] = s.shape;
  }
  bool has(const std::string& key) const override { return shapes_.count(key) != 0; }
  size_t nbytes(const std::string& key) const override {
    return static_cast<size_t>(shape_numel(shape_of(key))) * dtype_size(dt_);
  }
  WeightView view(const std::string& key) const override {
    const Shape& shape = shape_of(key);
    if (key != cached_) {  // export reads each tensor once, in order
      const int64_t n = shape_numel(shape);
      buf_.resize(static_cast<size_t>(n) * dtype_size(dt_));
      ValueStream vs(key, seed_);
      for (int64_t i = 0; i < n; ++i) {
        const float v = vs.next();
        if (dt_ == DType::F32) {
          std::memcpy(&buf_[static_cast<size_t>(i) * 4], &v, 4);
        } else {
          const uint16_t h = dt_ == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
          std::memcpy(&buf_[static_cast<size_t>(i) * 2], &h, 2);
        }
      }
      cached_ = key;
    }
    WeightView w;
    w.name = key;
    w.dtype = dt_;
    w.shape = shape;
    w.data = buf_.data();
    w.nbytes = buf_.size();
    return w;
  }
  std::string file_of(const std::string&) const override { return "(make-random generator)"; }
  std::vector<std::string> keys() const override {
    std::vector<std::string> k;
    for (const auto& [key, shape] : shapes_) k.push_back(key);
    return k;
  }

 private:
  const Shape& shape_of(const std::string& key) const {
    auto it = shapes_.find(key);
    if (it == shapes_.end()) fail("make-random: no tensor ", key, " in the preset");
    return it->second;
  }
  uint64_t seed_;
  DType dt_;
  std::map<std::string, Shape> shapes_;
  mutable std::string cached_;
  mutable std::vector<char> buf_;
};

// The small files of a checkpoint (config, generation and processor settings).
void write_config_files(const std::string& dir, const nlohmann::json& cfg_json,
                        const std::string& preset) {
  namespace fs = std::filesystem;
  std::ofstream(fs::path(dir) / "config.json") << cfg_json.dump(2);
  nlohmann::json gen = {{"bos_token_id", 2}, {"eos_token_id", {1, 106, 50}}, {"pad_token_id", 0},
                        {"do_sample", true}, {"temperature", 1.0},           {"top_k", 64},
                        {"top_p", 0.95}};
  // gemma4_unified never generates <audio|> / <image|> (generation_config.json of the 12B).
  if (preset == "12b") gen["suppress_tokens"] = {258883, 258882};
  std::ofstream(fs::path(dir) / "generation_config.json") << gen.dump(2);
  const int soft = preset == "tiny" ? 70 : 280;
  const nlohmann::json pre = {{"image_processor_type", "Gemma4ImageProcessor"},
                              {"processor_class", "Gemma4Processor"},
                              {"patch_size", 16},
                              {"pooling_kernel_size", 3},
                              {"max_soft_tokens", soft},
                              {"image_seq_length", soft},
                              {"do_resize", true},
                              {"resample", 3},
                              {"do_rescale", true},
                              {"rescale_factor", 1.0 / 255.0},
                              {"do_normalize", false},
                              {"image_mean", {0.0, 0.0, 0.0}},
                              {"image_std", {1.0, 1.0, 1.0}},
                              {"do_convert_rgb", true}};
  std::ofstream(fs::path(dir) / "preprocessor_config.json") << pre.dump(2);
}

// The tensors of a gemma4_assistant checkpoint (docs/gemma4-mtp.md): the drafter's Q-only
// layers (no k/v projections: it reads the target's caches), the projections to and from the
// target's width, the tied head.
std::vector<TensorSpec> assistant_tensor_specs(const nlohmann::json& cfg) {
  const nlohmann::json& t = cfg["text_config"];
  const int64_t Ha = t["hidden_size"], Ht = cfg["backbone_hidden_size"], V = t["vocab_size"],
                I = t["intermediate_size"], H = t["num_attention_heads"];
  std::vector<TensorSpec> specs;
  const auto add = [&](std::string key, Shape shape) {
    TensorSpec s;
    s.key = std::move(key);
    s.shape = std::move(shape);
    specs.push_back(std::move(s));
  };
  add("model.embed_tokens.weight", {V, Ha});
  add("model.norm.weight", {Ha});
  add("pre_projection.weight", {Ha, 2 * Ht});
  add("post_projection.weight", {Ht, Ha});
  const auto& types = t["layer_types"];
  for (size_t i = 0; i < types.size(); ++i) {
    const bool full = types[i] == "full_attention";
    const int64_t hd = full ? t["global_head_dim"].get<int64_t>() : t["head_dim"].get<int64_t>();
    const std::string l = "model.layers." + std::to_string(i) + ".";
    add(l + "self_attn.q_proj.weight", {H * hd, Ha});
    add(l + "self_attn.q_norm.weight", {hd});
    add(l + "self_attn.o_proj.weight", {Ha, H * hd});
    add(l + "mlp.gate_proj.weight", {I, Ha});
    add(l + "mlp.up_proj.weight", {I, Ha});
    add(l + "mlp.down_proj.weight", {Ha, I});
    for (const char* n : {"input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm"})
      add(l + n + ".weight", {Ha});
    add(l + "layer_scalar", {1});
  }
  return specs;
}

int run_make_random(const MakeRandomArgs& a) {
  namespace fs = std::filesystem;
  const DType dt = a.dtype == "f32" ? DType::F32 : a.dtype == "f16" ? DType::F16 : DType::BF16;
  const std::string st_dtype(dtype_name(dt));
  const std::string cfg_dtype = dt == DType::F32   ? "float32"
                                : dt == DType::F16 ? "float16"
                                                   : "bfloat16";
  const bool assistant = is_assistant_preset(a.preset);
  if (assistant && (!a.bundle_weights.empty() || a.layers > 0 || a.audio))
    fail("make-random: --preset ", a.preset,
         " writes a drafter checkpoint only (no --bundle, --layers or --audio); put it in a "
         "bundle with export --model-draft, or pass it to bench / serve with -md");
  const nlohmann::json cfg_json = assistant ? assistant_preset_config(a.preset, cfg_dtype)
                                            : preset_config(a.preset, a.layers, cfg_dtype);
  nlohmann::json cfg_out = cfg_json;
  if (a.audio && cfg_out.value("model_type", "") == "gemma4_unified")
    fail(
        "make-random: --audio adds the E-series audio tower; the 12b preset has its audio "
        "embedder already");
  if (a.audio) cfg_out["audio_config"] = {{"model_type", "gemma4_audio"}};
  std::vector<TensorSpec> specs;
  if (assistant) {
    specs = assistant_tensor_specs(cfg_out);
  } else {
    const ModelConfig cfg = parse_model_config(cfg_out.dump(), a.preset + " preset");
    specs = text_tensor_specs(cfg);
    const auto vision = vision_tensor_specs(cfg);
    specs.insert(specs.end(), vision.begin(), vision.end());
    const auto audio = audio_tensor_specs(cfg);
    specs.insert(specs.end(), audio.begin(), audio.end());
    const auto unified = unified_tensor_specs(cfg);
    specs.insert(specs.end(), unified.begin(), unified.end());
  }
  // The hub checkpoint does not store the tied lm_head; it does store KV-shared layers' k/v.
  std::erase_if(specs, [](const TensorSpec& s) { return s.key == "lm_head.weight"; });
  std::sort(specs.begin(), specs.end(), [](const auto& x, const auto& y) { return x.key < y.key; });

  if (!a.bundle_weights.empty()) {
    // Straight into a bundle: the config files go to a scratch folder export reads them from.
    const fs::path assets =
        fs::temp_directory_path() / ("gemstage_make_random_" + std::to_string(::getpid()));
    fs::create_directories(assets);
    write_config_files(assets.string(), cfg_out, a.preset);
    ExportOptions opt;
    opt.weights = a.bundle_weights;
    opt.stages = a.stages;
    opt.force = a.force;
    opt.source_description = "make-random --preset " + a.preset + " --seed " +
                             std::to_string(a.seed) + " --dtype " + a.dtype;
    try {
      export_bundle_from(RandomSource(specs, a.seed, dt), assets.string(), a.out, opt);
    } catch (...) {
      fs::remove_all(assets);
      throw;
    }
    fs::remove_all(assets);
    std::cerr << "wrote a random " << a.preset << " bundle (" << a.bundle_weights
              << ", values as a " << a.dtype << " checkpoint of seed " << a.seed
              << " holds them) to " << a.out << "\n";
    return 0;
  }
  if (fs::exists(a.out) && !fs::is_empty(a.out) && !a.force)
    fail(a.out, " exists and is not empty; pass --force to overwrite");
  fs::create_directories(a.out);

  // Plan shards by cumulative size, then write each file's header before its data.
  const uint64_t shard_limit =
      a.shard_gb > 0 ? static_cast<uint64_t>(a.shard_gb * 1e9) : UINT64_MAX;
  std::vector<std::vector<const TensorSpec*>> shards(1);
  uint64_t cur = 0, total = 0;
  for (const auto& s : specs) {
    const uint64_t bytes = static_cast<uint64_t>(shape_numel(s.shape)) * dtype_size(dt);
    if (cur > 0 && cur + bytes > shard_limit) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(&s);
    cur += bytes;
    total += bytes;
  }
  auto shard_name = [&](size_t i) {
    if (shards.size() == 1) return std::string("model.safetensors");
    char buf[64];
    std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", i + 1, shards.size());
    return std::string(buf);
  };

  Progress progress("make-random " + a.preset, total);
  nlohmann::json index = {{"metadata", {{"total_size", total}}},
                          {"weight_map", nlohmann::json::object()}};
  std::vector<char> buf;
  for (size_t si = 0; si < shards.size(); ++si) {
    nlohmann::json header = {{"__metadata__", {{"format", "pt"}}}};
    uint64_t off = 0;
    for (const TensorSpec* s : shards[si]) {
      const uint64_t bytes = static_cast<uint64_t>(shape_numel(s->shape)) * dtype_size(dt);
      header[s->key] = {
          {"dtype", st_dtype}, {"shape", s->shape}, {"data_offsets", {off, off + bytes}}};
      off += bytes;
      index["weight_map"][s->key] = shard_name(si);
    }
    std::string h = header.dump();
    h.append((8 - h.size() % 8) % 8, ' ');  // keep the data section 8-byte aligned
    const std::string path = (fs::path(a.out) / shard_name(si)).string();
    std::ofstream out(path, std::ios::binary);
    if (!out) fail(path, ": cannot open for writing");
    const uint64_t hl = h.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((hl >> (8 * i)) & 0xff);
    out.write(len, 8);
    out.write(h.data(), static_cast<std::streamsize>(h.size()));
    for (const TensorSpec* s : shards[si]) {
      const int64_t n = shape_numel(s->shape);
      ValueStream vs(s->key, a.seed);
      constexpr int64_t kChunk = 1 << 20;
      for (int64_t b = 0; b < n; b += kChunk) {
        const int64_t m = std::min(kChunk, n - b);
        buf.resize(static_cast<size_t>(m) * dtype_size(dt));
        for (int64_t i = 0; i < m; ++i) {
          const float v = vs.next();
          if (dt == DType::F32)
            std::memcpy(&buf[static_cast<size_t>(i) * 4], &v, 4);
          else {
            const uint16_t hv = dt == DType::BF16 ? f32_to_bf16(v) : f32_to_f16(v);
            std::memcpy(&buf[static_cast<size_t>(i) * 2], &hv, 2);
          }
        }
        out.write(buf.data(), static_cast<std::streamsize>(buf.size()));
        progress.advance(buf.size());
      }
    }
    if (!out) fail(path, ": write failed (disk full?)");
  }
  progress.finish();
  if (shards.size() > 1)
    std::ofstream(fs::path(a.out) / "model.safetensors.index.json") << index.dump(2);
  if (assistant)  // a drafter has no generation or processor settings of its own
    std::ofstream(fs::path(a.out) / "config.json") << cfg_out.dump(2);
  else
    write_config_files(a.out, cfg_out, a.preset);
  std::cerr << "wrote " << specs.size() << " tensors (" << static_cast<double>(total) / 1e9
            << " GB, " << shards.size() << " file" << (shards.size() > 1 ? "s" : "") << ") to "
            << a.out << "; no tokenizer is written (random weights; use --ids with dump/bench)\n";
  return 0;
}

}  // namespace

void add_make_random_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<MakeRandomArgs>();
  auto* sub = app.add_subcommand("make-random",
                                 "Write a random-weight Gemma 4 checkpoint in the hub layout");
  sub->add_option("--preset", a->preset,
                  "tiny | e2b | e4b | 26b-a4b | 31b | 12b, or a drafter for a large target: "
                  "26b-a4b-assistant | 31b-assistant")
      ->check(CLI::IsMember(
          {"tiny", "e2b", "e4b", "26b-a4b", "31b", "12b", "26b-a4b-assistant", "31b-assistant"}))
      ->capture_default_str();
  sub->add_option("--seed", a->seed, "random seed")->capture_default_str();
  sub->add_option("--dtype", a->dtype, "f32 | bf16 | f16")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  sub->add_option("--out", a->out, "output directory")->required();
  sub->add_option("--layers", a->layers,
                  "shorten the text stack to N layers (tests); default: the preset's");
  sub->add_option("--shard-gb", a->shard_gb,
                  "split into shards of at most this many GB with model.safetensors.index.json");
  sub->add_flag("--force", a->force, "overwrite a non-empty output directory");
  sub->add_option("--bundle", a->bundle_weights,
                  "write a gemstage bundle with these weights instead of a checkpoint (no "
                  "checkpoint on disk first; the same weights as make-random + export)")
      ->check(CLI::IsMember({"f32", "bf16", "q8_0", "q4_0"}));
  sub->add_option("--stages", a->stages, "with --bundle: as export --stages")
      ->capture_default_str();
  sub->add_flag("--audio", a->audio,
                "add the E-series audio tower (audio_config with Gemma4AudioConfig's defaults)");
  reg.add(sub, [a] { return run_make_random(*a); });
}

}  // namespace gemstage::cli
