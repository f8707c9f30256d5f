// The Gemma 4 E-series audio tower (Gemma4AudioModel) and the audio embedder (model.embed_audio),
// as docs/gemma4-audio.md describes them:
//   subsampling  2 × [mask rows, Conv2d 3×3 stride 2 pad 1 (no bias), LayerNorm over channels
//                (weight only), ReLU, mask[::2]], flatten (freq, ch), input_proj_linear
//   conformer    × num_hidden_layers: half-step FFN, chunked local self-attention (self + left−2
//                past frames, relative-position bias from sinusoids through relative_k_proj,
//                per-dim query scale, soft-cap 50, masked logits −1e9), light conv (GLU, causal
//                depthwise conv, RMSNorm, SiLU), half-step FFN, output RMSNorm; every projection
//                a ClippableLinear
//   output       output_proj (Linear with bias)
//   embedder     scale-free RMSNorm then embedding_projection to the text width, valid rows only.
// The attention runs as a plain sliding window over each query's past: with no right context
// every key HF's blocked layout allows lies in that window, so the result does not depend on the
// chunk size (the doc's "attention_direct" formulation).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "gemma4/vision_model.h"  // ClippableLinear
#include "io/safetensors.h"
#include "trace/taps.h"

namespace gemstage {

struct AudioFfnWeights {
  ClippableLinear ffw_layer_1, ffw_layer_2;  // [4H, H], [H, 4H]
  std::vector<float> pre_layer_norm, post_layer_norm;
};

struct AudioLayerWeights {
  AudioFfnWeights feed_forward1, feed_forward2;
  ClippableLinear q_proj, k_proj, v_proj, post;
  WeightView relative_k_proj;                // [H, H]
  std::vector<float> per_dim_scale;          // [hd]
  ClippableLinear linear_start, linear_end;  // [2H, H], [H, H]
  std::vector<float> depthwise_conv;         // [H, 1, K]
  std::vector<float> lconv_pre_norm, conv_norm;
  std::vector<float> norm_pre_attn, norm_post_attn, norm_out;
};

struct AudioWeights {
  std::vector<float> conv0, conv1;  // [C0, 1, 3, 3], [C1, C0, 3, 3]
  std::vector<float> norm0, norm1;  // [C0], [C1]
  WeightView input_proj;            // [H, (C0/4)·C1]
  std::vector<AudioLayerWeights> layers;
  WeightView output_proj;               // [P, H]
  std::vector<float> output_proj_bias;  // [P]
  WeightView embedding_projection;      // model.embed_audio.embedding_projection [text D, P]
};

// Binds views over the store; validate_tensors(audio_tensor_specs(c), ...) must have passed.
AudioWeights bind_audio_weights(const ModelConfig& c, const TensorSource& store);

// One clip's log-mel features as the feature extractor emits them.
struct AudioInput {
  int64_t frames = 0;
  std::vector<float> features;  // [frames, 128]
  std::vector<uint8_t> mask;    // [frames], 1 = valid
};

class AudioTower {
 public:
  AudioTower(const ModelConfig& config, AudioWeights weights);

  const AudioConfig& config() const { return cfg_; }

  // Soft tokens of a clip with this feature mask: the rows valid after both subsamplings
  // (checks that the mask is a prefix of ones, as the feature extractor makes it).
  int64_t num_soft_tokens(const std::vector<uint8_t>& mask) const;

  // One clip -> its soft tokens [N, text D] (embed_audio of the valid encoder rows, in order).
  // Taps: audio_features [F, 128], audio_features_mask [F] (ids), audio_subsample_out [T, H],
  // audio_subsample_mask [T] (ids), audio_layer_out [layers, T, H], audio_encoder_out [T, H],
  // audio_tower_out [T, P], audio_embedder_out [N, D]. Several clips append in call order.
  FloatTensor encode(ThreadPool& pool, const AudioInput& clip, TapRecorder* taps) const;
  // Every clip in order, soft tokens concatenated.
  FloatTensor encode_all(ThreadPool& pool, const std::vector<AudioInput>& clips,
                         TapRecorder* taps) const;

 private:
  void layer_forward(ThreadPool& pool, int li, FloatTensor& x,
                     const std::vector<uint8_t>& valid) const;
  void ffn(ThreadPool& pool, const AudioFfnWeights& w, FloatTensor& x) const;
  void attention(ThreadPool& pool, const AudioLayerWeights& w, const FloatTensor& x,
                 const std::vector<uint8_t>& valid, FloatTensor& out) const;
  void light_conv(ThreadPool& pool, const AudioLayerWeights& w, FloatTensor& x) const;

  const AudioConfig& cfg_;
  int64_t text_hidden_;
  AudioWeights w_;
  std::vector<float> rel_pos_;  // [left, H] sinusoids of positions left−1 … 0
};

}  // namespace gemstage
