#include "gemma4/presets.h"

#include <algorithm>

#include "core/error.h"

namespace gemstage {

using nlohmann::json;

namespace {

// large: the 26B-A4B / 31B tower (hidden 1152, 27 layers, no clip bounds, standardize).
json vision_config(bool tiny, bool large) {
  json v = {{"model_type", "gemma4_vision"},
            {"hidden_size", tiny    ? 64
                            : large ? 1152
                                    : 768},
            {"intermediate_size", tiny    ? 128
                                  : large ? 4304
                                          : 3072},
            {"num_hidden_layers", tiny    ? 2
                                  : large ? 27
                                          : 16},
            {"num_attention_heads", tiny    ? 2
                                    : large ? 16
                                            : 12},
            {"num_key_value_heads", tiny    ? 2
                                    : large ? 16
                                            : 12},
            {"head_dim", tiny    ? 32
                         : large ? 72
                                 : 64},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"rms_norm_eps", 1e-6},
            {"max_position_embeddings", 131072},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"rope_parameters", {{"rope_type", "default"}, {"rope_theta", 100.0}}},
            {"pooling_kernel_size", 3},
            {"patch_size", 16},
            {"position_embedding_size", tiny ? 32 : 10240},
            {"use_clipped_linears", !large},
            {"standardize", large},
            {"initializer_range", 0.02}};
  if (!tiny) v["default_output_length"] = 280;
  return v;
}

}  // namespace

json preset_config(const std::string& preset, int num_layers, const std::string& dtype) {
  struct Dims {
    int D, L, H, Hkv, hd, ghd, I, shared, period, vocab, ple, window;
    bool wide;
    // The large models (docs: gemma4-large.md): global KV heads with attention_k_eq_v (0: the
    // E-series, null), experts (0: none), top-k, expert width.
    int global_kv = 0, experts = 0, top_k = 0, expert_I = 0;
  };
  Dims d{};
  if (preset == "tiny")
    d = {128, 6, 4, 1, 32, 64, 256, 2, 3, 2048, 32, 8, true};
  else if (preset == "e2b")
    d = {1536, 35, 8, 1, 256, 512, 6144, 20, 5, 262144, 256, 512, true};
  else if (preset == "e4b")
    d = {2560, 42, 8, 2, 256, 512, 10240, 18, 6, 262144, 256, 512, false};
  else if (preset == "26b-a4b")
    d = {2816, 30, 16, 8, 256, 512, 2112, 0, 6, 262144, 0, 1024, false, 2, 128, 8, 704};
  else if (preset == "31b")
    d = {5376, 60, 32, 16, 256, 512, 21504, 0, 6, 262144, 0, 1024, false, 4};
  else if (preset == "12b")  // gemma4_unified (docs: gemma4-unified.md)
    d = {3840, 48, 16, 8, 256, 512, 15360, 0, 6, 262144, 0, 1024, false, 1};
  else
    fail("unknown preset '", preset, "' (use tiny, e2b, e4b, 26b-a4b, 31b or 12b)");
  const bool large = d.global_kv > 0;
  auto or_null = [](int v) { return v > 0 ? json(v) : json(nullptr); };
  const int full_L = d.L;
  if (num_layers > 0) {
    if (num_layers < 2)
      fail("--layers must be at least 2 (one own-KV layer of each type is needed before sharing)");
    d.shared = std::min(num_layers - 2,
                        static_cast<int>(static_cast<long>(d.shared) * num_layers / full_L));
    d.L = num_layers;
  }
  std::vector<std::string> types;
  for (int i = 0; i < d.L; ++i)
    types.push_back((i % d.period) == d.period - 1 ? "full_attention" : "sliding_attention");
  types.back() = "full_attention";
  // A short stack must still have a full layer before the shared block to act as donor.
  const int first_shared = d.L - d.shared;
  bool has_full_donor = false;
  for (int i = 0; i < first_shared; ++i)
    has_full_donor = has_full_donor || types[static_cast<size_t>(i)] == "full_attention";
  if (!has_full_donor && first_shared > 1)
    types[static_cast<size_t>(first_shared - 1)] = "full_attention";
  if (!has_full_donor && first_shared <= 1) d.shared = 0;

  json t = {{"model_type", "gemma4_text"},
            {"vocab_size", d.vocab},
            {"hidden_size", d.D},
            {"intermediate_size", d.I},
            {"num_hidden_layers", d.L},
            {"num_attention_heads", d.H},
            {"num_key_value_heads", d.Hkv},
            {"head_dim", d.hd},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"max_position_embeddings", large ? 262144 : 131072},
            {"initializer_range", 0.02},
            {"rms_norm_eps", 1e-6},
            {"use_cache", true},
            {"pad_token_id", 0},
            {"eos_token_id", 1},
            {"bos_token_id", 2},
            {"tie_word_embeddings", true},
            {"rope_parameters",
             {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10000.0}}},
              {"full_attention",
               {{"rope_type", "proportional"},
                {"partial_rotary_factor", 0.25},
                {"rope_theta", 1000000.0}}}}},
            {"attention_bias", false},
            {"attention_dropout", 0.0},
            {"sliding_window", d.window},
            {"layer_types", types},
            {"final_logit_softcapping", 30.0},
            {"use_bidirectional_attention", large ? json("vision") : json(nullptr)},
            {"vocab_size_per_layer_input", d.vocab},
            {"hidden_size_per_layer_input", d.ple},
            {"num_global_key_value_heads", or_null(d.global_kv)},
            {"global_head_dim", d.ghd},
            {"attention_k_eq_v", large},
            {"num_kv_shared_layers", d.shared},
            {"enable_moe_block", d.experts > 0},
            {"use_double_wide_mlp", d.wide},
            {"num_experts", or_null(d.experts)},
            {"top_k_experts", or_null(d.top_k)},
            {"moe_intermediate_size", or_null(d.expert_I)},
            {"dtype", dtype}};
  const bool tiny = preset == "tiny";
  json c = {{"architectures", {"Gemma4ForConditionalGeneration"}},
            {"model_type", "gemma4"},
            {"text_config", t},
            {"vision_config", vision_config(tiny, large)},
            {"audio_config", nullptr},
            {"initializer_range", 0.02},
            {"tie_word_embeddings", true},
            {"dtype", dtype},
            {"boi_token_id", tiny ? 2000 : 255999},
            {"boa_token_id", tiny ? 2001 : 256000},
            {"image_token_id", tiny ? 2040 : 258880},
            {"audio_token_id", tiny ? 2041 : 258881},
            {"eoi_token_id", tiny ? 2042 : 258882},
            {"eoa_token_index", tiny ? 2043 : 258883},
            {"video_token_id", tiny ? 2044 : 258884},
            {"eos_token_id", {1, 106}}};
  if (!tiny) c["vision_soft_tokens_per_image"] = 280;
  if (preset == "12b") {
    // No towers: the image and audio embedders of Gemma4UnifiedForConditionalGeneration.
    c["architectures"] = {"Gemma4UnifiedForConditionalGeneration"};
    c["model_type"] = "gemma4_unified";
    c["text_config"]["model_type"] = "gemma4_unified_text";
    c["vision_config"] = {{"model_type", "gemma4_unified_vision"},
                          {"patch_size", 16},
                          {"pooling_kernel_size", 3},
                          {"mm_embed_dim", 3840},
                          {"mm_posemb_size", 1120},
                          {"num_soft_tokens", 280},
                          {"model_patch_size", 48},
                          {"output_proj_dims", 3840},
                          {"rms_norm_eps", 1e-6},
                          {"initializer_range", 0.02}};
    c["audio_config"] = {{"model_type", "gemma4_unified_audio"},
                         {"audio_embed_dim", 640},
                         {"audio_samples_per_token", 640},
                         {"hidden_size", 640},
                         {"output_proj_dims", 640},
                         {"rms_norm_eps", 1e-6},
                         {"initializer_range", 0.02}};
    c.erase("vision_soft_tokens_per_image");
  }
  return c;
}

