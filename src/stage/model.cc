#include "stage/model.h"

#include <filesystem>
#include <optional>

#include "core/error.h"
#include "gemma4/registry.h"
#include "gemma4/unified_embedder.h"
#include "stage/bundle.h"
#include "stage/weights_file.h"

namespace gemstage {

Model::~Model() = default;

namespace {
// Quantized (q8_0/q4_0) weights round far more than a bf16 cache does, and halve the cache
// traffic at depth; f32 and bf16 weights compute in f32 as the reference does.
KvType kv_type_for_weights(const std::string& weights_format) {
  return weights_format == "q8_0" || weights_format == "q4_0" ? KvType::BF16 : KvType::F32;
}
bool same_path(const std::string& a, const std::string& b) {
  std::error_code ec1, ec2;
  const auto ca = std::filesystem::weakly_canonical(a, ec1);
  const auto cb = std::filesystem::weakly_canonical(b, ec2);
  return ec1 || ec2 ? a == b : ca == cb;
}
}  // namespace

ModelOpener::ModelOpener(std::string bundle, StagePlacementOptions placement)
    : bundle_(std::move(bundle)), placement_(std::move(placement)) {}

std::shared_ptr<const Model> ModelOpener::open(const std::string& path) const {
  if (placement_ && same_path(path, bundle_)) return Model::open(path, *placement_);
  return Model::open(path);
}

std::shared_ptr<const Model> Model::open(const std::string& path) {
  return open(path, StagePlacementOptions{});
}

std::shared_ptr<const Model> Model::open(const std::string& path,
                                         const StagePlacementOptions& placement) {
  const bool placed = !placement.local.empty() || placement.remote;
  std::shared_ptr<Model> m(new Model());
  m->path_ = path;
  std::vector<std::pair<StageDecl, std::shared_ptr<TensorSource>>> plan;
  if (is_bundle_dir(path)) {
    m->is_bundle_ = true;
    const BundleManifest bm = read_bundle_manifest(path);
    m->config_ = std::make_unique<ModelConfig>(bm.config);
    m->notes_ = bm.config.warnings;
    m->max_context_ = bm.max_context;
    // A stage placed in another process is not even mapped here: each process's memory is its
    // own stages' weights and caches.
    for (const BundleStage& bs : bm.stages)
      plan.emplace_back(bs.decl, !placed || placement.local.count(bs.decl.id)
                                     ? std::make_shared<WeightsFile>(
                                           (std::filesystem::path(path) / bs.weights_file).string())
                                     : nullptr);
    // The bundle's one weights format sets the KV row type, also when every transformer stage
    // runs in another process. A checkpoint's weights are float, so it keeps the f32 default.
    m->default_kv_type_ = kv_type_for_weights(bm.weights_format);
  } else {
    if (placed)
      fail(path,
           ": only a bundle's stages run in separate processes; export one first "
           "(gemstage export -m ",
           path, " -o BUNDLE --stages N)");
    m->config_ = std::make_unique<ModelConfig>(load_model_config(path));
    const ModelConfig& c = *m->config_;
    auto store = std::make_shared<TensorStore>(TensorStore::open_dir(path));
    canonicalize_checkpoint_keys(c, *store);
    const auto unknown = validate_tensors(tensor_table(c), *store, c);
    m->notes_ = c.warnings;
    for (const auto& k : unknown)
      m->notes_.push_back("tensor " + k + " is not used by gemstage; ignored");
    m->max_context_ = c.text.max_position_embeddings;
    const int L = c.text.num_hidden_layers;
    const LayerRange all{0, L};
    plan.emplace_back(StageDecl{"embeddings",
                                StageRole::Embeddings,
                                {0, 0},
                                contract_for(StageRole::Embeddings, {0, 0}, c)},
                      store);
    plan.emplace_back(StageDecl{"layers_0_" + std::to_string(L), StageRole::TransformerLayers, all,
                                contract_for(StageRole::TransformerLayers, all, c)},
                      store);
    plan.emplace_back(StageDecl{"head",
                                StageRole::FinalNormHead,
                                {0, 0},
                                contract_for(StageRole::FinalNormHead, {0, 0}, c)},
                      store);
  }
  for (auto& [decl, source] : plan) {
    m->decls_.push_back(decl);
    const bool here = !placed || placement.local.count(decl.id) > 0;
    m->stages_.push_back(here ? std::make_unique<Stage>(*m->config_, decl, source) : nullptr);
    m->remote_.push_back(!here && placement.remote ? placement.remote(decl) : nullptr);
  }
  check_contract_chain(m->decls_, *m->config_);
  if (m->decls_.empty() || m->decls_.front().role != StageRole::Embeddings)
    fail(path, ": the first stage must be the embeddings stage");
  return m;
}

const Stage* Model::find_stage(const std::string& id) const {
  for (const auto& s : stages_)
    if (s && s->id() == id) return s.get();
  return nullptr;
}

const Stage& Model::embeddings() const {
  for (const auto& s : stages_)
    if (s && s->role() == StageRole::Embeddings) return *s;
  fail(path_, ": no embeddings stage in this process (it runs on rank 0 of a distributed run)");
}

double Model::decode_weight_bytes() const {
  double b = 0;
  for (const auto& s : stages_)
    if (s) b += s->decode_weight_bytes();
  for (const auto& r : remote_)
    if (r) b += r->decode_weight_bytes();
  return b;
}

std::string Model::stage_failure() const {
  for (const auto& r : remote_)
    if (r)
      if (std::string f = r->failure(); !f.empty()) return f;
  return {};
}

}  // namespace gemstage
