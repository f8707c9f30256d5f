// A stage as a runtime unit: its contract, its weights (read-only, shared by every sequence) and
// one call that takes named tensors and returns named tensors. run() checks every input against
// the contract before it computes and every output after, so what the contract lists is exactly
// what travels between stages, in one process or (later) between processes.
//
//   embeddings          input_ids [+ pixel_values, image_position_ids | image_soft_tokens]
//                       [+ audio_features, audio_features_mask | audio_soft_tokens]
//                       -> hidden_states, per_layer_inputs, ple_token_ids, image_splice_mask
//                       [, audio_splice_mask] (the vision and audio towers run inside this stage)
//   transformer_layers  hidden_states, per_layer_inputs (its own layers' slice), positions
//                       -> hidden_states; reads and extends the sequence's KV cache group
//   final_norm_head     hidden_states -> logits
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/host_tensor.h"
#include "core/thread_pool.h"
#include "gemma4/audio_model.h"
#include "gemma4/text_model.h"
#include "gemma4/unified_embedder.h"
#include "gemma4/vision_model.h"
#include "io/safetensors.h"
#include "stage/contract.h"
#include "trace/taps.h"

namespace gemstage {

class Stage {
 public:
  // Binds the stage's weights from `weights` (a bundle's stage file or a whole checkpoint).
  Stage(const ModelConfig& config, StageDecl decl, std::shared_ptr<TensorSource> weights);
  ~Stage();

  const StageDecl& decl() const { return decl_; }
  const std::string& id() const { return decl_.id; }
  StageRole role() const { return decl_.role; }
  const StageContract& contract() const { return decl_.contract; }

  // A fresh KV cache group for one sequence (transformer stages; null for the others).
  std::unique_ptr<KvCache> new_cache(int64_t max_context, KvType kv_type) const;

  // One call: checks `inputs` against the contract, computes, checks the outputs and returns
  // them. caches: this stage's cache group of each sequence in the call (transformer stages
  // only; several with a `row_sequence` input, which indexes them). Each sequence's positions
  // must continue its cache, and its rows are appended (the caller advances the caches once the
  // whole call has run, see Sequence::forward_batch).
  TensorMap run(ThreadPool& pool, TensorMap inputs, std::span<KvCache* const> caches,
                const TextRunOptions& opt, TapRecorder* taps) const;
  // One sequence's call (cache: null for stages without one).
  TensorMap run(ThreadPool& pool, TensorMap inputs, KvCache* cache, const TextRunOptions& opt,
                TapRecorder* taps) const {
    return run(pool, std::move(inputs), std::span<KvCache* const>(&cache, cache ? 1 : 0), opt,
               taps);
  }

  // Embeddings stage: the vision tower's soft tokens for whole images, so a prompt whose images
  // span several calls runs the tower once and hands each call its rows (image_soft_tokens).
  FloatTensor encode_images(ThreadPool& pool, const std::vector<VisionInput>& images,
                            TapRecorder* taps) const;
  // The vision tower (embeddings stage of a model with vision_config), else null.
  const VisionTower* vision() const { return vision_.get(); }
  // Embeddings stage: the audio tower's soft tokens for whole clips (as encode_images).
  FloatTensor encode_audio(ThreadPool& pool, const std::vector<AudioInput>& clips,
                           TapRecorder* taps) const;
  // The audio tower (embeddings stage of a model with audio_config), else null.
  const AudioTower* audio() const { return audio_.get(); }
  // The image and audio embedders of a gemma4_unified model (embeddings stage), else null.
  const UnifiedEmbedder* unified() const { return unified_.get(); }
  const TextModel& text() const { return *text_; }

  // Bytes of every matrix this stage reads for one decoded token.
  double decode_weight_bytes() const;

 private:
  TensorMap run_embeddings(ThreadPool& pool, TensorMap& in, const TextRunOptions& opt,
                           TapRecorder* taps) const;
  TensorMap run_layers(ThreadPool& pool, TensorMap& in, std::span<KvCache* const> caches,
                       TapRecorder* taps) const;
  TensorMap run_head(ThreadPool& pool, TensorMap& in, TapRecorder* taps) const;

  const ModelConfig& config_;
  StageDecl decl_;
  std::shared_ptr<TensorSource> weights_;
  std::unique_ptr<TextModel> text_;
  std::unique_ptr<VisionTower> vision_;
  std::unique_ptr<AudioTower> audio_;
  std::unique_ptr<UnifiedEmbedder> unified_;
};

}  // namespace gemstage
