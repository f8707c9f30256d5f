// The Gemma 4 E-series text decoder, split the way stages split it:
//   embed()      token identity (placeholder policy), scaled embedding, splice, and the whole
//                per-layer-input (PLE) computation;
//   run_layers() decoder layers [begin, end) over hidden states + their PLE slice;
//   head()       final norm, tied LM head, final logit soft-cap.
// No layer function ever sees token ids: PLE identity is resolved once, in embed().
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "cache/kv_cache.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "gemma4/placeholder_policy.h"
#include "gemma4/registry.h"
#include "kernels/ops.h"
#include "trace/taps.h"

namespace gemstage {

enum class EmbedScaleMode {
  F32,   // float32(sqrt(D)): HF with dtype=float32 (also on bf16 weights) — our compute dtype
  BF16,  // sqrt(D) rounded to bf16 first: what HF does when the model runs in bf16
};

struct TextRunOptions {
  PleIdentity ple_identity = PleIdentity::Pad;
  EmbedScaleMode embed_scale = EmbedScaleMode::F32;
};

// Boundary tensors between the embeddings stage and the transformer stages.
// Layers [first_layer, first_layer + num_layers) of the per-layer inputs: the embeddings stage
// produces all of them, each transformer stage receives only its own slice.
struct PerLayerInputs {
  int64_t rows = 0, first_layer = 0, num_layers = 0, dim = 0;
  std::vector<float> data;  // [rows, num_layers, dim]
  bool holds(int64_t layer) const {
    return layer >= first_layer && layer < first_layer + num_layers;
  }
  const float* at(int64_t row, int64_t layer) const {
    return data.data() + (row * num_layers + (layer - first_layer)) * dim;
  }
};

struct EmbeddingsOutput {
  FloatTensor hidden_states;  // [S, D] spliced inputs_embeds
  PerLayerInputs per_layer_inputs;
  std::vector<int32_t> ple_token_ids;      // [S] the PLE lookup's ids: pad at placeholder rows
  std::vector<uint8_t> image_splice_mask;  // [S] 1 where a soft token was spliced in
  // [S] 1 where an audio soft token was spliced in; on models with an audio tower those rows are
  // marked here and not in image_splice_mask, so each mask names the tower that filled a row.
  std::vector<uint8_t> audio_splice_mask;
};

// The caches layers [begin, end) keep (end -1: all layers); KV-shared layers keep none and read
// their donor's.
std::vector<LayerCachePlan> kv_cache_plan(const TextConfig& t, int begin = 0, int end = -1);
KvCache make_kv_cache(const TextConfig& t, int64_t max_context, int begin = 0, int end = -1,
                      KvType kv_type = KvType::F32);

// Rows [row0, row0 + rows) of a call belong to one sequence: positions start..start+rows-1,
// which continue that sequence's KV cache group (start == cache->n_past()). A call of several
// segments multiplies every matrix once over all rows; each segment attends to its own cache.
struct RowSegment {
  int64_t row0 = 0, rows = 0, start = 0;
  KvCache* cache = nullptr;
  // Optional, [rows]: each row's image group (the bidirectional image block of the large models,
  // TextConfig::bidirectional_vision): rows of one image share a group id >= 0 and form one
  // contiguous run inside this call; -1 elsewhere. Null: every row is causal.
  const int32_t* vision_groups = nullptr;
};

class TextModel {
 public:
  TextModel(const ModelConfig& config, TextWeights weights);

  const TextConfig& config() const { return cfg_; }
  const TextWeights& weights() const { return w_; }

  // soft_tokens: [N, D] tower features for the placeholder rows, in order (may be empty).
  EmbeddingsOutput embed(ThreadPool& pool, std::span<const int32_t> input_ids,
                         const FloatTensor* soft_tokens, const TextRunOptions& opt,
                         TapRecorder* taps) const;

  // Runs layers [begin, end) on hidden [S, D]: segments cover the rows of hidden in order, one
  // per sequence, each at positions that continue its cache (segment start == cache n_past), and
  // appends their K/V to the caches (which hold the same row type). Does not advance n_past (the
  // caller does, once per call, after its last stage). Taps record rows as they lie in the batch.
  void run_layers(ThreadPool& pool, int begin, int end, std::span<const RowSegment> segments,
                  FloatTensor& hidden, const PerLayerInputs& pli, TapRecorder* taps) const;

  // Final norm + tied head + soft-cap for the given rows of hidden ([S, D]) -> [rows, V].
  FloatTensor head(ThreadPool& pool, const FloatTensor& hidden, int64_t first_row, int64_t n_rows,
                   TapRecorder* taps) const;

 private:
  struct LayerPass;  // what the layers of one run_layers call share (text_model.cc)
  // One decoder layer: the attention, MLP and per-layer-input blocks in turn.
  void layer_forward(ThreadPool& pool, int layer, FloatTensor& hidden, const PerLayerInputs& pli,
                     LayerPass& pass, TapRecorder* taps) const;
  void attention_block(ThreadPool& pool, int layer, FloatTensor& hidden, LayerPass& pass) const;
  void mlp_block(ThreadPool& pool, int layer, FloatTensor& hidden, LayerPass& pass,
                 TapRecorder* taps) const;
  // The MoE half of an enable_moe_block layer: router and experts on the residual stream;
  // leaves post_feedforward_layernorm_2(experts) in pass.moe_out.
  void moe_experts(ThreadPool& pool, int layer, const FloatTensor& hidden, LayerPass& pass,
                   TapRecorder* taps) const;
  void ple_block(ThreadPool& pool, int layer, FloatTensor& hidden, const PerLayerInputs& pli,
                 LayerPass& pass) const;

  const ModelConfig& model_cfg_;
  const TextConfig& cfg_;
  TextWeights w_;
  RopeTable rope_sliding_, rope_full_;
};

}  // namespace gemstage
