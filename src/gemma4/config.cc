#include "gemma4/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

using nlohmann::json;

const char* layer_type_name(LayerType t) {
  return t == LayerType::Full ? "full_attention" : "sliding_attention";
}

namespace {

// Fields we read, plus fields HF writes that do not change the forward pass. Anything else is
// reported by name as a warning: newer transformers versions add benign fields, so refusing them
// would break real checkpoints, but a user must still see what was not understood.
const std::set<std::string> kKnownTextFields = {"model_type",
                                                "vocab_size",
                                                "hidden_size",
                                                "intermediate_size",
                                                "num_hidden_layers",
                                                "num_attention_heads",
                                                "num_key_value_heads",
                                                "head_dim",
                                                "global_head_dim",
                                                "num_global_key_value_heads",
                                                "hidden_activation",
                                                "hidden_act",
                                                "max_position_embeddings",
                                                "initializer_range",
                                                "rms_norm_eps",
                                                "use_cache",
                                                "pad_token_id",
                                                "eos_token_id",
                                                "bos_token_id",
                                                "tie_word_embeddings",
                                                "rope_parameters",
                                                "rope_scaling",
                                                "attention_bias",
                                                "attention_dropout",
                                                "sliding_window",
                                                "layer_types",
                                                "final_logit_softcapping",
                                                "use_bidirectional_attention",
                                                "vocab_size_per_layer_input",
                                                "hidden_size_per_layer_input",
                                                "attention_k_eq_v",
                                                "num_kv_shared_layers",
                                                "enable_moe_block",
                                                "use_double_wide_mlp",
                                                "num_experts",
                                                "top_k_experts",
                                                "moe_intermediate_size",
                                                "dtype",
                                                "torch_dtype",
                                                "per_layer_config",
                                                "architectures",
                                                "transformers_version",
                                                "_name_or_path",
                                                "output_attentions",
                                                "output_hidden_states",
                                                "return_dict",
                                                "chunk_size_feed_forward",
                                                "is_encoder_decoder",
                                                "id2label",
                                                "label2id",
                                                "problem_type",
                                                "tokenizer_class",
                                                "query_pre_attn_scalar",
                                                "attn_logit_softcapping"};
const std::set<std::string> kKnownVisionFields = {"model_type",
                                                  "hidden_size",
                                                  "intermediate_size",
                                                  "num_hidden_layers",
                                                  "num_attention_heads",
                                                  "num_key_value_heads",
                                                  "head_dim",
                                                  "global_head_dim",
                                                  "hidden_activation",
                                                  "hidden_act",
                                                  "rms_norm_eps",
                                                  "max_position_embeddings",
                                                  "attention_bias",
                                                  "attention_dropout",
                                                  "rope_parameters",
                                                  "pooling_kernel_size",
                                                  "patch_size",
                                                  "position_embedding_size",
                                                  "use_clipped_linears",
                                                  "standardize",
                                                  "initializer_range",
                                                  "dtype",
                                                  "torch_dtype",
                                                  "default_output_length",
                                                  "transformers_version",
                                                  "_name_or_path"};
const std::set<std::string> kKnownTopFields = {
    "architectures",       "model_type",
    "text_config",         "vision_config",
    "audio_config",        "initializer_range",
    "tie_word_embeddings", "dtype",
    "torch_dtype",         "transformers_version",
    "boi_token_id",        "boa_token_id",
    "image_token_id",      "audio_token_id",
    "eoi_token_id",        "eoa_token_index",
    "eoa_token_id",        "video_token_id",
    "eos_token_id",        "pad_token_id",
    "bos_token_id",        "vision_soft_tokens_per_image",
    "_name_or_path",       "audio_soft_tokens_per_image",
    "image_token_index",   "boi_token_index",
    "eoi_token_index"};

const std::set<std::string> kKnownAudioFields = {"model_type",
                                                 "hidden_act",
                                                 "residual_weight",
                                                 "attention_logit_cap",
                                                 "attention_invalid_logits_value",
                                                 "use_clipped_linears",
                                                 "rms_norm_eps",
                                                 "gradient_clipping",
                                                 "initializer_range",
                                                 "dtype",
                                                 "torch_dtype",
                                                 "hidden_size",
                                                 "num_hidden_layers",
                                                 "num_attention_heads",
                                                 "subsampling_conv_channels",
                                                 "conv_kernel_size",
                                                 "attention_chunk_size",
                                                 "attention_context_left",
                                                 "attention_context_right",
                                                 "output_proj_dims",
                                                 "transformers_version",
                                                 "_name_or_path"};

struct Reader {
  const json& j;
  std::string where;  // "config.json: text_config"

