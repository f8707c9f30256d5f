#include "stage/sequence.h"

#include <numeric>

#include "core/error.h"
#include "gemma4/multimodal.h"

namespace gemstage {

Sequence::Sequence(std::shared_ptr<const Model> model, int64_t max_context,
                   std::optional<KvType> kv_type)
    : model_(std::move(model)),
      max_context_(max_context > 0 ? max_context : model_->max_context()),
      kv_type_(kv_type.value_or(model_->default_kv_type())) {
  if (model_->is_bundle() && max_context_ > model_->max_context())
    fail(model_->path(), ": context ", max_context_, " exceeds the bundle's declared max_context ",
         model_->max_context(), "; re-export with --max-context ", max_context_);
  build_caches();
}

Sequence::~Sequence() = default;

std::unique_ptr<Sequence> Sequence::open(const std::string& path, int64_t max_context) {
  return std::make_unique<Sequence>(Model::open(path), max_context);
}

void Sequence::build_caches() {
  caches_.clear();
  for (const auto& s : model_->stages()) caches_.push_back(s->new_cache(max_context_, kv_type_));
  tokens_.clear();
}

void Sequence::reset(int64_t max_context) {
  if (max_context > 0) max_context_ = max_context;
  build_caches();
}

void Sequence::set_kv_type(KvType t) {
  kv_type_ = t;
  build_caches();
}

size_t Sequence::cache_bytes() const {
  size_t b = 0;
  for (const auto& c : caches_)
    if (c) b += c->bytes();
  return b;
}

bool Sequence::truncate(int64_t n) {
  if (n < 0 || n > n_past()) return false;
  for (const auto& c : caches_)
    if (c && !c->can_truncate(n)) return false;
  for (const auto& c : caches_)
    if (c) c->truncate(n);
  tokens_.resize(static_cast<size_t>(n));
  return true;
}

FloatTensor Sequence::forward(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, bool all_logits, TapRecorder* taps,
                              const TextRunOptions& opt) {
  const int64_t S = static_cast<int64_t>(ids.size());
  if (S == 0) fail("forward: no tokens");
  const ModelConfig& c = model_->config();
  if (n_past() + S > max_context_)
    fail("context limit reached: ", n_past() + S, " tokens exceed the context size of ",
         max_context_, " (raise --ctx-size / -c, up to the model's max_position_embeddings of ",
         c.text.max_position_embeddings, ")");
  std::vector<int32_t> positions(static_cast<size_t>(S));
  std::iota(positions.begin(), positions.end(), static_cast<int32_t>(n_past()));

  TensorMap flow;  // what the previous stage produced
  TensorMap logits;
  const auto& stages = model_->stages();
  try {
    for (size_t i = 0; i < stages.size(); ++i) {
      const Stage& st = *stages[i];
      TensorMap in;
      switch (st.role()) {
        case StageRole::Embeddings:
          in["input_ids"] = HostTensor({S}, std::vector<int32_t>(ids.begin(), ids.end()));
          if (soft_tokens && soft_tokens->numel() > 0)
            in["image_soft_tokens"] = HostTensor(soft_tokens->shape, soft_tokens->data);
          flow = st.run(pool, std::move(in), nullptr, opt, taps);
          break;
        case StageRole::TransformerLayers: {
          // Only this stage's slice of the per-layer inputs crosses the boundary.
          const LayerRange r = st.decl().layers;
          const HostTensor& all = flow.at("per_layer_inputs");
          const int64_t L = all.shape()[1], P = all.shape()[2], n = r.end - r.begin;
          std::vector<float> slice(static_cast<size_t>(S * n * P));
          const auto src = all.values<float>();
          for (int64_t row = 0; row < S; ++row)
            std::copy_n(src.begin() + (row * L + r.begin) * P, n * P, slice.begin() + row * n * P);
          in["hidden_states"] = std::move(flow.at("hidden_states"));
          in["per_layer_inputs"] = HostTensor({S, n, P}, std::move(slice));
          in["positions"] = HostTensor({S}, positions);
          TensorMap out = st.run(pool, std::move(in), caches_[i].get(), opt, taps);
          flow["hidden_states"] = std::move(out.at("hidden_states"));
          break;
        }
        case StageRole::FinalNormHead: {
          HostTensor& h = flow.at("hidden_states");
          if (all_logits) {
            in["hidden_states"] = std::move(h);
          } else {
            const int64_t D = h.shape()[1];
            const auto v = h.values<float>();
            in["hidden_states"] = HostTensor({1, D}, std::vector<float>(v.end() - D, v.end()));
          }
          logits = st.run(pool, std::move(in), nullptr, opt, taps);
          break;
        }
      }
    }
  } catch (...) {
    // A failed call leaves the sequence as it was: no stage keeps the rows it appended.
    for (const auto& cache : caches_)
      if (cache) cache->drop_uncommitted();
    throw;
  }
  // The call ran through every stage: each cache group now holds its rows.
  for (const auto& cache : caches_)
    if (cache) cache->advance(S);
  tokens_.insert(tokens_.end(), ids.begin(), ids.end());
  return logits.at("logits").take_float();
}

FloatTensor Sequence::prefill(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, int64_t chunk, bool all_logits,
                              TapRecorder* taps, const TextRunOptions& opt) {
  return prefill_chunks(model_->config(), ids, soft_tokens, chunk,
                        [&](std::span<const int32_t> part, const FloatTensor* soft) {
                          return forward(pool, part, soft, all_logits, taps, opt);
                        });
}

}  // namespace gemstage
