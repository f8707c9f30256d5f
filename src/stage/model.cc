#include "stage/model.h"

#include <filesystem>

#include "core/error.h"
#include "gemma4/registry.h"
#include "gemma4/unified_embedder.h"
#include "stage/bundle.h"
#include "stage/weights_file.h"

namespace gemstage {

Model::~Model() = default;

std::shared_ptr<const Model> Model::open(const std::string& path) {
  std::shared_ptr<Model> m(new Model());
  m->path_ = path;
  std::vector<std::pair<StageDecl, std::shared_ptr<TensorSource>>> plan;
  if (is_bundle_dir(path)) {
    m->is_bundle_ = true;
    const BundleManifest bm = read_bundle_manifest(path);
    m->config_ = std::make_unique<ModelConfig>(bm.config);
    m->notes_ = bm.config.warnings;
    m->max_context_ = bm.max_context;
    for (const BundleStage& bs : bm.stages)
      plan.emplace_back(bs.decl, std::make_shared<WeightsFile>(
                                     (std::filesystem::path(path) / bs.weights_file).string()));
  } else {
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
    m->stages_.push_back(std::make_unique<Stage>(*m->config_, decl, source));
  }
  check_contract_chain(m->decls_, *m->config_);
  if (m->decls_.empty() || m->decls_.front().role != StageRole::Embeddings)
    fail(path, ": the first stage must be the embeddings stage");
  for (const auto& s : m->stages_) {
    if (s->role() != StageRole::TransformerLayers) continue;
    const auto& layer = s->text().weights().layers[static_cast<size_t>(s->decl().layers.begin)];
    const DType w = layer.q_proj.dtype;
    m->default_kv_type_ = w == DType::Q8_0 || w == DType::Q4_0 ? KvType::BF16 : KvType::F32;
    break;
  }
  return m;
}

const Stage* Model::find_stage(const std::string& id) const {
  for (const auto& s : stages_)
    if (s->id() == id) return s.get();
  return nullptr;
}

const Stage& Model::embeddings() const {
  for (const auto& s : stages_)
    if (s->role() == StageRole::Embeddings) return *s;
  fail(path_, ": no embeddings stage");
}

double Model::decode_weight_bytes() const {
  double b = 0;
  for (const auto& s : stages_) b += s->decode_weight_bytes();
  return b;
}

}  // namespace gemstage
