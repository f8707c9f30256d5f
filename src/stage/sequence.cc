#include "stage/sequence.h"

#include <algorithm>
#include <atomic>
#include <numeric>

#include "core/error.h"
#include "gemma4/multimodal.h"

namespace gemstage {

namespace {
std::atomic<uint64_t> next_remote_id{1};
}  // namespace

Sequence::Sequence(std::shared_ptr<const Model> model, int64_t max_context,
                   std::optional<KvType> kv_type)
    : model_(std::move(model)),
      remote_id_(next_remote_id.fetch_add(1)),
      max_context_(max_context > 0 ? max_context : model_->max_context()),
      kv_type_(kv_type.value_or(model_->default_kv_type())) {
  if (model_->is_bundle() && max_context_ > model_->max_context())
    fail(model_->path(), ": context ", max_context_, " exceeds the bundle's declared max_context ",
         model_->max_context(), "; re-export with --max-context ", max_context_);
  build_caches();
}

Sequence::~Sequence() {
  close_remote();
}

std::vector<RemoteStage*> Sequence::remote_stages() const {
  std::vector<RemoteStage*> r;
  for (const auto& s : model_->remote_stages())
    if (s) r.push_back(s.get());
  return r;
}

void Sequence::close_remote() noexcept {
  for (RemoteStage* r : remote_stages()) r->close_sequence(remote_id_);
}

std::unique_ptr<Sequence> Sequence::open(const std::string& path, int64_t max_context) {
  return std::make_unique<Sequence>(Model::open(path), max_context);
}

void Sequence::build_caches() {
  caches_.clear();
  tokens_.clear();
  for (const auto& s : model_->stages())
    caches_.push_back(s ? s->new_cache(max_context_, kv_type_) : nullptr);
  // Once a remote stage failed (its rank died or hangs) the sequence cannot run, and every
  // forward says why; resetting it must not fail on top, so a caller's clean-up path stays safe.
  try {
    for (RemoteStage* r : remote_stages()) r->open_sequence(remote_id_, max_context_, kv_type_);
  } catch (const Error&) {
    if (model_->stage_failure().empty()) throw;
  }
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
  const std::vector<RemoteStage*> remote = remote_stages();
  try {
    for (RemoteStage* r : remote)
      if (!r->can_truncate(remote_id_, n)) return false;
    for (const auto& c : caches_)
      if (c) c->truncate(n);
    for (RemoteStage* r : remote) r->truncate(remote_id_, n);
  } catch (const Error&) {
    // A remote stage failed (see build_caches): nothing to keep; the next forward says why.
    if (model_->stage_failure().empty()) throw;
    return false;
  }
  tokens_.resize(static_cast<size_t>(n));
  return true;
}

FloatTensor Sequence::forward(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, bool all_logits, TapRecorder* taps,
                              const TextRunOptions& opt) {
  const BatchEntry one{this, ids, soft_tokens, all_logits};
  return std::move(forward_batch(pool, std::span<const BatchEntry>(&one, 1), taps, opt).front());
}

std::vector<FloatTensor> Sequence::forward_batch(ThreadPool& pool,
                                                 std::span<const BatchEntry> batch,
                                                 TapRecorder* taps, const TextRunOptions& opt) {
  if (batch.empty()) fail("forward: no sequence in the batch");
  const Model& model = batch.front().sequence->model();
  const ModelConfig& c = model.config();
  // The call's rows: each entry's ids in turn, with their positions and sequence index.
  std::vector<int32_t> ids, positions, row_sequence, groups;
  bool any_group = false;
  std::vector<float> soft;
  bool any_soft = false;
  for (const BatchEntry& e : batch)
    any_soft = any_soft || (e.soft_tokens && e.soft_tokens->numel() > 0);
  for (size_t k = 0; k < batch.size(); ++k) {
    const BatchEntry& e = batch[k];
    Sequence& seq = *e.sequence;
    if (&seq.model() != &model) fail("forward: the sequences of one batch must share one model");
    for (size_t m = 0; m < k; ++m)
      if (batch[m].sequence == &seq) fail("forward: a sequence appears twice in one batch");
    const int64_t S = static_cast<int64_t>(e.ids.size());
    if (S == 0) fail("forward: no tokens");
    if (seq.n_past() + S > seq.max_context_)
      fail("context limit reached: ", seq.n_past() + S, " tokens exceed the context size of ",
           seq.max_context_,
           " (raise --ctx-size / -c, up to the model's max_position_embeddings of ",
           c.text.max_position_embeddings, ")");
    // Soft tokens are spliced in row order over the whole call, so once any entry brings some,
    // each entry must bring exactly its own placeholders' worth.
    const int64_t n_soft = e.soft_tokens ? e.soft_tokens->dim(0) : 0;
    if (any_soft && batch.size() > 1 && count_placeholders(c, e.ids) != n_soft)
      fail("forward: batch entry ", k, " has ", count_placeholders(c, e.ids),
           " placeholder rows but ", n_soft, " soft tokens");
    if (n_soft) soft.insert(soft.end(), e.soft_tokens->data.begin(), e.soft_tokens->data.end());
    ids.insert(ids.end(), e.ids.begin(), e.ids.end());
    if (c.text.bidirectional_vision) {
      // Each entry's image runs are its own groups, numbered on from the previous entry's.
      int32_t next = 0;
      for (int32_t g : groups) next = std::max(next, g + 1);
      for (int32_t g : vision_groups(c, e.ids, next)) {
        groups.push_back(g);
        any_group = any_group || g >= 0;
      }
    }
    for (int64_t r = 0; r < S; ++r) {
      positions.push_back(static_cast<int32_t>(seq.n_past() + r));
      row_sequence.push_back(static_cast<int32_t>(k));
    }
  }
  const int64_t S = static_cast<int64_t>(ids.size());

  TensorMap flow;  // what the previous stage produced
  TensorMap logits;
  const auto& stages = model.stages();
  const auto& remote = model.remote_stages();
  // The number each sequence goes by in the processes that run remote stages.
  std::vector<uint64_t> remote_ids;
  for (const BatchEntry& e : batch) remote_ids.push_back(e.sequence->remote_id_);
  try {
    for (size_t i = 0; i < stages.size(); ++i) {
      const StageDecl& decl = model.stage_decls()[i];
      // A stage runs here, or in the process that holds it, on the same contract tensors.
      auto run_stage = [&](TensorMap in, std::span<KvCache* const> caches) {
        if (stages[i]) return stages[i]->run(pool, std::move(in), caches, opt, taps);
        if (remote[i]) return remote[i]->run(std::move(in), remote_ids);
        fail(model.path(), ": stage ", decl.id, " is not open in this process");
      };
      TensorMap in;
      switch (decl.role) {
        case StageRole::Embeddings:
          in["input_ids"] = HostTensor({S}, ids);
          if (!soft.empty()) {
            const int64_t D = c.text.hidden_size, n = static_cast<int64_t>(soft.size()) / D;
            // The soft tokens fill the placeholder rows in order; audio rows travel as
            // audio_soft_tokens, image/video rows as image_soft_tokens (the contract names each).
            int64_t n_audio = 0;
            for (int32_t id : ids) n_audio += id == c.audio_token_id ? 1 : 0;
            if (n_audio == 0 || n != count_placeholders(c, ids)) {
              // No audio rows (or a count the stage will refuse, naming both counts).
              in[n_audio == 0 || c.vision ? "image_soft_tokens" : "audio_soft_tokens"] =
                  HostTensor({n, D}, std::move(soft));
            } else {
              std::vector<float> vis, aud;
              const std::vector<int> ph = c.placeholder_token_ids();
              int64_t k = 0;
              for (int32_t id : ids) {
                if (std::find(ph.begin(), ph.end(), id) == ph.end()) continue;
                auto& dst = id == c.audio_token_id ? aud : vis;
                dst.insert(dst.end(), soft.begin() + k * D, soft.begin() + (k + 1) * D);
                ++k;
              }
              const int64_t n_vis = static_cast<int64_t>(vis.size()) / D;
              if (n_vis) in["image_soft_tokens"] = HostTensor({n_vis, D}, std::move(vis));
              in["audio_soft_tokens"] = HostTensor({n_audio, D}, std::move(aud));
            }
          }
          flow = run_stage(std::move(in), {});
          break;
        case StageRole::TransformerLayers: {
          // Only this stage's slice of the per-layer inputs crosses the boundary.
          const LayerRange r = decl.layers;
          const HostTensor& all = flow.at("per_layer_inputs");
          const int64_t L = all.shape()[1], P = all.shape()[2], n = r.end - r.begin;
          std::vector<float> slice(static_cast<size_t>(S * n * P));
          const auto src = all.values<float>();
          for (int64_t row = 0; row < S; ++row)
            std::copy_n(src.begin() + (row * L + r.begin) * P, n * P, slice.begin() + row * n * P);
          in["hidden_states"] = std::move(flow.at("hidden_states"));
          in["per_layer_inputs"] = HostTensor({S, n, P}, std::move(slice));
          in["positions"] = HostTensor({S}, positions);
          std::vector<KvCache*> caches;
          for (const BatchEntry& e : batch) caches.push_back(e.sequence->caches_[i].get());
          if (batch.size() > 1) in["row_sequence"] = HostTensor({S}, row_sequence);
          if (any_group) in["vision_groups"] = HostTensor({S}, groups);
          TensorMap out = run_stage(std::move(in), caches);
          flow["hidden_states"] = std::move(out.at("hidden_states"));
          break;
        }
        case StageRole::FinalNormHead: {
          // Only the rows whose logits are wanted go through the head.
          const HostTensor& h = flow.at("hidden_states");
          const int64_t D = h.shape()[1];
          const auto v = h.values<float>();
          std::vector<float> rows;
          int64_t row0 = 0, n_rows = 0;
          for (const BatchEntry& e : batch) {
            const int64_t n = static_cast<int64_t>(e.ids.size());
            const int64_t first = e.all_logits ? row0 : row0 + n - 1;
            rows.insert(rows.end(), v.begin() + first * D, v.begin() + (row0 + n) * D);
            n_rows += row0 + n - first;
            row0 += n;
          }
          in["hidden_states"] = HostTensor({n_rows, D}, std::move(rows));
          logits = run_stage(std::move(in), {});
          break;
        }
      }
    }
    // Every stage ran: the remote ones keep their rows too.
    for (size_t i = 0; i < remote.size(); ++i)
      if (remote[i] && model.stage_decls()[i].role == StageRole::TransformerLayers)
        remote[i]->commit(remote_ids);
  } catch (...) {
    // A failed call leaves every sequence as it was: no stage keeps the rows it appended.
    for (const BatchEntry& e : batch)
      for (const auto& cache : e.sequence->caches_)
        if (cache) cache->drop_uncommitted();
    for (const auto& r : remote)
      if (r) r->drop_uncommitted(remote_ids);
    throw;
  }
  // The call ran through every stage: each cache group now holds its rows.
  std::vector<FloatTensor> out;
  FloatTensor all = logits.at("logits").take_float();
  const int64_t V = all.dim(1);
  int64_t at = 0;
  for (const BatchEntry& e : batch) {
    const int64_t n = static_cast<int64_t>(e.ids.size());
    for (const auto& cache : e.sequence->caches_)
      if (cache) cache->advance(n);
    e.sequence->tokens_.insert(e.sequence->tokens_.end(), e.ids.begin(), e.ids.end());
    const int64_t rows = e.all_logits ? n : 1;
    if (batch.size() == 1) {
      out.push_back(std::move(all));  // all of it is this entry's (a prompt's logits can be GBs)
      break;
    }
    FloatTensor part({rows, V});
    std::copy_n(all.data.begin() + at * V, rows * V, part.data.begin());
    out.push_back(std::move(part));
    at += rows;
  }
  return out;
}

FloatTensor Sequence::prefill(ThreadPool& pool, std::span<const int32_t> ids,
                              const FloatTensor* soft_tokens, int64_t chunk, bool all_logits,
                              TapRecorder* taps, const TextRunOptions& opt) {
  return prefill_chunks(model_->config(), ids, soft_tokens, chunk,
                        [&](std::span<const int32_t> part, const FloatTensor* soft) {
                          return forward(pool, part, soft, all_logits, taps, opt);
                        });
}

const LayerKvCache* Sequence::layer_cache(int layer) const {
  if (layer < 0 || layer >= config().text.num_hidden_layers) return nullptr;
  for (const auto& c : caches_)
    if (c && c->own(layer)) return c->own(layer);
  return nullptr;
}

}  // namespace gemstage
