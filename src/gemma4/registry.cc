#include "kernels/weight_rows.h"
#include "gemma4/registry.h"

#include <set>
#include <sstream>

#include "core/error.h"

namespace gemstage {

std::vector<TensorSpec> text_tensor_specs(const ModelConfig& c) {
  const TextConfig& t = c.text;
  const std::string p = c.text_prefix();
  const int64_t D = t.hidden_size, L = t.num_hidden_layers, P = t.ple_dim(),
                H = t.num_attention_heads;
  std::vector<TensorSpec> s;
  s.push_back({p + "embed_tokens.weight", {t.vocab_size, D}});
  s.push_back({p + "norm.weight", {D}});
  if (t.has_ple()) {
    s.push_back({p + "embed_tokens_per_layer.weight", {t.vocab_size_per_layer_input, L * P}});
    s.push_back({p + "per_layer_model_projection.weight", {L * P, D}});
    s.push_back({p + "per_layer_projection_norm.weight", {P}});
  }
  for (int64_t i = 0; i < L; ++i) {
    const LayerSpec& ls = t.layers[static_cast<size_t>(i)];
    const std::string l = p + "layers." + std::to_string(i) + ".";
    const int64_t hd = ls.head_dim, kv = ls.num_kv_heads, I = ls.mlp_width;
    const TensorRole kv_role = ls.kv_shared ? TensorRole::Ignored : TensorRole::Required;
    for (const char* n : {"input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm"})
      s.push_back({l + n + ".weight", {D}});
    s.push_back({l + "self_attn.q_proj.weight", {H * hd, D}});
    s.push_back({l + "self_attn.k_proj.weight", {kv * hd, D}, kv_role});
    s.push_back({l + "self_attn.v_proj.weight", {kv * hd, D}, kv_role});
    s.push_back({l + "self_attn.o_proj.weight", {D, H * hd}});
    s.push_back({l + "self_attn.q_norm.weight", {hd}});
    s.push_back({l + "self_attn.k_norm.weight", {hd}, kv_role});
    s.push_back({l + "mlp.gate_proj.weight", {I, D}});
    s.push_back({l + "mlp.up_proj.weight", {I, D}});
    s.push_back({l + "mlp.down_proj.weight", {D, I}});
    if (t.has_ple()) {
      s.push_back({l + "per_layer_input_gate.weight", {P, D}});
      s.push_back({l + "per_layer_projection.weight", {D, P}});
      s.push_back({l + "post_per_layer_input_norm.weight", {D}});
    }
    s.push_back({l + "layer_scalar", {1}});
  }
  s.push_back(
      {"lm_head.weight", {t.vocab_size, D}, TensorRole::Ignored});  // tied; HF never reads it
  return s;
}

std::vector<TensorSpec> vision_tensor_specs(const ModelConfig& c) {
  std::vector<TensorSpec> s;
  if (!c.vision) return s;
  const VisionConfig& v = *c.vision;
  const std::string p = "model.vision_tower.";
  const int64_t Dv = v.hidden_size, I = v.intermediate_size, hd = v.head_dim;
  const int64_t pin = 3LL * v.patch_size * v.patch_size;
  s.push_back({p + "patch_embedder.input_proj.weight", {Dv, pin}});
  s.push_back({p + "patch_embedder.position_embedding_table", {2, v.position_embedding_size, Dv}});
  for (int64_t i = 0; i < v.num_hidden_layers; ++i) {
    const std::string l = p + "encoder.layers." + std::to_string(i) + ".";
    auto linear = [&](const std::string& name, Shape shape) {
      s.push_back({l + name + ".linear.weight", std::move(shape)});
      if (v.use_clipped_linears)
        for (const char* b : {"input_min", "input_max", "output_min", "output_max"})
          s.push_back({l + name + "." + b, {}});
    };
    linear("self_attn.q_proj", {v.num_attention_heads * hd, Dv});
    linear("self_attn.k_proj", {v.num_key_value_heads * hd, Dv});
    linear("self_attn.v_proj", {v.num_key_value_heads * hd, Dv});
    linear("self_attn.o_proj", {Dv, v.num_attention_heads * hd});
    linear("mlp.gate_proj", {I, Dv});
    linear("mlp.up_proj", {I, Dv});
    linear("mlp.down_proj", {Dv, I});
    s.push_back({l + "self_attn.q_norm.weight", {hd}});
    s.push_back({l + "self_attn.k_norm.weight", {hd}});
    for (const char* n : {"input_layernorm", "post_attention_layernorm",
                          "pre_feedforward_layernorm", "post_feedforward_layernorm"})
      s.push_back({l + n + ".weight", {Dv}});
  }
  if (v.standardize) {
    s.push_back({p + "std_bias", {Dv}});
    s.push_back({p + "std_scale", {Dv}});
  }
  s.push_back({"model.embed_vision.embedding_projection.weight", {c.text.hidden_size, Dv}});
  return s;
}

std::vector<std::string> validate_tensors(const std::vector<TensorSpec>& specs,
                                          const TensorStore& store, const ModelConfig& c) {
  std::ostringstream problems;
  int n_problems = 0;
  std::set<std::string> known;
  for (const TensorSpec& sp : specs) {
    known.insert(sp.key);
    if (!store.has(sp.key)) {
      if (sp.role == TensorRole::Required) {
        problems << "\n  missing tensor " << sp.key << " (expected shape " << shape_str(sp.shape)
                 << ")";
        ++n_problems;
      }
      continue;
    }
    if (sp.role == TensorRole::Ignored) continue;
    const WeightView v = store.view(sp.key);
    const WeightView* e = &v;
    if (e->shape != sp.shape) {
      problems << "\n  " << store.file_of(sp.key) << ": tensor " << sp.key << ": expected shape "
               << shape_str(sp.shape) << ", found " << shape_str(e->shape);
      ++n_problems;
    }
    if (e->dtype != DType::F32 && e->dtype != DType::BF16 && e->dtype != DType::F16 &&
        e->dtype != DType::Q8_0 && e->dtype != DType::Q4_0) {
      problems << "\n  " << store.file_of(sp.key) << ": tensor " << sp.key << ": dtype "
               << dtype_name(e->dtype)
               << " is not supported (expected F32, BF16, F16, Q8_0 or Q4_0)";
      ++n_problems;
    }
  }
  if (n_problems)
    fail(c.source, ": the checkpoint does not match its config (", n_problems, " problem",
         n_problems > 1 ? "s" : "", "):", problems.str());
  std::vector<std::string> unknown;
  for (const std::string& k : store.keys()) {
    if (known.count(k)) continue;
    if (k.rfind("model.audio_tower.", 0) == 0 || k.rfind("model.embed_audio.", 0) == 0) continue;
    unknown.push_back(k);
  }
  return unknown;
}

std::vector<float> vector_to_f32(const WeightView& w) {
  std::vector<float> v(static_cast<size_t>(shape_numel(w.shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = weight_at(w, static_cast<int64_t>(i));
  return v;
}

TextWeights bind_text_weights(const ModelConfig& c, const TensorSource& store,
                              const TextParts& parts) {
  const TextConfig& t = c.text;
  const std::string p = c.text_prefix();
  TextWeights w;
  if (parts.embeddings || parts.head) w.embed_tokens = store.view(p + "embed_tokens.weight");
  if (parts.head) w.final_norm = vector_to_f32(store.view(p + "norm.weight"));
  if (parts.embeddings && t.has_ple()) {
    w.embed_tokens_per_layer = store.view(p + "embed_tokens_per_layer.weight");
    w.per_layer_model_projection = store.view(p + "per_layer_model_projection.weight");
    w.per_layer_projection_norm = vector_to_f32(store.view(p + "per_layer_projection_norm.weight"));
  }
  w.layers.resize(static_cast<size_t>(t.num_hidden_layers));
  const int end = parts.layer_end < 0 ? t.num_hidden_layers : parts.layer_end;
  for (int i = parts.layer_begin; i < end; ++i) {
    const LayerSpec& ls = t.layers[static_cast<size_t>(i)];
    TextLayerWeights& lw = w.layers[static_cast<size_t>(i)];
    const std::string l = p + "layers." + std::to_string(i) + ".";
    lw.input_layernorm = vector_to_f32(store.view(l + "input_layernorm.weight"));
    lw.post_attention_layernorm = vector_to_f32(store.view(l + "post_attention_layernorm.weight"));
    lw.pre_feedforward_layernorm =
        vector_to_f32(store.view(l + "pre_feedforward_layernorm.weight"));
    lw.post_feedforward_layernorm =
        vector_to_f32(store.view(l + "post_feedforward_layernorm.weight"));
    lw.q_proj = store.view(l + "self_attn.q_proj.weight");
    lw.o_proj = store.view(l + "self_attn.o_proj.weight");
    lw.q_norm = vector_to_f32(store.view(l + "self_attn.q_norm.weight"));
    if (!ls.kv_shared) {
      lw.k_proj = store.view(l + "self_attn.k_proj.weight");
      lw.v_proj = store.view(l + "self_attn.v_proj.weight");
      lw.k_norm = vector_to_f32(store.view(l + "self_attn.k_norm.weight"));
    }
    lw.gate_proj = store.view(l + "mlp.gate_proj.weight");
    lw.up_proj = store.view(l + "mlp.up_proj.weight");
    lw.down_proj = store.view(l + "mlp.down_proj.weight");
    if (t.has_ple()) {
      lw.per_layer_input_gate = store.view(l + "per_layer_input_gate.weight");
      lw.per_layer_projection = store.view(l + "per_layer_projection.weight");
      lw.post_per_layer_input_norm =
          vector_to_f32(store.view(l + "post_per_layer_input_norm.weight"));
    }
    lw.layer_scalar = weight_at(store.view(l + "layer_scalar"), 0);
    lw.bound = true;
  }
  return w;
}

}  // namespace gemstage
