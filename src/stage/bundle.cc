#include "stage/bundle.h"

#include <openssl/evp.h>

#include <charconv>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <sstream>

#include "core/error.h"
#include "stage/bundle_plan.h"
#include "stage/weights_file.h"

namespace gemstage {

namespace fs = std::filesystem;
using nlohmann::json;
namespace bundle_plan {

DType weights_dtype(const std::string& s) {
  if (s == "f32") return DType::F32;
  if (s == "bf16") return DType::BF16;
  if (s == "q8_0") return DType::Q8_0;
  if (s == "q4_0") return DType::Q4_0;
  fail("--weights must be f32, bf16, q8_0 or q4_0; got '", s, "'");
}

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

}  // namespace bundle_plan

namespace {

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

// A kv_donors key: a layer index written as a decimal string.
int layer_index_key(const std::string& key, const std::string& path, const std::string& where) {
  int v = 0;
  const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), v);
  if (ec != std::errc() || end != key.data() + key.size() || v < 0)
    fail(path, ": ", where, ".kv_donors key '", key, "' is not a layer index");
  return v;
}

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
      if (bs.decl.role == StageRole::Drafter)
        fail(path, ": ", where,
             " has role drafter; a drafter belongs in the manifest's "
             "\"drafter\" section (export -md writes it there)");
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

}  // namespace gemstage
