// Gemma 4 configuration as read from a Hugging Face checkpoint's config.json, plus the per-layer
// facts derived from it (layer type, head dim, KV donor, MLP width). Everything downstream asks
// LayerSpec instead of re-deriving these rules.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace gemstage {

enum class LayerType { Sliding, Full };
const char* layer_type_name(LayerType t);

struct RopeParams {
  std::string type = "default";  // "default" or "proportional"
  double theta = 10000.0;
  double partial_rotary_factor = 1.0;
};

struct LayerSpec {
  LayerType type = LayerType::Sliding;
  int head_dim = 0;
  int num_kv_heads = 0;
  int mlp_width = 0;
  bool kv_shared = false;  // reads K/V produced by kv_donor, stores nothing
  int kv_donor = -1;       // for shared layers: the layer whose K/V it reads
  bool is_donor = false;   // some shared layer reads this layer's K/V
  // attention_k_eq_v on a full layer (26B-A4B, 31B): no v_proj; V = v_norm(raw k_proj output).
  bool k_eq_v = false;
  // enable_moe_block (26B-A4B): the dense MLP and the experts side by side (docs: gemma4-large.md).
  bool moe = false;
};

struct TextConfig {
  int vocab_size = 262144;
  int hidden_size = 2304;
  int intermediate_size = 9216;
  int num_hidden_layers = 30;
  int num_attention_heads = 8;
  int num_key_value_heads = 4;
  int head_dim = 256;
  int global_head_dim = 512;
  int num_global_key_value_heads = -1;  // -1: null in config.json
  double rms_norm_eps = 1e-6;
  int sliding_window = 512;
  int max_position_embeddings = 131072;
  double final_logit_softcapping = 0.0;  // 0: none
  int vocab_size_per_layer_input = 262144;
  int hidden_size_per_layer_input = 256;
  bool attention_k_eq_v = false;
  int num_kv_shared_layers = 0;
  bool use_double_wide_mlp = false;
  bool tie_word_embeddings = true;
  // Mixture of experts (enable_moe_block): num_experts experts of width moe_intermediate_size,
  // top_k_experts of them per token, next to the dense MLP of width intermediate_size.
  bool enable_moe_block = false;
  int num_experts = 0;
  int top_k_experts = 0;
  int moe_intermediate_size = 0;
  // use_bidirectional_attention "vision": on sliding layers the rows of one image also see the
  // later rows of the same image (the large models); false: plainly causal (the E-series).
  bool bidirectional_vision = false;
  int pad_token_id = 0, bos_token_id = 2;
  std::vector<int> eos_token_ids = {1};
  RopeParams rope_sliding{"default", 10000.0, 1.0};
  RopeParams rope_full{"proportional", 1e6, 0.25};
  std::vector<LayerType> layer_types;
  std::vector<LayerSpec> layers;  // derived

  int first_kv_shared_layer() const { return num_hidden_layers - num_kv_shared_layers; }
  int ple_dim() const { return hidden_size_per_layer_input; }
  bool has_ple() const { return hidden_size_per_layer_input > 0; }
};

struct VisionConfig {
  int hidden_size = 768;
  int intermediate_size = 3072;
  int num_hidden_layers = 16;
  int num_attention_heads = 12;
  int num_key_value_heads = 12;
  int head_dim = 64;
  double rms_norm_eps = 1e-6;
  double rope_theta = 100.0;
  int pooling_kernel_size = 3;
  int patch_size = 16;
  int position_embedding_size = 10240;
  bool use_clipped_linears = false;
  bool standardize = false;
  int default_output_length = 280;
};

// Gemma4AudioConfig (E-series audio tower; docs/gemma4-audio.md). Defaults are the class
// defaults, which E2B/E4B use.
struct AudioConfig {
  int hidden_size = 1024;
  int num_hidden_layers = 12;
  int num_attention_heads = 8;
  int subsampling_channels[2] = {128, 32};
  int conv_kernel_size = 5;
  int attention_chunk_size = 12;
  int attention_context_left = 13;
  int attention_context_right = 0;
  double attention_logit_cap = 50.0;
  double attention_invalid_logits_value = -1e9;
  double residual_weight = 0.5;
  double rms_norm_eps = 1e-6;
  double gradient_clipping = 1e10;
  bool use_clipped_linears = true;
  int output_proj_dims = 1536;

  int head_dim() const { return hidden_size / num_attention_heads; }
  // input_proj_linear's in-dim: (C0 // 4) * C1.
  int subsample_out_dim() const { return subsampling_channels[0] / 4 * subsampling_channels[1]; }
};

// gemma4_unified (12B) has no towers: 48-px image patches and raw audio frames go through small
// embedders into the decoder (docs/gemma4-unified.md). Defaults are the 12B's.
struct UnifiedVisionConfig {
  int patch_size = 16;
  int pooling_kernel_size = 3;
  int mm_embed_dim = 3840;     // patch_dense's output width
  int mm_posemb_size = 1120;   // rows of each factorised position table
  int num_soft_tokens = 280;   // the per-image budget
  double rms_norm_eps = 1e-6;  // the scale-free RMSNorm before the projection

  int block() const { return patch_size * pooling_kernel_size; }  // pixels per side of a patch
  int patch_dim() const { return 3 * block() * block(); }
};

struct UnifiedAudioConfig {
  int frame_samples = 640;  // samples per soft token (audio_embed_dim): 40 ms at 16 kHz
  double rms_norm_eps = 1e-6;
};

struct ModelConfig {
  std::string source;        // path of config.json, for messages
  std::string architecture;  // Gemma4ForConditionalGeneration / Gemma4ForCausalLM
  bool multimodal = true;    // text weights under model.language_model. (else model.)
  TextConfig text;
  std::optional<VisionConfig> vision;
  bool has_audio = false;  // audio_config present (then `audio` is set)
  std::optional<AudioConfig> audio;
  // gemma4_unified (Gemma4UnifiedForConditionalGeneration): embedders instead of towers.
  bool unified = false;
  std::optional<UnifiedVisionConfig> unified_vision;
  std::optional<UnifiedAudioConfig> unified_audio;
  // Audio rows get soft tokens (an audio tower, or the unified audio embedder).
  bool takes_audio() const { return audio.has_value() || unified_audio.has_value(); }
  int image_token_id = 258880, video_token_id = 258884, audio_token_id = 258881;
  int boi_token_id = 255999, eoi_token_id = 258882, boa_token_id = 256000, eoa_token_id = 258883;
  std::vector<std::string> warnings;  // unknown fields and the like, for the CLI to print

  std::string text_prefix() const { return multimodal ? "model.language_model." : "model."; }
  // Token ids whose rows are filled by a tower: their PLE/embedding identity becomes pad.
  std::vector<int> placeholder_token_ids() const {
    return {image_token_id, video_token_id, audio_token_id};
  }
};

// Reads DIR/config.json (both the flat global_head_dim layout and the per_layer_config layout).
ModelConfig load_model_config(const std::string& dir);
ModelConfig parse_model_config(const std::string& json_text, const std::string& source);

// Fills TextConfig::layers from the raw fields; throws if the fields are inconsistent.
void derive_layer_specs(TextConfig& t, const std::string& source);

}  // namespace gemstage
