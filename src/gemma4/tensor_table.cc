#include "gemma4/tensor_table.h"

#include "gemma4/audio_model.h"
#include "gemma4/registry.h"
#include "gemma4/unified_embedder.h"
#include "gemma4/vision_model.h"
#include "kernels/weight_rows.h"

namespace gemstage {

namespace {

// `info` labels (tools/cmd_info.cc prints them in sorted order).
constexpr const char* kInfoEmbed = "text: token embedding (tied LM head)";
constexpr const char* kInfoPleTable = "text: PLE table (gathered, not multiplied)";
constexpr const char* kInfoPleProjection = "text: PLE projection";
constexpr const char* kInfoLayers = "text: decoder layers";
constexpr const char* kInfoExperts = "text: MoE experts (top-k read per token)";
constexpr const char* kInfoKvUnused = "text: KV-shared layers' unused k/v (ignored)";
constexpr const char* kInfoFinalNorm = "text: final norm";
constexpr const char* kInfoVision = "vision tower + embedder";
constexpr const char* kInfoAudio = "audio tower + embedder";
constexpr const char* kInfoUnifiedVision = "image embedder (no tower)";
constexpr const char* kInfoUnifiedAudio = "audio embedder (no tower)";
// lm_head.weight sits outside the text prefix and has always been counted as "other".
constexpr const char* kInfoOther = "other";

TensorSlot view_slot(WeightView& v) {
  return {.view = &v};
}
TensorSlot floats_slot(std::vector<float>& v) {
  return {.floats = &v};
}
TensorSlot scalar_slot(float& v) {
  return {.scalar = &v};
}

void drop_slots(std::vector<TensorSpec>& s) {
  for (TensorSpec& e : s) e.slot = {};
}

}  // namespace

const char* const kUnrunInfoPart = "audio tower (not run)";

bool is_unrun_tensor(const std::string& k) {
  return k.rfind("model.audio_tower.", 0) == 0 || k.rfind("model.embed_audio.", 0) == 0;
}

DType storage_dtype(TensorStorage s, DType weights, DType ple) {
  switch (s) {
    case TensorStorage::Matrix:
      return weights;
    case TensorStorage::Vector:
      // Follows a bf16 bundle's rounding, like an HF bf16 checkpoint; quantized and f32
      // bundles keep vectors in f32.
      return weights == DType::BF16 ? DType::BF16 : DType::F32;
    case TensorStorage::VisionMatrix:
      return weights == DType::F32 ? DType::F32 : DType::BF16;
    case TensorStorage::VisionVector:
      return DType::F32;
    case TensorStorage::PleTable:
      return ple;
  }
  return weights;
}

bool part_holds(const PartSet& held, const TensorSpec& s) {
  const PartMask common = s.held_by & held.parts;
  if (common & ~kPartLayer) return true;
  if (common & kPartLayer) return s.layer >= held.layer_begin && s.layer < held.layer_end;
  return false;
}

void bind_tensor(const TensorSpec& s, const TensorSource& store) {
  if (s.slot.view)
    *s.slot.view = store.view(s.key);
  else if (s.slot.floats)
    *s.slot.floats = vector_to_f32(store.view(s.key));
  else if (s.slot.scalar)
    *s.slot.scalar = weight_at(store.view(s.key), 0);
}

std::vector<TensorSpec> text_tensor_specs(const ModelConfig& c, TextWeights* bind) {
  using enum TensorStorage;
  using enum TensorRole;
  const TextConfig& t = c.text;
  const std::string p = c.text_prefix();
  const int64_t D = t.hidden_size, L = t.num_hidden_layers, P = t.ple_dim(),
                H = t.num_attention_heads;
  TextWeights scratch;
  TextWeights& w = bind ? *bind : scratch;
  w.layers.resize(static_cast<size_t>(L));
  std::vector<TensorSpec> s;
  // The order is the export order of each stage file: changing it changes bundle bytes.
  s.push_back({.key = p + "embed_tokens.weight",
               .shape = {t.vocab_size, D},
               .held_by = kPartEmbeddings | kPartHead,
               .storage = Matrix,
               .decode_read_in = kPartHead,
               .info_part = kInfoEmbed,
               .slot = view_slot(w.embed_tokens)});
  s.push_back({.key = p + "norm.weight",
               .shape = {D},
               .held_by = kPartHead,
               .storage = Vector,
               .info_part = kInfoFinalNorm,
               .slot = floats_slot(w.final_norm)});
  if (t.has_ple()) {
    s.push_back({.key = p + "embed_tokens_per_layer.weight",
                 .shape = {t.vocab_size_per_layer_input, L * P},
                 .held_by = kPartEmbeddings,
                 .storage = PleTable,
                 .info_part = kInfoPleTable,
                 .slot = view_slot(w.embed_tokens_per_layer)});
    s.push_back({.key = p + "per_layer_model_projection.weight",
                 .shape = {L * P, D},
                 .held_by = kPartEmbeddings,
                 .storage = Matrix,
                 .info_part = kInfoPleProjection,
                 .slot = view_slot(w.per_layer_model_projection)});
    s.push_back({.key = p + "per_layer_projection_norm.weight",
                 .shape = {P},
                 .held_by = kPartEmbeddings,
                 .storage = Vector,
                 .info_part = kInfoPleProjection,
                 .slot = floats_slot(w.per_layer_projection_norm)});
  }
  for (int64_t i = 0; i < L; ++i) {
    const LayerSpec& ls = t.layers[static_cast<size_t>(i)];
    TextLayerWeights& lw = w.layers[static_cast<size_t>(i)];
    const std::string l = p + "layers." + std::to_string(i) + ".";
    const int64_t hd = ls.head_dim, kv = ls.num_kv_heads, I = ls.mlp_width;
    // A layer's matrix: quantizable, and read whole for every decoded token.
    auto matrix = [&](const std::string& name, Shape shape, WeightView& slot) {
      s.push_back({.key = l + name,
                   .shape = std::move(shape),
                   .held_by = kPartLayer,
                   .layer = static_cast<int>(i),
                   .storage = Matrix,
                   .decode_read_in = kPartLayer,
                   .info_part = kInfoLayers,
                   .slot = view_slot(slot)});
    };
    auto vector = [&](const std::string& name, Shape shape, TensorSlot slot) {
      s.push_back({.key = l + name,
                   .shape = std::move(shape),
                   .held_by = kPartLayer,
                   .layer = static_cast<int>(i),
                   .storage = Vector,
                   .info_part = kInfoLayers,
                   .slot = slot});
    };
    // KV-shared layers read their donor's cache: HF stores but never reads their k/v/k_norm.
    auto kv_unused = [&](const std::string& name, Shape shape) {
      s.push_back({.key = l + name,
                   .shape = std::move(shape),
                   .role = Ignored,
                   .held_by = kPartLayer,
                   .layer = static_cast<int>(i),
                   .storage = name.ends_with("norm.weight") ? Vector : Matrix,
                   .info_part = kInfoKvUnused});
    };
    vector("input_layernorm.weight", {D}, floats_slot(lw.input_layernorm));
    vector("post_attention_layernorm.weight", {D}, floats_slot(lw.post_attention_layernorm));
    vector("pre_feedforward_layernorm.weight", {D}, floats_slot(lw.pre_feedforward_layernorm));
    vector("post_feedforward_layernorm.weight", {D}, floats_slot(lw.post_feedforward_layernorm));
    matrix("self_attn.q_proj.weight", {H * hd, D}, lw.q_proj);
    if (ls.kv_shared) {
      kv_unused("self_attn.k_proj.weight", {kv * hd, D});
      kv_unused("self_attn.v_proj.weight", {kv * hd, D});
    } else {
      matrix("self_attn.k_proj.weight", {kv * hd, D}, lw.k_proj);
      // attention_k_eq_v: V comes from the raw k_proj output; there is no v_proj.
      if (!ls.k_eq_v) matrix("self_attn.v_proj.weight", {kv * hd, D}, lw.v_proj);
    }
    matrix("self_attn.o_proj.weight", {D, H * hd}, lw.o_proj);
    vector("self_attn.q_norm.weight", {hd}, floats_slot(lw.q_norm));
    if (ls.kv_shared)
      kv_unused("self_attn.k_norm.weight", {hd});
    else
      vector("self_attn.k_norm.weight", {hd}, floats_slot(lw.k_norm));
    matrix("mlp.gate_proj.weight", {I, D}, lw.gate_proj);
    matrix("mlp.up_proj.weight", {I, D}, lw.up_proj);
    matrix("mlp.down_proj.weight", {D, I}, lw.down_proj);
    if (ls.moe) {
      const int64_t E = t.num_experts, Im = t.moe_intermediate_size;
      vector("pre_feedforward_layernorm_2.weight", {D},
             floats_slot(lw.pre_feedforward_layernorm_2));
      vector("post_feedforward_layernorm_1.weight", {D},
             floats_slot(lw.post_feedforward_layernorm_1));
      vector("post_feedforward_layernorm_2.weight", {D},
             floats_slot(lw.post_feedforward_layernorm_2));
      // The router's projection stays float (never quantized): its scores pick the experts, and
      // a rounding that flips a choice changes the output far more than the bytes it saves.
      vector("router.proj.weight", {E, D}, view_slot(lw.router_proj));
      vector("router.scale", {D}, floats_slot(lw.router_scale));
      vector("router.per_expert_scale", {E}, floats_slot(lw.router_per_expert_scale));
      // Stacked experts: each expert's matrix is a contiguous slice of whole rows, so it is
      // quantized and multiplied on its own; a decoded token reads top_k of the E slices.
      auto experts = [&](const std::string& name, Shape shape, WeightView& slot) {
        s.push_back({.key = l + name,
                     .shape = std::move(shape),
                     .held_by = kPartLayer,
                     .layer = static_cast<int>(i),
                     .storage = Matrix,
                     .decode_read_in = kPartLayer,
                     .decode_share = static_cast<double>(t.top_k_experts) / t.num_experts,
                     .info_part = kInfoExperts,
                     .slot = view_slot(slot)});
      };
      experts("experts.gate_up_proj", {E, 2 * Im, D}, lw.experts_gate_up);
      experts("experts.down_proj", {E, D, Im}, lw.experts_down);
    }
    if (t.has_ple()) {
      matrix("per_layer_input_gate.weight", {P, D}, lw.per_layer_input_gate);
      matrix("per_layer_projection.weight", {D, P}, lw.per_layer_projection);
      vector("post_per_layer_input_norm.weight", {D}, floats_slot(lw.post_per_layer_input_norm));
    }
    vector("layer_scalar", {1}, scalar_slot(lw.layer_scalar));
  }
  // Tied to embed_tokens: HF never reads it, so no part holds it.
  s.push_back({.key = "lm_head.weight",
               .shape = {t.vocab_size, D},
               .role = Ignored,
               .storage = Matrix,
               .info_part = kInfoOther});
  if (!bind) drop_slots(s);
  return s;
}

std::vector<TensorSpec> vision_tensor_specs(const ModelConfig& c, VisionWeights* bind) {
  using enum TensorStorage;
  std::vector<TensorSpec> s;
  if (!c.vision) return s;
  const VisionConfig& v = *c.vision;
  VisionWeights scratch;
  VisionWeights& w = bind ? *bind : scratch;
  w.layers.resize(static_cast<size_t>(v.num_hidden_layers));
  const std::string p = "model.vision_tower.";
  const int64_t Dv = v.hidden_size, I = v.intermediate_size, hd = v.head_dim;
  const int64_t pin = 3LL * v.patch_size * v.patch_size;
  // The tower runs in the embeddings stage's process but is its own part: never quantized.
  auto add = [&](std::string key, Shape shape, TensorStorage storage, TensorSlot slot) {
    s.push_back({.key = std::move(key),
                 .shape = std::move(shape),
                 .held_by = kPartVision,
                 .storage = storage,
                 .info_part = kInfoVision,
                 .slot = slot});
  };
  add(p + "patch_embedder.input_proj.weight", {Dv, pin}, VisionMatrix, view_slot(w.input_proj));
  add(p + "patch_embedder.position_embedding_table", {2, v.position_embedding_size, Dv},
      VisionMatrix, view_slot(w.position_table));
  for (int64_t i = 0; i < v.num_hidden_layers; ++i) {
    VisionLayerWeights& lw = w.layers[static_cast<size_t>(i)];
    const std::string l = p + "encoder.layers." + std::to_string(i) + ".";
    // Gemma4ClippableLinear: the weight, then (with use_clipped_linears) its four f32 bounds.
    auto linear = [&](const std::string& name, Shape shape, ClippableLinear& cl) {
      add(l + name + ".linear.weight", std::move(shape), VisionMatrix, view_slot(cl.weight));
      if (!v.use_clipped_linears) return;
      add(l + name + ".input_min", {}, VisionVector, scalar_slot(cl.input_min));
      add(l + name + ".input_max", {}, VisionVector, scalar_slot(cl.input_max));
      add(l + name + ".output_min", {}, VisionVector, scalar_slot(cl.output_min));
      add(l + name + ".output_max", {}, VisionVector, scalar_slot(cl.output_max));
    };
    linear("self_attn.q_proj", {v.num_attention_heads * hd, Dv}, lw.q_proj);
    linear("self_attn.k_proj", {v.num_key_value_heads * hd, Dv}, lw.k_proj);
    linear("self_attn.v_proj", {v.num_key_value_heads * hd, Dv}, lw.v_proj);
    linear("self_attn.o_proj", {Dv, v.num_attention_heads * hd}, lw.o_proj);
    linear("mlp.gate_proj", {I, Dv}, lw.gate_proj);
    linear("mlp.up_proj", {I, Dv}, lw.up_proj);
    linear("mlp.down_proj", {Dv, I}, lw.down_proj);
    add(l + "self_attn.q_norm.weight", {hd}, VisionVector, floats_slot(lw.q_norm));
    add(l + "self_attn.k_norm.weight", {hd}, VisionVector, floats_slot(lw.k_norm));
    add(l + "input_layernorm.weight", {Dv}, VisionVector, floats_slot(lw.input_layernorm));
    add(l + "post_attention_layernorm.weight", {Dv}, VisionVector,
        floats_slot(lw.post_attention_layernorm));
    add(l + "pre_feedforward_layernorm.weight", {Dv}, VisionVector,
        floats_slot(lw.pre_feedforward_layernorm));
    add(l + "post_feedforward_layernorm.weight", {Dv}, VisionVector,
        floats_slot(lw.post_feedforward_layernorm));
  }
  if (v.standardize) {
    add(p + "std_bias", {Dv}, VisionVector, floats_slot(w.std_bias));
    add(p + "std_scale", {Dv}, VisionVector, floats_slot(w.std_scale));
  }
  add("model.embed_vision.embedding_projection.weight", {c.text.hidden_size, Dv}, VisionMatrix,
      view_slot(w.embedding_projection));
  if (!bind) drop_slots(s);
  return s;
}

std::vector<TensorSpec> audio_tensor_specs(const ModelConfig& c, AudioWeights* bind) {
  using enum TensorStorage;
  std::vector<TensorSpec> s;
  if (!c.audio) return s;
  const AudioConfig& a = *c.audio;
  AudioWeights scratch;
  AudioWeights& w = bind ? *bind : scratch;
  w.layers.resize(static_cast<size_t>(a.num_hidden_layers));
  const std::string p = "model.audio_tower.";
  const int64_t H = a.hidden_size, c0 = a.subsampling_channels[0], c1 = a.subsampling_channels[1];
  auto add = [&](std::string key, Shape shape, TensorStorage storage, TensorSlot slot) {
    s.push_back({.key = std::move(key),
                 .shape = std::move(shape),
                 .held_by = kPartAudio,
                 .storage = storage,
                 .info_part = kInfoAudio,
                 .slot = slot});
  };
  const std::string sc = p + "subsample_conv_projection.";
  add(sc + "layer0.conv.weight", {c0, 1, 3, 3}, VisionVector, floats_slot(w.conv0));
  add(sc + "layer0.norm.weight", {c0}, VisionVector, floats_slot(w.norm0));
  add(sc + "layer1.conv.weight", {c1, c0, 3, 3}, VisionVector, floats_slot(w.conv1));
  add(sc + "layer1.norm.weight", {c1}, VisionVector, floats_slot(w.norm1));
  add(sc + "input_proj_linear.weight", {H, a.subsample_out_dim()}, VisionMatrix,
      view_slot(w.input_proj));
  for (int64_t i = 0; i < a.num_hidden_layers; ++i) {
    AudioLayerWeights& lw = w.layers[static_cast<size_t>(i)];
    const std::string l = p + "layers." + std::to_string(i) + ".";
    // Gemma4ClippableLinear: the weight, then (with use_clipped_linears) its four f32 bounds.
    auto linear = [&](const std::string& name, Shape shape, ClippableLinear& cl) {
      add(l + name + ".linear.weight", std::move(shape), VisionMatrix, view_slot(cl.weight));
      if (!a.use_clipped_linears) return;
      add(l + name + ".input_min", {}, VisionVector, scalar_slot(cl.input_min));
      add(l + name + ".input_max", {}, VisionVector, scalar_slot(cl.input_max));
      add(l + name + ".output_min", {}, VisionVector, scalar_slot(cl.output_min));
      add(l + name + ".output_max", {}, VisionVector, scalar_slot(cl.output_max));
    };
    for (int f = 1; f <= 2; ++f) {
      AudioFfnWeights& fw = f == 1 ? lw.feed_forward1 : lw.feed_forward2;
      const std::string ff = "feed_forward" + std::to_string(f);
      linear(ff + ".ffw_layer_1", {4 * H, H}, fw.ffw_layer_1);
      linear(ff + ".ffw_layer_2", {H, 4 * H}, fw.ffw_layer_2);
      add(l + ff + ".pre_layer_norm.weight", {H}, VisionVector, floats_slot(fw.pre_layer_norm));
      add(l + ff + ".post_layer_norm.weight", {H}, VisionVector, floats_slot(fw.post_layer_norm));
    }
    linear("self_attn.q_proj", {H, H}, lw.q_proj);
    linear("self_attn.k_proj", {H, H}, lw.k_proj);
    linear("self_attn.v_proj", {H, H}, lw.v_proj);
    linear("self_attn.post", {H, H}, lw.post);
    add(l + "self_attn.relative_k_proj.weight", {H, H}, VisionMatrix,
        view_slot(lw.relative_k_proj));
    add(l + "self_attn.per_dim_scale", {a.head_dim()}, VisionVector, floats_slot(lw.per_dim_scale));
    linear("lconv1d.linear_start", {2 * H, H}, lw.linear_start);
    linear("lconv1d.linear_end", {H, H}, lw.linear_end);
    add(l + "lconv1d.depthwise_conv1d.weight", {H, 1, a.conv_kernel_size}, VisionVector,
        floats_slot(lw.depthwise_conv));
    add(l + "lconv1d.pre_layer_norm.weight", {H}, VisionVector, floats_slot(lw.lconv_pre_norm));
    add(l + "lconv1d.conv_norm.weight", {H}, VisionVector, floats_slot(lw.conv_norm));
    add(l + "norm_pre_attn.weight", {H}, VisionVector, floats_slot(lw.norm_pre_attn));
    add(l + "norm_post_attn.weight", {H}, VisionVector, floats_slot(lw.norm_post_attn));
    add(l + "norm_out.weight", {H}, VisionVector, floats_slot(lw.norm_out));
  }
  add(p + "output_proj.weight", {a.output_proj_dims, H}, VisionMatrix, view_slot(w.output_proj));
  add(p + "output_proj.bias", {a.output_proj_dims}, VisionVector, floats_slot(w.output_proj_bias));
  add("model.embed_audio.embedding_projection.weight", {c.text.hidden_size, a.output_proj_dims},
      VisionMatrix, view_slot(w.embedding_projection));
  if (!bind) drop_slots(s);
  return s;
}

std::vector<TensorSpec> unified_tensor_specs(const ModelConfig& c, UnifiedVisionWeights* vision,
                                             UnifiedAudioWeights* audio) {
  using enum TensorStorage;
  std::vector<TensorSpec> s;
  if (!c.unified) return s;
  const int64_t D = c.text.hidden_size;
  auto add = [&](std::string key, Shape shape, PartMask part, TensorStorage storage,
                 TensorSlot slot) {
    s.push_back({.key = std::move(key),
                 .shape = std::move(shape),
                 .held_by = part,
                 .storage = storage,
                 .info_part = part == kPartVision ? kInfoUnifiedVision : kInfoUnifiedAudio,
                 .slot = slot});
  };
  if (c.unified_vision) {
    const UnifiedVisionConfig& v = *c.unified_vision;
    UnifiedVisionWeights scratch;
    UnifiedVisionWeights& w = vision ? *vision : scratch;
    const int64_t pd = v.patch_dim(), E = v.mm_embed_dim;
    const std::string p = "model.vision_embedder.";
    add(p + "patch_ln1.weight", {pd}, kPartVision, VisionVector, floats_slot(w.patch_ln1_weight));
    add(p + "patch_ln1.bias", {pd}, kPartVision, VisionVector, floats_slot(w.patch_ln1_bias));
    add(p + "patch_dense.weight", {E, pd}, kPartVision, VisionMatrix, view_slot(w.patch_dense));
    add(p + "patch_dense.bias", {E}, kPartVision, VisionVector, floats_slot(w.patch_dense_bias));
    add(p + "patch_ln2.weight", {E}, kPartVision, VisionVector, floats_slot(w.patch_ln2_weight));
    add(p + "patch_ln2.bias", {E}, kPartVision, VisionVector, floats_slot(w.patch_ln2_bias));
    add(p + "pos_embedding", {v.mm_posemb_size, 2, E}, kPartVision, VisionMatrix,
        view_slot(w.pos_embedding));
    add(p + "pos_norm.weight", {E}, kPartVision, VisionVector, floats_slot(w.pos_norm_weight));
    add(p + "pos_norm.bias", {E}, kPartVision, VisionVector, floats_slot(w.pos_norm_bias));
    add("model.embed_vision.embedding_projection.weight", {D, E}, kPartVision, VisionMatrix,
        view_slot(w.embedding_projection));
  }
  if (c.unified_audio) {
    UnifiedAudioWeights scratch;
    UnifiedAudioWeights& w = audio ? *audio : scratch;
    add("model.embed_audio.embedding_projection.weight", {D, c.unified_audio->frame_samples},
        kPartAudio, VisionMatrix, view_slot(w.embedding_projection));
  }
  // Slots into the scratch structs would dangle: only the given targets keep theirs.
  for (TensorSpec& e : s)
    if ((e.held_by == kPartVision && !vision) || (e.held_by == kPartAudio && !audio)) e.slot = {};
  return s;
}

std::vector<TensorSpec> tensor_table(const ModelConfig& c) {
  std::vector<TensorSpec> s = text_tensor_specs(c);
  std::vector<TensorSpec> v = vision_tensor_specs(c);
  s.insert(s.end(), std::make_move_iterator(v.begin()), std::make_move_iterator(v.end()));
  std::vector<TensorSpec> a = audio_tensor_specs(c);
  s.insert(s.end(), std::make_move_iterator(a.begin()), std::make_move_iterator(a.end()));
  std::vector<TensorSpec> u = unified_tensor_specs(c);
  s.insert(s.end(), std::make_move_iterator(u.begin()), std::make_move_iterator(u.end()));
  return s;
}

}  // namespace gemstage
