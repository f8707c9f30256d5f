// Loading's checks and the text decoder's weights. The tensors themselves (keys, shapes, roles,
// parts, bundle storage) are declared once in gemma4/tensor_table.h; loading validates that
// whole list against the safetensors headers and reports every problem at once (file, key,
// expected vs found), and bind_text_weights fills TextWeights through the table's slots.
#pragma once

#include <string>
#include <vector>

#include "core/tensor.h"
#include "gemma4/config.h"
#include "gemma4/tensor_table.h"
#include "io/safetensors.h"

namespace gemstage {

// Throws one Error listing every missing tensor, wrong shape and unsupported dtype.
// Tensors of parts gemstage does not run (audio) are accepted; other unknown keys are returned.
std::vector<std::string> validate_tensors(const std::vector<TensorSpec>& specs,
                                          const TensorStore& store, const ModelConfig& c);

// Views of the text decoder's weights. Small vectors (norms, scalars) are widened to f32 once.
struct TextLayerWeights {
  WeightView q_proj, k_proj, v_proj, o_proj;
  WeightView gate_proj, up_proj, down_proj;
  WeightView per_layer_input_gate, per_layer_projection;
  std::vector<float> input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
      post_feedforward_layernorm, q_norm, k_norm, post_per_layer_input_norm;
  // The MoE block (LayerSpec::moe): the router, the stacked experts ([E, 2 I, D] gate and up,
  // [E, D, I] down, each expert's matrix a contiguous slice), and the three extra norms
  // (_1: after the dense MLP, _2: around the experts).
  WeightView router_proj, experts_gate_up, experts_down;
  std::vector<float> router_scale, router_per_expert_scale, pre_feedforward_layernorm_2,
      post_feedforward_layernorm_1, post_feedforward_layernorm_2;
  float layer_scalar = 1.0f;
  bool bound = false;  // false for layers another stage holds
};

struct TextWeights {
  WeightView embed_tokens;            // [V, D]; also the tied LM head
  WeightView embed_tokens_per_layer;  // [V_ple, L*P]
  WeightView per_layer_model_projection;
  std::vector<float> per_layer_projection_norm, final_norm;
  std::vector<TextLayerWeights> layers;
};

// Binds views over the source for the parts `held` (a stage holds only its own, see
// stage_parts); call validate_tensors first. Parts not held stay empty. Which tensors a part
// holds, and where each one lands, is the table's (text_tensor_specs).
TextWeights bind_text_weights(const ModelConfig& c, const TensorSource& store, const PartSet& held);

std::vector<float> vector_to_f32(const WeightView& w);

}  // namespace gemstage
