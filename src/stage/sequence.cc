#include "stage/sequence.h"

#include <algorithm>
#include <atomic>
#include <numeric>

#include "core/error.h"
#include "gemma4/multimodal.h"

namespace gemstage {

Sequence::Sequence(std::shared_ptr<const Model> model, int64_t max_context,
                   std::optional<KvType> kv_type)
    : model_(std::move(model)),
      remote_id_(model_->new_remote_sequence_id()),
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
  BatchCall call(batch, taps, opt);
  while (!call.done()) call.advance(pool);
  return call.finish();
}

BatchCall::BatchCall(std::span<const BatchEntry> batch, TapRecorder* taps,
                     const TextRunOptions& opt)
    : taps_(taps), opt_(opt) {
  if (batch.empty()) fail("forward: no sequence in the batch");
  model_ = &batch.front().sequence->model();
  const ModelConfig& c = model_->config();
  // The call's rows: each entry's ids in turn, with their positions and sequence index.
  bool any_soft = false;
  for (const BatchEntry& e : batch)
    any_soft = any_soft || (e.soft_tokens && e.soft_tokens->numel() > 0);
  for (size_t k = 0; k < batch.size(); ++k) {
    const BatchEntry& e = batch[k];
    Sequence& seq = *e.sequence;
    if (&seq.model() != model_) fail("forward: the sequences of one batch must share one model");
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
    if (n_soft) soft_.insert(soft_.end(), e.soft_tokens->data.begin(), e.soft_tokens->data.end());
    ids_.insert(ids_.end(), e.ids.begin(), e.ids.end());
    if (c.text.bidirectional_vision) {
      // Each entry's image runs are its own groups, numbered on from the previous entry's.
      int32_t next = 0;
      for (int32_t g : groups_) next = std::max(next, g + 1);
      for (int32_t g : vision_groups(c, e.ids, next)) {
        groups_.push_back(g);
        any_group_ = any_group_ || g >= 0;
      }
    }
    for (int64_t r = 0; r < S; ++r) {
      positions_.push_back(static_cast<int32_t>(seq.n_past() + r));
      row_sequence_.push_back(static_cast<int32_t>(k));
    }
    entries_.push_back({&seq, std::vector<int32_t>(e.ids.begin(), e.ids.end()), e.all_logits});
    remote_ids_.push_back(seq.remote_id_);
  }
}

BatchCall::~BatchCall() {
  if (finished_) return;
  // Abandoned in flight: collect the reply it is owed (so the channel stays in step), keep
  // nothing.
  if (ticket_) {
    try {
      model_->remote_stages()[stage_]->collect(*ticket_);
    } catch (const std::exception&) {
    }
  }
  drop_all();
}

void BatchCall::drop_all() noexcept {
  for (const Entry& e : entries_)
    for (const auto& cache : e.sequence->caches_)
      if (cache) cache->drop_uncommitted();
  for (const auto& r : model_->remote_stages())
    if (r) r->drop_uncommitted(remote_ids_);
}

// The contract tensors stage i takes, from what the stages before it produced.
TensorMap BatchCall::stage_inputs(size_t i) {
  const ModelConfig& c = model_->config();
  const StageDecl& decl = model_->stage_decls()[i];
  const int64_t S = static_cast<int64_t>(ids_.size());
  TensorMap in;
  switch (decl.role) {
    case StageRole::Embeddings:
      in["input_ids"] = HostTensor({S}, ids_);
      if (!soft_.empty()) {
        const int64_t D = c.text.hidden_size, n = static_cast<int64_t>(soft_.size()) / D;
        // The soft tokens fill the placeholder rows in order; audio rows travel as
        // audio_soft_tokens, image/video rows as image_soft_tokens (the contract names each).
        int64_t n_audio = 0;
        for (int32_t id : ids_) n_audio += id == c.audio_token_id ? 1 : 0;
        if (n_audio == 0 || n != count_placeholders(c, ids_)) {
          // No audio rows (or a count the stage will refuse, naming both counts).
          in[n_audio == 0 || c.vision ? "image_soft_tokens" : "audio_soft_tokens"] =
              HostTensor({n, D}, std::move(soft_));
        } else {
          std::vector<float> vis, aud;
          const std::vector<int> ph = c.placeholder_token_ids();
          int64_t k = 0;
          for (int32_t id : ids_) {
            if (std::find(ph.begin(), ph.end(), id) == ph.end()) continue;
            auto& dst = id == c.audio_token_id ? aud : vis;
            dst.insert(dst.end(), soft_.begin() + k * D, soft_.begin() + (k + 1) * D);
            ++k;
          }
          const int64_t n_vis = static_cast<int64_t>(vis.size()) / D;
          if (n_vis) in["image_soft_tokens"] = HostTensor({n_vis, D}, std::move(vis));
          in["audio_soft_tokens"] = HostTensor({n_audio, D}, std::move(aud));
        }
        soft_.clear();
      }
      break;
    case StageRole::TransformerLayers: {
      // Only this stage's slice of the per-layer inputs crosses the boundary.
      const LayerRange r = decl.layers;
      const HostTensor& all = flow_.at("per_layer_inputs");
      const int64_t L = all.shape()[1], P = all.shape()[2], n = r.end - r.begin;
      std::vector<float> slice(static_cast<size_t>(S * n * P));
      const auto src = all.values<float>();
      for (int64_t row = 0; row < S; ++row)
        std::copy_n(src.begin() + (row * L + r.begin) * P, n * P, slice.begin() + row * n * P);
      in["hidden_states"] = std::move(flow_.at("hidden_states"));
      in["per_layer_inputs"] = HostTensor({S, n, P}, std::move(slice));
      in["positions"] = HostTensor({S}, positions_);
      if (entries_.size() > 1) in["row_sequence"] = HostTensor({S}, row_sequence_);
      if (any_group_) in["vision_groups"] = HostTensor({S}, groups_);
      break;
    }
    case StageRole::FinalNormHead: {
      // Only the rows whose logits are wanted go through the head.
      const HostTensor& h = flow_.at("hidden_states");
      const int64_t D = h.shape()[1];
      const auto v = h.values<float>();
      std::vector<float> rows;
      int64_t row0 = 0, n_rows = 0;
      for (const Entry& e : entries_) {
        const int64_t n = static_cast<int64_t>(e.ids.size());
        const int64_t first = e.all_logits ? row0 : row0 + n - 1;
        rows.insert(rows.end(), v.begin() + first * D, v.begin() + (row0 + n) * D);
        n_rows += row0 + n - first;
        row0 += n;
      }
      in["hidden_states"] = HostTensor({n_rows, D}, std::move(rows));
      break;
    }
    case StageRole::Drafter:
      fail("stage '", decl.id, "': a drafter is not a stage of the pipeline");
  }
  return in;
}

