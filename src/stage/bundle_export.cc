// Writing a bundle: export_bundle (stage/bundle.h).
#include <filesystem>
#include <iostream>
#include <set>

#include "core/error.h"
#include "io/progress.h"
#include "kernels/quant.h"
#include "kernels/weight_rows.h"
#include "stage/bundle.h"
#include "stage/bundle_plan.h"
#include "stage/sequence.h"
#include "stage/weights_file.h"

namespace gemstage {

namespace fs = std::filesystem;
using nlohmann::json;
using namespace bundle_plan;

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

std::string stage_id(const LayerRange& r) {
  return "layers_" + std::to_string(r.begin) + "_" + std::to_string(r.end);
}

constexpr const char* kDrafterConfigFile = "drafter_config.json";
constexpr const char* kDrafterWeightsFile = "drafter.gsw";

// The drafter stage's contract: what one draft step takes and gives, and the target state it
// reads in place (the KV of two target layers, the target's embedding table).
json drafter_contract_json(const ModelConfig& c, const AssistantDonors& donors,
                           const std::string& placed_with) {
  json j = contract_to_json(contract_for(StageRole::Drafter, {0, 0}, c));
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

constexpr const char* kPartialSuffix = ".gemstage-partial";

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

}  // namespace gemstage