  bool present(const char* k) const { return j.contains(k) && !j[k].is_null(); }
  int get_int(const char* k, int def) const {
    if (!present(k)) return def;
    if (!j[k].is_number_integer()) fail(where, ".", k, " must be an integer, found ", j[k].dump());
    const int64_t v = j[k].get<int64_t>();
    if (v < -1 || v > (int64_t{1} << 31) - 1) fail(where, ".", k, " is out of range: ", v);
    return static_cast<int>(v);
  }
  int get_positive(const char* k, int def) const {
    const int v = get_int(k, def);
    if (v <= 0) fail(where, ".", k, " must be positive, found ", v);
    return v;
  }
  double get_num(const char* k, double def) const {
    if (!present(k)) return def;
    if (!j[k].is_number()) fail(where, ".", k, " must be a number, found ", j[k].dump());
    const double v = j[k].get<double>();
    if (!std::isfinite(v)) fail(where, ".", k, " is not finite");
    return v;
  }
  bool get_bool(const char* k, bool def) const {
    if (!present(k)) return def;
    if (!j[k].is_boolean()) fail(where, ".", k, " must be true or false, found ", j[k].dump());
    return j[k].get<bool>();
  }
  std::string get_str(const char* k, const std::string& def) const {
    if (!present(k)) return def;
    if (!j[k].is_string()) fail(where, ".", k, " must be a string, found ", j[k].dump());
    return j[k].get<std::string>();
  }
  void warn_unknown(const std::set<std::string>& known, std::vector<std::string>& warnings) const {
    for (auto it = j.begin(); it != j.end(); ++it)
      if (!known.count(it.key()))
        warnings.push_back(where + "." + it.key() + " is not a field gemstage knows; ignored");
  }
};

RopeParams parse_rope(const json& r, const std::string& where, RopeParams def) {
  if (r.is_null()) return def;
  if (!r.is_object()) fail(where, " must be an object");
  Reader rd{r, where};
  RopeParams p = def;
  p.type = rd.get_str("rope_type", def.type);
  p.theta = rd.get_num("rope_theta", def.theta);
  p.partial_rotary_factor = rd.get_num("partial_rotary_factor",
                                       p.type == "proportional" ? def.partial_rotary_factor : 1.0);
  if (p.type != "default" && p.type != "proportional")
    fail(where, ".rope_type '", p.type,
         "' is not supported (Gemma 4 uses default and proportional)");
  if (p.theta <= 0) fail(where, ".rope_theta must be positive");
  if (p.partial_rotary_factor <= 0 || p.partial_rotary_factor > 1)
    fail(where, ".partial_rotary_factor must be in (0, 1]");
  return p;
}

void parse_text(const json& tj, const std::string& where, TextConfig& t,
                std::vector<std::string>& warnings, const std::string& model_type = "gemma4_text") {
  if (!tj.is_object()) fail(where, " must be an object");
  Reader r{tj, where};
  r.warn_unknown(kKnownTextFields, warnings);
  const std::string mt = r.get_str("model_type", model_type);
  if (mt != model_type) fail(where, ".model_type is '", mt, "', expected '", model_type, "'");
  t.vocab_size = r.get_positive("vocab_size", t.vocab_size);
  t.hidden_size = r.get_positive("hidden_size", t.hidden_size);
  t.intermediate_size = r.get_positive("intermediate_size", t.intermediate_size);
  t.num_hidden_layers = r.get_positive("num_hidden_layers", t.num_hidden_layers);
  t.num_attention_heads = r.get_positive("num_attention_heads", t.num_attention_heads);
  t.num_key_value_heads = r.get_positive("num_key_value_heads", t.num_key_value_heads);
  t.head_dim = r.get_positive("head_dim", t.head_dim);
  t.global_head_dim = r.get_positive("global_head_dim", t.global_head_dim);
  t.num_global_key_value_heads = r.get_int("num_global_key_value_heads", -1);
  t.rms_norm_eps = r.get_num("rms_norm_eps", t.rms_norm_eps);
  t.sliding_window = r.get_positive("sliding_window", t.sliding_window);
  t.max_position_embeddings = r.get_positive("max_position_embeddings", t.max_position_embeddings);
  t.final_logit_softcapping = r.get_num("final_logit_softcapping", 0.0);
  t.vocab_size_per_layer_input =
      r.get_int("vocab_size_per_layer_input", t.vocab_size_per_layer_input);
  t.hidden_size_per_layer_input =
      r.get_int("hidden_size_per_layer_input", t.hidden_size_per_layer_input);
  t.attention_k_eq_v = r.get_bool("attention_k_eq_v", false);
  t.num_kv_shared_layers = r.get_int("num_kv_shared_layers", 0);
  t.use_double_wide_mlp = r.get_bool("use_double_wide_mlp", false);
  t.tie_word_embeddings = r.get_bool("tie_word_embeddings", true);
  t.pad_token_id = r.get_int("pad_token_id", 0);
  t.bos_token_id = r.get_int("bos_token_id", 2);
  if (r.present("eos_token_id")) {
    t.eos_token_ids.clear();
    const auto& e = tj["eos_token_id"];
    if (e.is_number_integer())
      t.eos_token_ids.push_back(e.get<int>());
    else if (e.is_array()) {
      for (const auto& x : e) {
        if (!x.is_number_integer()) fail(where, ".eos_token_id entries must be integers");
        t.eos_token_ids.push_back(x.get<int>());
      }
    } else
      fail(where, ".eos_token_id must be an integer or a list");
  }
  const std::string act =
      r.get_str("hidden_activation", r.get_str("hidden_act", "gelu_pytorch_tanh"));
  if (act != "gelu_pytorch_tanh" && act != "gelu_tanh")
    fail(where, ".hidden_activation '", act, "' is not supported (Gemma 4 uses gelu_pytorch_tanh)");
  t.enable_moe_block = r.get_bool("enable_moe_block", false);
  if (t.enable_moe_block) {
    for (const char* k : {"num_experts", "top_k_experts", "moe_intermediate_size"})
      if (!r.present(k))
        fail(where, ".enable_moe_block is true but ", k, " is ",
             tj.contains(k) ? "null" : "missing", " (the MoE block needs it)");
    t.num_experts = r.get_positive("num_experts", 0);
    t.top_k_experts = r.get_positive("top_k_experts", 0);
    t.moe_intermediate_size = r.get_positive("moe_intermediate_size", 0);
    // Bounds before any shape is formed: the stacked experts are [E, 2 I, D].
    if (t.num_experts > 65536 || t.moe_intermediate_size > (1 << 20))
      fail(where, ": num_experts ", t.num_experts, " / moe_intermediate_size ",
           t.moe_intermediate_size, " are out of range (at most 65536 / 1048576)");
    if (t.top_k_experts > t.num_experts)
      fail(where, ".top_k_experts = ", t.top_k_experts, " exceeds num_experts = ", t.num_experts);
  }
  if (t.attention_k_eq_v && t.num_global_key_value_heads <= 0)
    fail(where, ".attention_k_eq_v is true but num_global_key_value_heads is ",
         r.present("num_global_key_value_heads") ? tj["num_global_key_value_heads"].dump()
                                                 : std::string("null"),
         ": the full layers' K/V head count must be given (transformers fails on null too)");
  if (r.present("use_bidirectional_attention")) {
    const std::string bidi = r.get_str("use_bidirectional_attention", "");
    if (bidi != "vision")
      fail(where, ".use_bidirectional_attention is '", bidi,
           "': only null (causal text attention, the E-series) and \"vision\" (the image block "
           "of 26B-A4B and 31B) are supported");
    t.bidirectional_vision = true;
  }
  if (!t.tie_word_embeddings)
    fail(where, ".tie_word_embeddings is false: Gemma 4 ties the LM head to embed_tokens");
  if (t.hidden_size_per_layer_input < 0) fail(where, ".hidden_size_per_layer_input must be >= 0");
  if (t.has_ple() && t.vocab_size_per_layer_input <= 0)
    fail(where, ".vocab_size_per_layer_input must be positive when PLE is used");
  if (t.num_kv_shared_layers < 0 || t.num_kv_shared_layers >= t.num_hidden_layers)
    fail(where, ".num_kv_shared_layers = ", t.num_kv_shared_layers,
         " must be in [0, num_hidden_layers)");
  if (t.num_attention_heads % t.num_key_value_heads != 0)
    fail(where, ": num_attention_heads ", t.num_attention_heads,
         " is not a multiple of num_key_value_heads ", t.num_key_value_heads);
  if (t.attention_k_eq_v && t.num_attention_heads % t.num_global_key_value_heads != 0)
    fail(where, ": num_attention_heads ", t.num_attention_heads,
         " is not a multiple of num_global_key_value_heads ", t.num_global_key_value_heads);
  if (t.pad_token_id < 0 || t.pad_token_id >= t.vocab_size)
    fail(where, ".pad_token_id out of the vocabulary");

  if (r.present("rope_parameters")) {
    const auto& rp = tj["rope_parameters"];
    if (!rp.is_object()) fail(where, ".rope_parameters must be an object");
    if (rp.contains("sliding_attention"))
      t.rope_sliding = parse_rope(rp["sliding_attention"],
                                  where + ".rope_parameters.sliding_attention", t.rope_sliding);
    if (rp.contains("full_attention"))
      t.rope_full =
          parse_rope(rp["full_attention"], where + ".rope_parameters.full_attention", t.rope_full);
  }

  t.layer_types.clear();
  if (r.present("layer_types")) {
    const auto& lt = tj["layer_types"];
    if (!lt.is_array()) fail(where, ".layer_types must be a list");
    if (static_cast<int>(lt.size()) != t.num_hidden_layers)
      fail(where, ".layer_types has ", lt.size(), " entries but num_hidden_layers is ",
           t.num_hidden_layers);
    for (size_t i = 0; i < lt.size(); ++i) {
      const std::string s = lt[i].is_string() ? lt[i].get<std::string>() : lt[i].dump();
      if (s == "sliding_attention")
        t.layer_types.push_back(LayerType::Sliding);
      else if (s == "full_attention")
        t.layer_types.push_back(LayerType::Full);
      else
        fail(where, ".layer_types[", i, "] is '", s,
             "', expected sliding_attention or full_attention");
    }
  } else {
    for (int i = 0; i < t.num_hidden_layers; ++i)
      t.layer_types.push_back((i + 1) % 6 == 0 ? LayerType::Full : LayerType::Sliding);
  }
  t.layer_types.back() = LayerType::Full;  // HF forces the last layer to full attention

  derive_layer_specs(t, where);

  // Newer transformers (>= 5.15) fold global_head_dim into per-layer overrides.
  if (r.present("per_layer_config")) {
    const auto& plc = tj["per_layer_config"];
    if (!plc.is_object()) fail(where, ".per_layer_config must be an object keyed by layer index");
    for (auto it = plc.begin(); it != plc.end(); ++it) {
      int idx = -1;
      try {
        size_t used = 0;
        idx = std::stoi(it.key(), &used);
        if (used != it.key().size()) idx = -1;
      } catch (...) {
        idx = -1;
      }
      if (idx < 0 || idx >= t.num_hidden_layers)
        fail(where, ".per_layer_config key '", it.key(), "' is not a layer index in [0, ",
             t.num_hidden_layers, ")");
      Reader lr{it.value(), where + ".per_layer_config." + it.key()};
      if (!it.value().is_object()) fail(lr.where, " must be an object");
      LayerSpec& ls = t.layers[static_cast<size_t>(idx)];
      ls.head_dim = lr.get_positive("head_dim", ls.head_dim);
      ls.num_kv_heads = lr.get_positive("num_key_value_heads", ls.num_kv_heads);
    }
    for (int i = 0; i < t.num_hidden_layers; ++i)
      if (t.layers[i].kv_shared) {
        const LayerSpec& d = t.layers[static_cast<size_t>(t.layers[i].kv_donor)];
        t.layers[i].head_dim = d.head_dim;
        t.layers[i].num_kv_heads = d.num_kv_heads;
      }
  }
}

void parse_vision(const json& vj, const std::string& where, VisionConfig& v,
                  std::vector<std::string>& warnings) {
  if (!vj.is_object()) fail(where, " must be an object");
  Reader r{vj, where};
  r.warn_unknown(kKnownVisionFields, warnings);
  const std::string mt = r.get_str("model_type", "gemma4_vision");
  if (mt != "gemma4_vision") fail(where, ".model_type is '", mt, "', expected 'gemma4_vision'");
  v.hidden_size = r.get_positive("hidden_size", v.hidden_size);
  v.intermediate_size = r.get_positive("intermediate_size", v.intermediate_size);
  v.num_hidden_layers = r.get_positive("num_hidden_layers", v.num_hidden_layers);
  v.num_attention_heads = r.get_positive("num_attention_heads", v.num_attention_heads);
  v.num_key_value_heads = r.get_positive("num_key_value_heads", v.num_key_value_heads);
  v.head_dim = r.get_positive("head_dim", v.head_dim);
  v.rms_norm_eps = r.get_num("rms_norm_eps", v.rms_norm_eps);
  v.pooling_kernel_size = r.get_positive("pooling_kernel_size", v.pooling_kernel_size);
  v.patch_size = r.get_positive("patch_size", v.patch_size);
  v.position_embedding_size = r.get_positive("position_embedding_size", v.position_embedding_size);
  v.use_clipped_linears = r.get_bool("use_clipped_linears", false);
  v.standardize = r.get_bool("standardize", false);
  v.default_output_length = r.get_positive("default_output_length", v.default_output_length);
  if (r.present("rope_parameters"))
    v.rope_theta =
        parse_rope(vj["rope_parameters"], where + ".rope_parameters", {"default", 100.0, 1.0})
            .theta;
  if (v.head_dim % 4 != 0) fail(where, ".head_dim must be a multiple of 4 for the 2D RoPE");
}

void parse_audio(const json& aj, const std::string& where, AudioConfig& a,
                 std::vector<std::string>& warnings) {
  if (!aj.is_object()) fail(where, " must be an object");
  Reader r{aj, where};
  r.warn_unknown(kKnownAudioFields, warnings);
  const std::string mt = r.get_str("model_type", "gemma4_audio");
  if (mt != "gemma4_audio") fail(where, ".model_type is '", mt, "', expected 'gemma4_audio'");
  const std::string act = r.get_str("hidden_act", "silu");
  if (act != "silu") fail(where, ".hidden_act is '", act, "'; the audio tower runs silu only");
  a.hidden_size = r.get_positive("hidden_size", a.hidden_size);
  a.num_hidden_layers = r.get_positive("num_hidden_layers", a.num_hidden_layers);
  a.num_attention_heads = r.get_positive("num_attention_heads", a.num_attention_heads);
  a.conv_kernel_size = r.get_positive("conv_kernel_size", a.conv_kernel_size);
  a.attention_chunk_size = r.get_positive("attention_chunk_size", a.attention_chunk_size);
  a.attention_context_left = r.get_positive("attention_context_left", a.attention_context_left);
  a.attention_context_right = r.get_int("attention_context_right", a.attention_context_right);
  a.attention_logit_cap = r.get_num("attention_logit_cap", a.attention_logit_cap);
  a.attention_invalid_logits_value =
      r.get_num("attention_invalid_logits_value", a.attention_invalid_logits_value);
  a.residual_weight = r.get_num("residual_weight", a.residual_weight);
  a.rms_norm_eps = r.get_num("rms_norm_eps", a.rms_norm_eps);
  a.gradient_clipping = r.get_num("gradient_clipping", a.gradient_clipping);
  a.use_clipped_linears = r.get_bool("use_clipped_linears", a.use_clipped_linears);
  a.output_proj_dims = r.get_positive("output_proj_dims", a.output_proj_dims);
  if (r.present("subsampling_conv_channels")) {
    const json& ch = aj["subsampling_conv_channels"];
    if (!ch.is_array() || ch.size() != 2 || !ch[0].is_number_integer() ||
        !ch[1].is_number_integer() || ch[0].get<int64_t>() <= 0 || ch[1].get<int64_t>() <= 0 ||
        ch[0].get<int64_t>() > 65536 || ch[1].get<int64_t>() > 65536)
      fail(where, ".subsampling_conv_channels must be two positive integers, found ", ch.dump());
    a.subsampling_channels[0] = ch[0].get<int>();
    a.subsampling_channels[1] = ch[1].get<int>();
  }
  if (a.hidden_size % a.num_attention_heads != 0)
    fail(where, ".hidden_size ", a.hidden_size, " is not a multiple of num_attention_heads ",
         a.num_attention_heads);
  // input_proj_linear takes (C0 // 4) * C1 columns but the flattened features have 32 * C1: the
  // two agree only for C0 = 128 (the 128 mel bins), as in every released checkpoint.
  if (a.subsampling_channels[0] != 128)
    fail(where, ".subsampling_conv_channels[0] is ", a.subsampling_channels[0],
         "; the audio tower's input_proj_linear needs it to be 128 (the mel bins)");
  if (a.attention_context_right != 0)
    fail(where, ".attention_context_right is ", a.attention_context_right,
         "; gemstage runs the released audio tower's causal attention (0) only");
  if (a.attention_context_left < 2)
    fail(where, ".attention_context_left must be at least 2, found ", a.attention_context_left);
}

const std::set<std::string> kKnownUnifiedVisionFields = {
    "model_type",    "initializer_range",   "rms_norm_eps",     "dtype",
    "torch_dtype",   "num_soft_tokens",     "patch_size",       "pooling_kernel_size",
    "mm_embed_dim",  "mm_posemb_size",      "output_proj_dims", "model_patch_size",
    "_name_or_path", "transformers_version"};
const std::set<std::string> kKnownUnifiedAudioFields = {
    "model_type",    "initializer_range",       "rms_norm_eps",        "dtype",
    "torch_dtype",   "audio_embed_dim",         "hidden_size",         "output_proj_dims",
    "_name_or_path", "audio_samples_per_token", "transformers_version"};

// gemma4_unified's vision_config: the patch embedder's sizes (docs/gemma4-unified.md).
void parse_unified_vision(const json& vj, const std::string& where, UnifiedVisionConfig& v,
                          std::vector<std::string>& warnings) {
  if (!vj.is_object()) fail(where, " must be an object");
  Reader r{vj, where};
  r.warn_unknown(kKnownUnifiedVisionFields, warnings);
  const std::string mt = r.get_str("model_type", "gemma4_unified_vision");
  if (mt != "gemma4_unified_vision")
    fail(where, ".model_type is '", mt, "', expected 'gemma4_unified_vision'");
  v.patch_size = r.get_positive("patch_size", v.patch_size);
  v.pooling_kernel_size = r.get_positive("pooling_kernel_size", v.pooling_kernel_size);
  v.mm_embed_dim = r.get_positive("mm_embed_dim", v.mm_embed_dim);
  v.mm_posemb_size = r.get_positive("mm_posemb_size", v.mm_posemb_size);
  v.num_soft_tokens = r.get_positive("num_soft_tokens", v.num_soft_tokens);
  v.rms_norm_eps = r.get_num("rms_norm_eps", v.rms_norm_eps);
  // Bounds before any shape is formed: a patch vector holds 3 * block^2 values.
  if (v.patch_size > 1024 || v.pooling_kernel_size > 64 || v.mm_embed_dim > (1 << 20) ||
      v.mm_posemb_size > (1 << 20))
    fail(where, ": patch_size ", v.patch_size, " / pooling_kernel_size ", v.pooling_kernel_size,
         " / mm_embed_dim ", v.mm_embed_dim, " / mm_posemb_size ", v.mm_posemb_size,
         " are out of range");
  if (r.present("model_patch_size") && r.get_int("model_patch_size", 0) != v.block())
    fail(where, ".model_patch_size is ", r.get_int("model_patch_size", 0),
         " but patch_size * pooling_kernel_size is ", v.block());
}

// gemma4_unified's audio_config: the raw-frame embedder (no tower).
void parse_unified_audio(const json& aj, const std::string& where, UnifiedAudioConfig& a,
                         std::vector<std::string>& warnings) {
  if (!aj.is_object()) fail(where, " must be an object");
  Reader r{aj, where};
  r.warn_unknown(kKnownUnifiedAudioFields, warnings);
  const std::string mt = r.get_str("model_type", "gemma4_unified_audio");
  if (mt != "gemma4_unified_audio")
    fail(where, ".model_type is '", mt, "', expected 'gemma4_unified_audio'");
  // The tiny fixture sets take the frame size from audio_embed_dim (the embedder's input).
  a.frame_samples = r.get_positive("audio_embed_dim", a.frame_samples);
  a.rms_norm_eps = r.get_num("rms_norm_eps", a.rms_norm_eps);
  if (a.frame_samples > (1 << 20)) fail(where, ".audio_embed_dim is out of range");
}

}  // namespace