void BatchCall::take_outputs(size_t i, TensorMap out) {
  switch (model_->stage_decls()[i].role) {
    case StageRole::Embeddings:
      flow_ = std::move(out);
      break;
    case StageRole::TransformerLayers:
      flow_["hidden_states"] = std::move(out.at("hidden_states"));
      break;
    case StageRole::FinalNormHead:
      logits_ = std::move(out);
      break;
    case StageRole::Drafter:
      break;  // stage_inputs refused it
  }
}

bool BatchCall::ready() {
  if (done_) return false;
  return !ticket_ || model_->remote_stages()[stage_]->ready(*ticket_);
}

void BatchCall::advance(ThreadPool& pool) {
  if (done_) return;
  const auto& stages = model_->stages();
  const auto& remote = model_->remote_stages();
  try {
    if (ticket_) {
      const uint64_t t = *ticket_;
      ticket_.reset();
      take_outputs(stage_, remote[stage_]->collect(t));
      ++stage_;
    }
    for (; stage_ < stages.size(); ++stage_) {
      const StageDecl& decl = model_->stage_decls()[stage_];
      TensorMap in = stage_inputs(stage_);
      if (stages[stage_]) {
        // This process runs it, on the caches its entries' sequences keep here.
        std::vector<KvCache*> caches;
        if (decl.role == StageRole::TransformerLayers)
          for (const Entry& e : entries_) caches.push_back(e.sequence->caches_[stage_].get());
        take_outputs(stage_, stages[stage_]->run(pool, std::move(in), caches, opt_, taps_));
      } else if (remote[stage_]) {
        // Another process runs it, on the caches it keeps for these sequences.
        ticket_ = remote[stage_]->submit(std::move(in), remote_ids_);
        return;
      } else {
        fail(model_->path(), ": stage ", decl.id, " is not open in this process");
      }
    }
    done_ = true;
  } catch (...) {
    error_ = std::current_exception();
    done_ = true;
  }
}

std::vector<FloatTensor> BatchCall::finish() {
  if (!done_) fail("forward: a call was finished before it ran through every stage");
  if (finished_) fail("forward: a call was finished twice");
  finished_ = true;
  const auto& remote = model_->remote_stages();
  try {
    if (error_) std::rethrow_exception(error_);
    // Every stage ran: the remote ones keep their rows too.
    for (size_t i = 0; i < remote.size(); ++i)
      if (remote[i] && model_->stage_decls()[i].role == StageRole::TransformerLayers)
        remote[i]->commit(remote_ids_);
  } catch (...) {
    // A failed call leaves every sequence as it was: no stage keeps the rows it appended.
    drop_all();
    throw;
  }
  // The call ran through every stage: each cache group now holds its rows.
  std::vector<FloatTensor> out;
  FloatTensor all = logits_.at("logits").take_float();
  const int64_t V = all.dim(1);
  int64_t at = 0;
  for (const Entry& e : entries_) {
    const int64_t n = static_cast<int64_t>(e.ids.size());
    for (const auto& cache : e.sequence->caches_)
      if (cache) cache->advance(n);
    e.sequence->tokens_.insert(e.sequence->tokens_.end(), e.ids.begin(), e.ids.end());
    const int64_t rows = e.all_logits ? n : 1;
    if (entries_.size() == 1) {
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
