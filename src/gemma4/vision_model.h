// The Gemma 4 vision tower (Gemma4VisionModel) and the vision multimodal embedder
// (model.embed_vision):
//   patch embedder  input_proj(2·(pix − 0.5)) + pos_table[0][x] + pos_table[1][y]
//   encoder         sandwich-norm layers, ClippableLinear projections, q/k norms with weights,
//                   weightless v norm, 2D RoPE (x on the first half of each head, y on the
//                   second), bidirectional attention over the real patches, scaling 1.0
//   pooler          k×k average by position, row-major slots, × sqrt(hidden), standardize
//   embedder        weightless RMSNorm then Linear to the text width.
//
// The encoder runs on the real (non-padding) patches only. HF runs every max_patches row and
// masks padded keys, and the pooler zeroes padded rows, so the real rows are mathematically the
// same; only the reduction order differs.
#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "gemma4/config.h"
#include "io/npy.h"
#include "io/safetensors.h"
#include "trace/taps.h"

namespace gemstage {

// Gemma4ClippableLinear: y = clamp(clamp(x, in_min, in_max) · Wᵀ, out_min, out_max). Infinite
// bounds (use_clipped_linears = false, or a checkpoint storing ±inf) mean no clamp.
struct ClippableLinear {
  WeightView weight;  // [out, in]
  float input_min = -std::numeric_limits<float>::infinity();
  float input_max = std::numeric_limits<float>::infinity();
  float output_min = -std::numeric_limits<float>::infinity();
  float output_max = std::numeric_limits<float>::infinity();
};

// y[S, out] from x[S, in]; x is left untouched.
void clippable_linear(ThreadPool& pool, const ClippableLinear& l, const float* x, int64_t S,
                      float* y);

struct VisionLayerWeights {
  ClippableLinear q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj;
  std::vector<float> q_norm, k_norm;
  std::vector<float> input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
      post_feedforward_layernorm;
};

struct VisionWeights {
  WeightView input_proj;            // [hidden, 3·p·p]
  WeightView position_table;        // [2, position_embedding_size, hidden]; slot 0 = x, 1 = y
  std::vector<float> std_bias;      // [hidden] when standardize, else empty
  std::vector<float> std_scale;     // [hidden] when standardize, else empty
  WeightView embedding_projection;  // model.embed_vision.embedding_projection [text D, hidden]
  std::vector<VisionLayerWeights> layers;
};

// Binds views over the store; validate_tensors(vision_tensor_specs(c), ...) must have passed.
// Clip bounds are read as f32 scalars; without use_clipped_linears they stay infinite.
VisionWeights bind_vision_weights(const ModelConfig& c, const TensorSource& store);

// Gemma4VisionRotaryEmbedding + apply_multidimensional_rope. Each head of head_dim channels is
// split into an x part [0, head_dim/2) and a y part [head_dim/2, head_dim); each part is
// rotate-half RoPE of width head_dim/2 with inv_freq[i] = theta^(-2i/(head_dim/2)),
// i < head_dim/4, at the patch's x (resp. y) coordinate.
struct VisionRope {
  int head_dim = 0;
  std::vector<float> inv_freq;  // head_dim/4 entries, shared by both parts

  static VisionRope make(int head_dim, double theta);
};
void apply_vision_rope(const VisionRope& rope, int64_t x, int64_t y, float* v, int n_heads);

// The real patches of one image, after validation: position ids in [0, position_embedding_size)
// or (−1, −1) for padding; the real (x, y) cover a height × width grid exactly once, both sides
// multiples of the pooling kernel; max_patches is a multiple of kernel² (HF's output_length).
struct PatchGrid {
  int64_t width = 0, height = 0;  // Wp, Hp in patches
  int kernel = 1;                 // pooling kernel k
  std::vector<int64_t> rows;      // indices of the real patches in the input, in input order
  int64_t num_soft_tokens() const { return (width / kernel) * (height / kernel); }
};
PatchGrid check_patch_positions(const int64_t* position_ids, int64_t max_patches,
                                const VisionConfig& v);

// Gemma4VisionPooler._avg_pool_by_positions restricted to real patches: hidden [n, dim] with
// positions xy [n, 2]; patch (x, y) adds hidden/k² into slot floor(x/k) + (width/k)·floor(y/k).
// Returns [(width/k)·(height/k), dim]. No sqrt(hidden) scaling here.
FloatTensor pool_by_position(const float* hidden, const int64_t* xy, int64_t n, int64_t dim, int k,
                             int64_t width, int64_t height);

// One image's preprocessed inputs, exactly as the HF processor emits one batch item.
struct VisionInput {
  int64_t max_patches = 0;
  std::vector<float> pixel_values;    // [max_patches, 3·p·p], values in [0, 1]
  std::vector<int64_t> position_ids;  // [max_patches, 2] = (x, y), (−1, −1) for padding
};

// Splits a pixel_values array ([Np, 3pp], [1, Np, 3pp] or [B, Np, 3pp]) and its
// image_position_ids ([Np, 2], [1, Np, 2] or [B, Np, 2]) into per-image inputs; checks widths
// and that the two agree. The names are used in error messages.
std::vector<VisionInput> vision_inputs_from_arrays(const NpyArray& pixel_values,
                                                   const NpyArray& position_ids, int64_t patch_dim,
                                                   const std::string& pixels_name,
                                                   const std::string& positions_name);

class VisionTower {
 public:
  VisionTower(const ModelConfig& config, VisionWeights weights);

  const VisionConfig& config() const { return cfg_; }
  const VisionWeights& weights() const { return w_; }
  int64_t patch_dim() const { return 3LL * cfg_.patch_size * cfg_.patch_size; }

  // Validates the position ids (throws on bad ids or grid) and returns the soft-token count.
  int64_t num_soft_tokens(const int64_t* position_ids, int64_t max_patches) const;

  // One image: pixel_values [max_patches, 3·p·p], position_ids [max_patches, 2]. Returns the
  // soft tokens [N_soft, text D] in row-major pooled-grid order (embed_vision output).
  // Taps: pixel_values [max_patches, 3pp], image_position_ids [max_patches, 2] (ids),
  // vision_patch_embeds [max_patches, hidden] (padded rows as HF: input_proj(2·(pix−0.5)), no
  // position term), vision_encoder_out [max_patches, hidden] (real rows at their input index;
  // padded rows are 0, which is what HF's pooler consumes after masking them), vision_pooled
  // [N_soft, hidden], vision_embedder_out [N_soft, D]. Several images append in call order.
  FloatTensor encode(ThreadPool& pool, const float* pixel_values, const int64_t* position_ids,
                     int64_t max_patches, TapRecorder* taps) const;

  // Every image in order, soft tokens concatenated ([ΣN_soft, D]; HF's masked_scatter order).
  FloatTensor encode_all(ThreadPool& pool, const std::vector<VisionInput>& images,
                         TapRecorder* taps) const;

 private:
  void layer_forward(ThreadPool& pool, int li, FloatTensor& h,
                     const std::vector<int64_t>& xy) const;

  const VisionConfig& cfg_;
  int64_t text_hidden_;
  VisionWeights w_;
  VisionRope rope_;
};

}  // namespace gemstage