bool is_assistant_preset(const std::string& preset) {
  return preset == "26b-a4b-assistant" || preset == "31b-assistant";
}

json assistant_preset_config(const std::string& preset, const std::string& dtype) {
  if (!is_assistant_preset(preset))
    fail("unknown assistant preset '", preset, "' (use 26b-a4b-assistant or 31b-assistant)");
  const json target =
      preset_config(preset.substr(0, preset.size() - std::string("-assistant").size()), 0, dtype);
  const json& tt = target["text_config"];
  json t = tt;
  t["hidden_size"] = 1024;
  t["intermediate_size"] = 4096;
  t["num_hidden_layers"] = 4;
  t["layer_types"] = {"sliding_attention", "sliding_attention", "sliding_attention",
                      "full_attention"};
  t["num_kv_shared_layers"] = 4;
  t["vocab_size_per_layer_input"] = 0;
  t["hidden_size_per_layer_input"] = 0;
  t["enable_moe_block"] = false;
  t["use_double_wide_mlp"] = false;
  t["num_experts"] = nullptr;
  t["top_k_experts"] = nullptr;
  t["moe_intermediate_size"] = nullptr;
  t["use_bidirectional_attention"] = nullptr;
  return {{"architectures", {"Gemma4AssistantForCausalLM"}},
          {"model_type", "gemma4_assistant"},
          {"backbone_hidden_size", tt["hidden_size"]},
          {"use_ordered_embeddings", false},
          {"num_centroids", 2048},
          {"centroid_intermediate_top_k", 32},
          {"tie_word_embeddings", true},
          {"text_config", t},
          {"dtype", dtype}};
}

}  // namespace gemstage
