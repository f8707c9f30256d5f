#include "stage/pipeline.h"

#include <filesystem>

#include "core/error.h"
#include "gemma4/multimodal.h"
#include "gemma4/registry.h"
#include "runtime/kv_cache.h"
#include "stage/bundle.h"
#include "stage/weights_file.h"

namespace gemstage {

struct Pipeline::RuntimeStage {
  StageDecl decl;
  std::shared_ptr<TensorSource> weights;
  std::unique_ptr<TextModel> model;
  std::unique_ptr<KvCache> cache;
};

Pipeline::~Pipeline() = default;

const std::vector<StageDecl>& Pipeline::stages() const {
  return decls_;
}

namespace {
TextParts parts_for(const StageDecl& d) {
  TextParts p = TextParts::none();
  if (d.role == StageRole::Embeddings) p.embeddings = true;
  if (d.role == StageRole::FinalNormHead) p.head = true;
  if (d.role == StageRole::TransformerLayers) {
    p.layer_begin = d.layers.begin;
    p.layer_end = d.layers.end;
  }
  return p;
}
}  // namespace

std::unique_ptr<Pipeline> Pipeline::open(const std::string& path, int64_t max_context) {
  std::unique_ptr<Pipeline> p(new Pipeline());
  p->path_ = path;
  if (is_bundle_dir(path)) {
    p->is_bundle_ = true;
    const BundleManifest m = read_bundle_manifest(path);
    p->config_ = m.config;
    p->notes_ = m.config.warnings;
    for (const BundleStage& bs : m.stages) {
      auto rs = std::make_unique<RuntimeStage>();
      rs->decl = bs.decl;
      rs->weights =
          std::make_shared<WeightsFile>((std::filesystem::path(path) / bs.weights_file).string());
      p->sources_.push_back(rs->weights);
      p->stages_.push_back(std::move(rs));
    }
    if (max_context <= 0) max_context = m.max_context;
    if (max_context > m.max_context)
      fail(path, ": context ", max_context, " exceeds the bundle's declared max_context ",
           m.max_context, "; re-export with --max-context ", max_context);
  } else {
    p->config_ = load_model_config(path);
    auto store = std::make_shared<TensorStore>(TensorStore::open_dir(path));
    std::vector<TensorSpec> specs = text_tensor_specs(p->config_);
    const auto vision = vision_tensor_specs(p->config_);
    specs.insert(specs.end(), vision.begin(), vision.end());
    const auto unknown = validate_tensors(specs, *store, p->config_);
    p->notes_ = p->config_.warnings;
    for (const auto& k : unknown)
      p->notes_.push_back("tensor " + k + " is not used by gemstage; ignored");
    p->sources_.push_back(store);
    const int L = p->config_.text.num_hidden_layers;
    const std::vector<StageDecl> decls = {
        {"embeddings",
         StageRole::Embeddings,
         {0, 0},
         contract_for(StageRole::Embeddings, {0, 0}, p->config_)},
        {"layers_0_" + std::to_string(L),
         StageRole::TransformerLayers,
         {0, L},
         contract_for(StageRole::TransformerLayers, {0, L}, p->config_)},
        {"head",
         StageRole::FinalNormHead,
         {0, 0},
         contract_for(StageRole::FinalNormHead, {0, 0}, p->config_)}};
    for (const StageDecl& d : decls) {
      auto rs = std::make_unique<RuntimeStage>();
      rs->decl = d;
      rs->weights = store;
      p->stages_.push_back(std::move(rs));
    }
  }
  if (max_context <= 0) max_context = p->config_.text.max_position_embeddings;
  p->max_context_ = max_context;
  for (auto& rs : p->stages_) {
    p->decls_.push_back(rs->decl);
    rs->model = std::make_unique<TextModel>(
        p->config_, bind_text_weights(p->config_, *rs->weights, parts_for(rs->decl)));
  }
  if (p->config_.vision)
    for (auto& rs : p->stages_)
      if (rs->decl.role == StageRole::Embeddings)
        p->vision_ = std::make_unique<VisionTower>(p->config_,
                                                   bind_vision_weights(p->config_, *rs->weights));
  check_contract_chain(p->decls_, p->config_);
  for (auto& rs : p->stages_) {
    if (rs->decl.role != StageRole::TransformerLayers) continue;
    const auto& layer = rs->model->weights().layers[static_cast<size_t>(rs->decl.layers.begin)];
    const DType w = layer.q_proj.dtype;
    p->kv_type_ = w == DType::Q8_0 || w == DType::Q4_0 ? KvType::BF16 : KvType::F32;
    break;
  }
  p->build_caches();
  return p;
}

void Pipeline::build_caches() {
  for (auto& rs : stages_)
    if (rs->decl.role == StageRole::TransformerLayers)
      rs->cache = std::make_unique<KvCache>(config_.text, max_context_, rs->decl.layers.begin,
                                            rs->decl.layers.end, kv_type_);
  n_past_ = 0;
}

void Pipeline::reset(int64_t max_context) {
  if (max_context > 0) max_context_ = max_context;
  build_caches();
}

void Pipeline::set_kv_type(KvType t) {
  kv_type_ = t;
  build_caches();
}

bool Pipeline::truncate(int64_t n) {
  if (n < 0 || n > n_past_) return false;
  for (auto& rs : stages_)
    if (rs->cache && !rs->cache->can_truncate(n)) return false;
  for (auto& rs : stages_)
    if (rs->cache) rs->cache->truncate(n);
  n_past_ = n;
  return true;
}

double Pipeline::decode_weight_bytes() const {
  double b = 0;
  for (const auto& rs : stages_) {
    const TextWeights& w = rs->model->weights();
    if (rs->decl.role == StageRole::FinalNormHead) b += static_cast<double>(w.embed_tokens.nbytes);
    if (rs->decl.role != StageRole::TransformerLayers) continue;
    for (const TextLayerWeights& l : w.layers)
      if (l.bound)
        for (const WeightView* v :
             {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj,
              &l.per_layer_input_gate, &l.per_layer_projection})
          b += static_cast<double>(v->nbytes);
  }
  return b;
}

const TextModel& Pipeline::embeddings_model() const {
  for (const auto& rs : stages_)
    if (rs->decl.role == StageRole::Embeddings) return *rs->model;
  fail(path_, ": no embeddings stage");
}

FloatTensor Pipeline::forward(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, bool all_logits, TapRecorder* taps,
                              const TextRunOptions& opt) {
  const int64_t S = static_cast<int64_t>(ids.size());
  if (S == 0) fail("forward: no tokens");
  if (n_past_ + S > max_context_)
    fail("context limit reached: ", n_past_ + S, " tokens exceed the context size of ",
         max_context_, " (raise --ctx-size / -c, up to the model's max_position_embeddings of ",
         config_.text.max_position_embeddings, ")");
  EmbeddingsOutput e;
  FloatTensor logits;
  for (auto& rs : stages_) {
    switch (rs->decl.role) {
      case StageRole::Embeddings:
        e = rs->model->embed(pool, ids, soft_tokens, opt, taps);
        break;
      case StageRole::TransformerLayers: {
        const LayerRange r = rs->decl.layers;
        // Only this stage's slice of the per-layer inputs crosses the boundary.
        const PerLayerInputs slice = config_.text.has_ple()
                                         ? e.per_layer_inputs.slice(0, S, r.begin, r.end - r.begin)
                                         : PerLayerInputs{};
        rs->model->run_layers(pool, r.begin, r.end, e.hidden_states, slice, *rs->cache, taps);
        rs->cache->set_n_past(rs->cache->n_past() + S);
        break;
      }
      case StageRole::FinalNormHead:
        logits = all_logits ? rs->model->head(pool, e.hidden_states, 0, S, taps)
                            : rs->model->head(pool, e.hidden_states, S - 1, 1, taps);
        break;
    }
  }
  n_past_ += S;
  return logits;
}

FloatTensor Pipeline::prefill(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, int64_t chunk, bool all_logits,
                              TapRecorder* taps, const TextRunOptions& opt) {
  return prefill_chunks(config_, ids, soft_tokens, chunk,
                        [&](std::span<const int32_t> part, const FloatTensor* soft) {
                          return forward(pool, part, soft, all_logits, taps, opt);
                        });
}

}  // namespace gemstage
