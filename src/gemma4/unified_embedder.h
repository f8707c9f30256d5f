// The embedders of gemma4_unified (Gemma4UnifiedForConditionalGeneration, the 12B): no vision or
// audio tower; 48-px image patches and raw 40 ms audio frames go through small embedders
// straight into the text width (docs/gemma4-unified.md).
//
//   image  per patch vector v (48·48·3 values in (row, column, channel) order):
//          LayerNorm1 → patch_dense (with bias) → LayerNorm2 → + pos[x, 0] + pos[y, 1] →
//          pos_norm (LayerNorm) → scale-free RMSNorm → embedding_projection (no bias)
//   audio  per frame of F samples: scale-free RMSNorm → embedding_projection (no bias)
//
// Both run inside the embeddings stage; their soft tokens are spliced into the placeholder rows
// unscaled (the text embeddings are scaled by sqrt(hidden), the soft tokens are not).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "io/safetensors.h"
#include "trace/taps.h"

namespace gemstage {

struct UnifiedVisionWeights {
  std::vector<float> patch_ln1_weight, patch_ln1_bias;  // [patch_dim]
  WeightView patch_dense;                               // [mm_embed_dim, patch_dim]
  std::vector<float> patch_dense_bias;                  // [mm_embed_dim]
  std::vector<float> patch_ln2_weight, patch_ln2_bias;  // [mm_embed_dim]
  WeightView pos_embedding;                             // [mm_posemb_size, 2, mm_embed_dim]
  std::vector<float> pos_norm_weight, pos_norm_bias;    // [mm_embed_dim]
  WeightView embedding_projection;                      // [text D, mm_embed_dim]
};

struct UnifiedAudioWeights {
  WeightView embedding_projection;  // [text D, frame_samples]
};

// The two checkpoint layouts: as released (model.vision_embedder.*, the projection under
// model.embed_vision.) and as transformers >= 5.12 saves them after renaming on load
// (model.embed_vision.* and model.embed_vision.multimodal_embedder.embedding_projection). The
// tensor table names the released keys; this maps a stored key to that name, or returns it
// unchanged.
std::string unified_canonical_key(const std::string& stored_key);
// Serves a gemma4_unified checkpoint's tensors under the released names whichever layout it
// was saved in (a no-op for other models).
void canonicalize_checkpoint_keys(const ModelConfig& c, TensorStore& store);

// One image's patches as the processor emits them: [max_patches, patch_dim] values in [0, 1]
// and [max_patches, 2] (x = block column, y = block row), (−1, −1) for padding rows.
struct UnifiedImageInput {
  int64_t max_patches = 0;
  std::vector<float> pixel_values;
  std::vector<int64_t> position_ids;
};

// One clip's frames: [frames, frame_samples], and which frames are real (1) or padding (0).
struct UnifiedAudioInput {
  int64_t frames = 0;
  std::vector<float> samples;
  std::vector<uint8_t> mask;
};

// Cuts a 16 kHz mono waveform into frames of F samples, the last partial frame zero-padded and
// kept: ceil(n / F) frames, all real.
UnifiedAudioInput unified_audio_frames(std::span<const float> waveform, int frame_samples);

class UnifiedEmbedder {
 public:
  // Either part may be absent (a config without vision_config / audio_config).
  UnifiedEmbedder(const ModelConfig& config, const TensorSource& store);

  bool has_vision() const { return vision_cfg_ != nullptr; }
  bool has_audio() const { return audio_cfg_ != nullptr; }
  const UnifiedVisionConfig& vision_config() const;
  const UnifiedAudioConfig& audio_config() const;

  // Validates the position ids (throws naming the row) and returns the soft-token count: the
  // number of non-padding rows.
  int64_t num_image_soft_tokens(const UnifiedImageInput& image) const;
  // Every image in order: soft tokens [ΣN, D]. Taps image_patch_dense, image_patch_ln2,
  // image_pos_embeds, image_pos_norm [N, mm_embed_dim], image_embedder_out [N, D], and the
  // inputs pixel_values / image_position_ids.
  FloatTensor encode_images(ThreadPool& pool, const std::vector<UnifiedImageInput>& images,
                            TapRecorder* taps) const;

  // Real frames of a clip (validates the mask: 0/1, real frames a prefix).
  int64_t num_audio_soft_tokens(const UnifiedAudioInput& clip) const;
  // Every clip in order: soft tokens [ΣN, D] of the real frames. Taps audio_frames
  // [frames, F] and audio_embedder_out [N, D].
  FloatTensor encode_audio(ThreadPool& pool, const std::vector<UnifiedAudioInput>& clips,
                           TapRecorder* taps) const;

 private:
  const UnifiedVisionConfig* vision_cfg_ = nullptr;
  const UnifiedAudioConfig* audio_cfg_ = nullptr;
  int64_t text_hidden_ = 0;
  UnifiedVisionWeights vw_;
  UnifiedAudioWeights aw_;
};

}  // namespace gemstage
