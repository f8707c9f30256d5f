// One sequence (a conversation) running on a shared Model: its KV caches (one group per
// transformer stage), the ids those caches hold and so its next position. Each call runs its rows
// through every stage as named tensors, each checked against the stage's contract: the
// embeddings stage gets the ids (and the soft tokens of their placeholder rows), each
// transformer stage the hidden states, only its own slice of the per-layer inputs and the rows'
// positions, the head the hidden states of the rows whose logits are wanted.
#pragma once

#include <exception>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/thread_pool.h"
#include "stage/model.h"

namespace gemstage {

class Sequence;
class BatchCall;

// One sequence's part of a batched call: its new ids (a prompt chunk, or one decoded token), the
// soft tokens of their placeholder rows, and whether it wants logits for every row or the last.
struct BatchEntry {
  Sequence* sequence = nullptr;
  std::span<const int32_t> ids;
  const FloatTensor* soft_tokens = nullptr;
  bool all_logits = false;
};

class Sequence {
 public:
  // max_context 0: the model's max_context(); kv_type: the model's default_kv_type() if unset.
  explicit Sequence(std::shared_ptr<const Model> model, int64_t max_context = 0,
                    std::optional<KvType> kv_type = std::nullopt);
  // Opens a model for this one sequence (tools that run one conversation).
  static std::unique_ptr<Sequence> open(const std::string& path, int64_t max_context = 0);
  ~Sequence();

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& shared_model() const { return model_; }
  // Shorthands for the model's own accessors.
  const ModelConfig& config() const { return model_->config(); }
  const std::string& path() const { return model_->path(); }
  bool is_bundle() const { return model_->is_bundle(); }
  const std::vector<StageDecl>& stages() const { return model_->stage_decls(); }
  const std::vector<std::string>& notes() const { return model_->notes(); }
  const std::string& assets_dir() const { return model_->assets_dir(); }
  const VisionTower* vision() const { return model_->vision(); }
  const AudioTower* audio() const { return model_->audio(); }
  const TextModel& embeddings_model() const { return model_->embeddings_model(); }
  double decode_weight_bytes() const { return model_->decode_weight_bytes(); }

  // The ids the caches hold, in order; n_past() of them, so the next row's position is n_past().
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int64_t n_past() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t max_context() const { return max_context_; }
  // Drops every KV cache and sizes new ones for max_context (0: keep the current size).
  void reset(int64_t max_context = 0);
  KvType kv_type() const { return kv_type_; }
  // Bytes the KV caches hold now.
  size_t cache_bytes() const;
  // Changes the KV caches' row type; drops the caches, as reset() does.
  void set_kv_type(KvType t);
  // Forgets positions n.. in every stage's caches; false (nothing changed) if they cannot.
  bool truncate(int64_t n);
  // The KV cache layer `layer` keeps, in whichever stage holds it; null if none does (a
  // KV-shared layer). The MTP drafter reads its donor layers through this.
  const LayerKvCache* layer_cache(int layer) const;
  // The cache group of stage i (in stage_decls() order); null for a stage without one or one
  // another process runs.
  const KvCache* stage_cache(size_t i) const {
    return i < caches_.size() ? caches_[i].get() : nullptr;
  }

  // Runs one call's ids at positions n_past().. through every stage; soft_tokens fill the
  // placeholder rows of these ids in order. Returns logits for every row or only the last.
  FloatTensor forward(ThreadPool& pool, std::span<const int32_t> ids,
                      const FloatTensor* soft_tokens, bool all_logits, TapRecorder* taps,
                      const TextRunOptions& opt = {});

  // Several sequences of one model in one call: every matrix is multiplied once over all their
  // rows, and each sequence attends to its own cache, so each gets what it would get alone.
  // Returns each entry's logits, in order. A failure leaves every sequence as it was.
  static std::vector<FloatTensor> forward_batch(ThreadPool& pool, std::span<const BatchEntry> batch,
                                                TapRecorder* taps = nullptr,
                                                const TextRunOptions& opt = {});

  // Whole prompt in chunks of `chunk` rows (<= 0: one pass), each chunk with the soft tokens of
  // its own placeholder rows; returns the last chunk's logits.
  FloatTensor prefill(ThreadPool& pool, std::span<const int32_t> ids,
                      const FloatTensor* soft_tokens, int64_t chunk, bool all_logits,
                      TapRecorder* taps, const TextRunOptions& opt = {});

 private:
  friend class BatchCall;
  void build_caches();

  // Each stage run in another process gets the sequence's rows under this number, unique in
  // this process, and keeps its cache group there.
  std::vector<RemoteStage*> remote_stages() const;
  void close_remote() noexcept;

  std::shared_ptr<const Model> model_;
  uint64_t remote_id_ = 0;
  std::vector<std::unique_ptr<KvCache>> caches_;  // per stage; null for stateless/remote stages
  std::vector<int32_t> tokens_;
  int64_t max_context_ = 0;
  KvType kv_type_ = KvType::F32;
};

// One batched call on its way through the stages (what Sequence::forward_batch runs start to
// end). It runs this process's stages itself and hands a stage held by another process its
// inputs, then waits for that stage's reply apart, so a CallPipeline (stage/call_pipeline.h) can
// keep several calls in flight: the other processes work on one while this one runs its own
// stages of another. Its sequences must be in no other call while it is in flight.
class BatchCall {
 public:
  // Checks the batch and lays out its rows (copies of the ids and soft tokens: the entries'
  // spans need not outlive this). Throws, changing nothing, on a batch that cannot run.
  BatchCall(std::span<const BatchEntry> batch, TapRecorder* taps = nullptr,
            const TextRunOptions& opt = {});
  // A call dropped before it finished leaves its sequences as they were.
  ~BatchCall();
  BatchCall(const BatchCall&) = delete;
  BatchCall& operator=(const BatchCall&) = delete;

  // Runs stages until the call waits on another process's stage or has run them all. If it was
  // waiting, first collects that reply (waiting for it: see ready()). A failure is kept for
  // finish() and ends the call.
  void advance(ThreadPool& pool);
  // Whether advance() has work that needs no waiting.
  bool ready();
  // Every stage ran, or one failed.
  bool done() const { return done_; }
  // How many stages it has run (a pipeline favours the calls nearest their end).
  size_t stages_run() const { return stage_; }
  // The finished call: each entry's sequence keeps its rows (in every process) and the entries'
  // logits are returned in order; or, after a failure, no sequence changed and this rethrows.
  std::vector<FloatTensor> finish();

 private:
  TensorMap stage_inputs(size_t i);
  void take_outputs(size_t i, TensorMap out);
  void drop_all() noexcept;

  struct Entry {
    Sequence* sequence;
    std::vector<int32_t> ids;
    bool all_logits;
  };
  std::vector<Entry> entries_;
  const Model* model_;
  TapRecorder* taps_;
  TextRunOptions opt_;
  std::vector<int32_t> ids_, positions_, row_sequence_, groups_;
  bool any_group_ = false;
  std::vector<float> soft_;
  std::vector<uint64_t> remote_ids_;  // each entry's number in the processes of remote stages
  size_t stage_ = 0;
  std::optional<uint64_t> ticket_;  // the reply stage_'s process owes
  TensorMap flow_, logits_;
  std::exception_ptr error_;
  bool done_ = false, finished_ = false;
};

}  // namespace gemstage
