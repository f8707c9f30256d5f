// A chain of stages run in one process. Each stage owns its weights and (transformer stages)
// its KV caches; the pipeline hands only contract tensors from one stage to the next:
// embeddings -> hidden_states + per_layer_inputs, each transformer stage -> hidden_states with
// just its own per_layer_inputs slice, head -> logits. An HF checkpoint directory runs as the
// same three-stage chain over the memory-mapped checkpoint; a bundle runs its exported stages.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/thread_pool.h"
#include "gemma4/text_model.h"
#include "gemma4/vision_model.h"
#include "io/safetensors.h"
#include "stage/contract.h"

namespace gemstage {

class Pipeline {
 public:
  // path: an HF checkpoint directory or a gemstage bundle. max_context 0: the model's maximum.
  static std::unique_ptr<Pipeline> open(const std::string& path, int64_t max_context = 0);
  ~Pipeline();

  const ModelConfig& config() const { return config_; }
  const std::string& path() const { return path_; }
  bool is_bundle() const { return is_bundle_; }
  const std::vector<StageDecl>& stages() const;
  const std::vector<std::string>& notes() const { return notes_; }
  // The directory holding tokenizer.json and friends (the checkpoint, or the bundle's copies).
  const std::string& assets_dir() const { return path_; }

  int64_t n_past() const { return n_past_; }
  int64_t max_context() const { return max_context_; }
  // Drops every KV cache and sizes new ones for max_context (0: keep the current size).
  void reset(int64_t max_context = 0);
  // The KV caches' row type. open() picks BF16 for quantized (Q8_0/Q4_0) transformer weights,
  // whose own rounding is far larger and which gain half the cache traffic at depth, and F32
  // for f32 and bf16 weights, which compute in f32 as the reference does. set_kv_type
  // overrides it and drops the caches, as reset() does.
  KvType kv_type() const { return kv_type_; }
  void set_kv_type(KvType t);
  // Forgets positions n.. in every stage's caches; false (nothing changed) if they cannot.
  bool truncate(int64_t n);

  // Runs one chunk of ids at positions n_past().. through every stage; soft_tokens fill the
  // placeholder rows of this chunk in order. Returns logits for every row or only the last.
  FloatTensor forward(ThreadPool& pool, std::span<const int32_t> ids,
                      const FloatTensor* soft_tokens, bool all_logits, TapRecorder* taps,
                      const TextRunOptions& opt = {});

  // Whole prompt in chunks of `chunk` rows (<= 0: one pass), each chunk with the soft tokens of
  // its own placeholder rows; returns the last chunk's logits.
  FloatTensor prefill(ThreadPool& pool, std::span<const int32_t> ids,
                      const FloatTensor* soft_tokens, int64_t chunk, bool all_logits,
                      TapRecorder* taps, const TextRunOptions& opt = {});

  // Bytes of every matrix the transformer and head stages read for one decoded token.
  double decode_weight_bytes() const;

  // The stage holding the embedding / PLE weights (used by checks and tools).
  const TextModel& embeddings_model() const;
  // The embeddings stage's vision tower; null for checkpoints without vision_config.
  const VisionTower* vision() const { return vision_.get(); }

 private:
  struct RuntimeStage;
  Pipeline() = default;
  void build_caches();

  std::string path_;
  bool is_bundle_ = false;
  ModelConfig config_;
  std::vector<std::shared_ptr<TensorSource>> sources_;
  std::vector<std::unique_ptr<RuntimeStage>> stages_;
  std::vector<StageDecl> decls_;
  std::vector<std::string> notes_;
  std::unique_ptr<VisionTower> vision_;
  int64_t n_past_ = 0, max_context_ = 0;
  KvType kv_type_ = KvType::F32;
};

}  // namespace gemstage