void derive_layer_specs(TextConfig& t, const std::string& source) {
  const int L = t.num_hidden_layers;
  const int first_shared = t.first_kv_shared_layer();
  t.layers.assign(static_cast<size_t>(L), LayerSpec{});
  for (int i = 0; i < L; ++i) {
    LayerSpec& s = t.layers[static_cast<size_t>(i)];
    s.type = t.layer_types[static_cast<size_t>(i)];
    s.head_dim = s.type == LayerType::Full ? t.global_head_dim : t.head_dim;
    s.k_eq_v = s.type == LayerType::Full && t.attention_k_eq_v;
    s.num_kv_heads = s.k_eq_v ? t.num_global_key_value_heads : t.num_key_value_heads;
    s.moe = t.enable_moe_block;
    const bool wide = t.use_double_wide_mlp && first_shared > 0 && i >= first_shared &&
                      t.num_kv_shared_layers > 0;
    s.mlp_width = t.intermediate_size * (wide ? 2 : 1);
  }
  // A shared layer reads the last non-shared layer of its own type.
  for (int i = first_shared; i < L && t.num_kv_shared_layers > 0; ++i) {
    LayerSpec& s = t.layers[static_cast<size_t>(i)];
    int donor = -1;
    for (int j = first_shared - 1; j >= 0; --j)
      if (t.layers[static_cast<size_t>(j)].type == s.type) {
        donor = j;
        break;
      }
    if (donor < 0)
      fail(source, ": KV-shared layer ", i, " (", layer_type_name(s.type),
           ") has no earlier non-shared layer of that type to read K/V from");
    s.kv_shared = true;
    s.kv_donor = donor;
    s.head_dim = t.layers[static_cast<size_t>(donor)].head_dim;
    s.num_kv_heads = t.layers[static_cast<size_t>(donor)].num_kv_heads;
    t.layers[static_cast<size_t>(donor)].is_donor = true;
  }
}

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(source, ": not valid JSON (", e.what(), ")");
  }
  if (!j.is_object()) fail(source, ": top level must be an object");
  ModelConfig c;
  c.source = source;
  Reader top{j, source};
  const std::string mt = top.get_str("model_type", "");
  if (j.contains("architectures") && j["architectures"].is_array() && !j["architectures"].empty() &&
      j["architectures"][0].is_string())
    c.architecture = j["architectures"][0].get<std::string>();
  if (mt == "gemma4" || mt == "gemma4_unified") {
    top.warn_unknown(kKnownTopFields, c.warnings);
    if (!j.contains("text_config") || !j["text_config"].is_object())
      fail(source, ": a gemma4 config needs a text_config object");
    c.multimodal = true;
    c.unified = mt == "gemma4_unified";
    parse_text(j["text_config"], source + ": text_config", c.text, c.warnings,
               c.unified ? "gemma4_unified_text" : "gemma4_text");
    if (c.unified) {
      // No towers: image patches and raw audio frames go through small embedders.
      if (c.text.has_ple())
        fail(source, ": text_config.hidden_size_per_layer_input is ",
             c.text.hidden_size_per_layer_input,
             "; gemma4_unified has no per-layer embeddings (0)");
      if (top.present("vision_config")) {
        c.unified_vision = UnifiedVisionConfig{};
        parse_unified_vision(j["vision_config"], source + ": vision_config", *c.unified_vision,
                             c.warnings);
      }
      if (top.present("audio_config")) {
        c.unified_audio = UnifiedAudioConfig{};
        parse_unified_audio(j["audio_config"], source + ": audio_config", *c.unified_audio,
                            c.warnings);
      }
    } else if (top.present("vision_config")) {
      c.vision = VisionConfig{};
      parse_vision(j["vision_config"], source + ": vision_config", *c.vision, c.warnings);
    }
    c.has_audio = !c.unified && top.present("audio_config");
    if (c.has_audio) {
      c.audio = AudioConfig{};
      parse_audio(j["audio_config"], source + ": audio_config", *c.audio, c.warnings);
    }
    c.image_token_id = top.get_int("image_token_id", c.image_token_id);
    c.video_token_id = top.get_int("video_token_id", c.video_token_id);
    c.audio_token_id = top.get_int("audio_token_id", c.audio_token_id);
    c.boi_token_id = top.get_int("boi_token_id", c.boi_token_id);
    c.eoi_token_id = top.get_int("eoi_token_id", c.eoi_token_id);
    c.boa_token_id = top.get_int("boa_token_id", c.boa_token_id);
    c.eoa_token_id = top.get_int("eoa_token_id", top.get_int("eoa_token_index", c.eoa_token_id));
    if (top.present("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      std::vector<int> ids;
      if (e.is_number_integer())
        ids.push_back(e.get<int>());
      else if (e.is_array())
        for (const auto& x : e)
          if (x.is_number_integer()) ids.push_back(x.get<int>());
      if (!ids.empty()) c.text.eos_token_ids = ids;
    }
  } else if (mt == "gemma4_text") {
    c.multimodal = false;
    parse_text(j, source, c.text, c.warnings);
  } else {
    fail(source, ": model_type is '", mt,
         "'; gemstage runs Gemma 4 checkpoints (model_type 'gemma4', 'gemma4_unified' or "
         "'gemma4_text')");
  }
  return c;
}

ModelConfig load_model_config(const std::string& dir) {
  const std::string path = (std::filesystem::path(dir) / "config.json").string();
  if (!std::filesystem::exists(path))
    fail(path,
         " does not exist; --model must be a Hugging Face checkpoint directory (config.json + "
         "safetensors) or a gemstage bundle");
  return parse_model_config(read_text_file(path, size_t{16} << 20), path);
}

}  // namespace gemstage
