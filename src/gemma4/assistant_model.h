// The Gemma 4 MTP drafter ("assistant", model_type gemma4_assistant; docs/gemma4-mtp.md):
// a few Q-only decoder layers that read the TARGET's K/V (its last non-KV-shared layer of each
// type), fed the target's scaled embedding of the newest token concatenated with a target-width
// hidden state, at one constant position for all K draft steps. It never writes any cache: a
// draft step only reads the target's donor layers, so drafting leaves the target untouched.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "io/safetensors.h"
#include "kernels/ops.h"

namespace gemstage {

struct AssistantConfig {
  std::string source;                   // config.json path, for messages
  int backbone_hidden_size = 0;         // H_t: the target's hidden size
  bool use_ordered_embeddings = false;  // centroid-masked head (E2B/E4B drafters)
  int num_centroids = 0;
  int centroid_top_k = 0;
  // The drafter's decoder. Its layers are derived as if none were KV-shared (all of them are,
  // with the target as donor: see assistant_donor_layers); layers[i].head_dim / num_kv_heads
  // are what each layer expects of the target's donor of its type.
  TextConfig text;
  std::vector<std::string> warnings;
};

AssistantConfig parse_assistant_config(const std::string& json_text, const std::string& source);
// Reads DIR/config.json; throws unless model_type is gemma4_assistant.
AssistantConfig load_assistant_config(const std::string& dir);

// The target layers the drafter reads for each type: the last non-KV-shared sliding and full
// layers (the donors the target's own shared layers read; with no shared layers, the last
// layer of each type). -1 when the target has no layer of that type.
struct AssistantDonors {
  int sliding = -1, full = -1;
};
AssistantDonors assistant_donor_layers(const TextConfig& target);

// Throws naming both checkpoints and the field when the drafter does not fit the target
// (backbone hidden size, vocabulary, head dims, KV heads per layer type, sliding window).
void check_assistant_matches(const AssistantConfig& a, const ModelConfig& target,
                             const std::string& assistant_path, const std::string& target_path);

// Per-step intermediates, for fixture comparisons (each left empty unless asked for).
struct DraftStepRecord {
  std::vector<float> pre_projection;   // [H_a]
  std::vector<float> layer_out;        // [layers, H_a]
  std::vector<float> final_hidden;     // [H_a]
  std::vector<float> hidden_out;       // [H_t]
  std::vector<float> logits;           // [V] (centroid-masked when the drafter uses centroids)
  std::vector<int64_t> centroid_topk;  // [top_k]
};

// What one draft round reads from the target: its embedding table (scaled by sqrt(H_t) here),
// its donor caches, and the constant position P (the caches hold positions 0..P-1).
struct DraftContext {
  const WeightView* target_embed = nullptr;  // [V, H_t]
  const LayerKvCache* sliding = nullptr;     // donor caches (null if the drafter has no such layer)
  const LayerKvCache* full = nullptr;
  int64_t position = 0;
};

class AssistantModel {
 public:
  // Opens DIR (config.json + safetensors), validating every tensor it runs.
  static std::unique_ptr<AssistantModel> open(const std::string& dir);
  // The same from any tensor source (a bundle's drafter stage), its config already parsed; `where`
  // names it in messages. Matrices may also be Q8_0 / Q4_0 blocks.
  static std::unique_ptr<AssistantModel> open_from(const std::string& where, AssistantConfig cfg,
                                                   std::shared_ptr<const TensorSource> tensors);
  ~AssistantModel();

  const AssistantConfig& config() const { return cfg_; }
  const std::string& path() const { return path_; }
  // The checkpoint keys it runs, in load order (what a bundle's drafter stage holds).
  const std::vector<std::string>& tensor_keys() const { return keys_; }

  // One draft step from the newest token `token` (a raw id: placeholders are not mapped to PAD)
  // and the target-width hidden h ([H_t], replaced by the next step's h). Returns the drafted id.
  int32_t step(ThreadPool& pool, const DraftContext& ctx, int32_t token, std::vector<float>& h,
               DraftStepRecord* rec = nullptr) const;

 private:
  struct Layer {
    WeightView q_proj, o_proj, gate_proj, up_proj, down_proj;
    std::vector<float> input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
        post_feedforward_layernorm, q_norm;
    float layer_scalar = 1.0f;
  };
  AssistantModel() = default;
  // attention of q ([H, hd], normed + roped) over the donor cache's visible positions.
  void attend(CpuTier tier, const LayerSpec& ls, const LayerKvCache& cache, int64_t position,
              const float* q, float* out) const;

  std::string path_;
  AssistantConfig cfg_;
  std::shared_ptr<const TensorSource> tensors_;  // keeps the mapped weights alive
  std::vector<std::string> keys_;
  WeightView pre_projection_, post_projection_, embed_tokens_, centroids_;
  std::vector<int64_t> token_ordering_;  // [V] when use_ordered_embeddings
  std::vector<float> final_norm_;
  std::vector<Layer> layers_;
  RopeTable rope_sliding_, rope_full_;
};

}  // namespace gemstage
