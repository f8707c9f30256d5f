#include "stage/contract.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace gemstage {

PartSet stage_parts(const StageDecl& d) {
  switch (d.role) {
    case StageRole::Embeddings:
      return {kPartEmbeddings | kPartVision | kPartAudio, 0, 0};
    case StageRole::TransformerLayers:
      return {kPartLayer, d.layers.begin, d.layers.end};
    case StageRole::FinalNormHead:
      return {kPartHead, 0, 0};
    case StageRole::Drafter:
      break;  // its tensors are the drafter checkpoint's, none of the target's parts
  }
  return {};
}

const char* stage_role_name(StageRole r) {
  switch (r) {
    case StageRole::Embeddings:
      return "embeddings";
    case StageRole::TransformerLayers:
      return "transformer_layers";
    case StageRole::FinalNormHead:
      return "final_norm_head";
    case StageRole::Drafter:
      return "drafter";
  }
  return "?";
}

StageRole stage_role_from_name(const std::string& s, const std::string& where) {
  if (s == "embeddings") return StageRole::Embeddings;
  if (s == "transformer_layers") return StageRole::TransformerLayers;
  if (s == "final_norm_head") return StageRole::FinalNormHead;
  if (s == "drafter") return StageRole::Drafter;
  fail(where, ": unknown stage role '", s,
       "' (embeddings, transformer_layers, final_norm_head, drafter)");
}

StageContract contract_for(StageRole role, const LayerRange& layers, const ModelConfig& c) {
  const TextConfig& t = c.text;
  const std::string D = std::to_string(t.hidden_size), L = std::to_string(t.num_hidden_layers),
                    P = std::to_string(t.ple_dim()), V = std::to_string(t.vocab_size);
  StageContract k;
  switch (role) {
    case StageRole::Embeddings: {
      k.inputs.push_back(
          {"input_ids", {"S"}, "i32", "prompt token ids as given, placeholders included"});
      if (c.vision) {
        const int pin = 3 * c.vision->patch_size * c.vision->patch_size;
        k.inputs.push_back({"pixel_values",
                            {"N_img", "max_patches", std::to_string(pin)},
                            "f32",
                            "preprocessed image patches in [0,1], zero-padded",
                            true});
        k.inputs.push_back({"image_position_ids",
                            {"N_img", "max_patches", "2"},
                            "i64",
                            "(x, y) patch grid position, -1 for padding",
                            true});
        k.inputs.push_back({"image_soft_tokens",
                            {"N_soft", D},
                            "f32",
                            "vision tower output for this call's placeholder rows, in order: given "
                            "instead of pixel_values when one prompt's images span several calls",
                            true});
      }
      if (c.unified_vision) {
        const std::string pin = std::to_string(c.unified_vision->patch_dim());
        k.inputs.push_back({"pixel_values",
                            {"N_img", "max_patches", pin},
                            "f32",
                            "48-px patches in (row, column, channel) order, values in [0,1], "
                            "zero-padded; the image embedder runs inside this stage",
                            true});
        k.inputs.push_back({"image_position_ids",
                            {"N_img", "max_patches", "2"},
                            "i64",
                            "(x, y) = (block column, block row), -1 for padding",
                            true});
        k.inputs.push_back({"image_soft_tokens",
                            {"N_soft", D},
                            "f32",
                            "image embedder output for this call's placeholder rows, in order",
                            true});
      }
      if (c.unified_audio) {
        k.inputs.push_back({"audio_frames",
                            {"N_aud", "T_frames", std::to_string(c.unified_audio->frame_samples)},
                            "f32",
                            "16 kHz mono samples cut into frames, the last partial frame "
                            "zero-padded; the audio embedder runs inside this stage",
                            true});
        k.inputs.push_back({"audio_frames_mask",
                            {"N_aud", "T_frames"},
                            "u8",
                            "1 for each real frame (a prefix of each clip's frames)",
                            true});
        k.inputs.push_back(
            {"audio_soft_tokens",
             {"N_asoft", D},
             "f32",
             "audio embedder output for this call's audio placeholder rows, in order",
             true});
      }
      if (c.audio) {
        k.inputs.push_back({"audio_features",
                            {"N_aud", "F_mel", "128"},
                            "f32",
                            "log-mel features of each clip (Gemma4AudioFeatureExtractor), invalid "
                            "frames zero; the audio tower runs inside this stage",
                            true});
        k.inputs.push_back({"audio_features_mask",
                            {"N_aud", "F_mel"},
                            "u8",
                            "1 for each valid feature frame (a prefix of each clip's frames)",
                            true});
        k.inputs.push_back({"audio_soft_tokens",
                            {"N_asoft", D},
                            "f32",
                            "audio tower + embedder output for this call's audio placeholder rows, "
                            "in order: given instead of audio_features when one prompt's audio "
                            "spans several calls",
                            true});
      }
      k.outputs.push_back({"hidden_states",
                           {"S", D},
                           "f32",
                           "inputs_embeds: E[embed id]*sqrt(D) with tower soft tokens spliced into "
                           "placeholder rows"});
      k.outputs.push_back({"per_layer_inputs",
                           {"S", L, P},
                           "f32",
                           "(RMSNorm(proj(spliced inputs_embeds)/sqrt(D)) + "
                           "E_ple[ple_token_ids]*sqrt(P)) / sqrt(2)"});
      k.outputs.push_back(
          {"ple_token_ids",
           {"S"},
           "i32",
           "token identity used for the PLE lookup: pad_token_id at every placeholder row"});
      if (c.takes_audio()) {
        // Audio models say which tower filled a row; the vision-only contract is unchanged, so
        // bundles exported before audio existed still check.
        k.outputs.push_back(
            {"image_splice_mask",
             {"S"},
             "u8",
             "1 where a vision tower soft token was spliced in (image/video rows)"});
        k.outputs.push_back({"audio_splice_mask",
                             {"S"},
                             "u8",
                             "1 where an audio tower soft token was spliced in (audio rows)"});
      } else {
        k.outputs.push_back(
            {"image_splice_mask", {"S"}, "u8", "1 where a tower soft token was spliced in"});
      }
      break;
    }
    case StageRole::TransformerLayers: {
      k.inputs.push_back({"hidden_states",
                          {"S", D},
                          "f32",
                          "residual stream entering layer " + std::to_string(layers.begin)});
      TensorDecl pli{"per_layer_inputs",
                     {"S", std::to_string(layers.end - layers.begin), P},
                     "f32",
                     "this stage's slice of the per-layer inputs, layers " + layers.str()};
      pli.layer_slice = layers;
      k.inputs.push_back(pli);
      k.inputs.push_back(
          {"positions", {"S"}, "i32", "absolute position of each row (RoPE, masks, cache slots)"});
      k.inputs.push_back({"row_sequence",
                          {"S"},
                          "i32",
                          "a batch of several sequences: each row's sequence, as an index into the "
                          "call's caches; a sequence's rows are contiguous and in position order "
                          "(absent: every row is one sequence's)",
                          true});
      if (t.bidirectional_vision)
        k.inputs.push_back({"vision_groups",
                            {"S"},
                            "i32",
                            "the image block of sliding layers: each row's image group (a run of "
                            "image/video placeholder rows, whole inside this call), -1 elsewhere "
                            "(absent: every row causal)",
                            true});
      k.outputs.push_back({"hidden_states",
                           {"S", D},
                           "f32",
                           "residual stream after layer " + std::to_string(layers.end - 1)});
      break;
    }
    case StageRole::FinalNormHead: {
      k.inputs.push_back({"hidden_states", {"S", D}, "f32", "output of the last decoder layer"});
      k.outputs.push_back(
          {"logits", {"S", V}, "f32", "30*tanh((RMSNorm(h) . E^T)/30): tied head, final soft-cap"});
      break;
    }
    case StageRole::Drafter:
      return drafter_contract(t.hidden_size);
  }
  return k;
}

StageContract drafter_contract(int64_t target_hidden_size) {
  const std::string D = std::to_string(target_hidden_size);
  StageContract k;
  // One draft step at the constant position P (docs/gemma4-mtp.md): the target's caches hold
  // positions 0..P-1 and every step of a round queries P.
  k.inputs = {
      {"input_token",
       {"1"},
       "i32",
       "x_P: the newest token, not yet in the target's caches (its raw id, placeholders too)"},
      {"target_hidden",
       {D},
       "f32",
       "step 0: the target's post-final-norm hidden of row P-1; later steps: the previous "
       "step's next_hidden"},
      {"position", {"1"}, "i32", "P, the number of rows in the target's caches, for all steps"}};
  k.outputs = {{"draft_token", {"1"}, "i32", "the drafted id (argmax of the drafter's head)"},
               {"next_hidden", {D}, "f32", "post_projection output: the next step's h"}};
  return k;
}

namespace {
nlohmann::json decl_to_json(const TensorDecl& d) {
  nlohmann::json j = {
      {"name", d.name}, {"shape", d.shape}, {"dtype", d.dtype}, {"meaning", d.meaning}};
  if (d.optional) j["optional"] = true;
  if (d.layer_slice.begin >= 0) j["layer_slice"] = {d.layer_slice.begin, d.layer_slice.end};
  return j;
}
TensorDecl decl_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object()) fail(where, ": a contract tensor must be an object");
  TensorDecl d;
  auto str = [&](const char* k) {
    if (!j.contains(k) || !j[k].is_string())
      fail(where, ": contract tensor field '", k, "' must be a string");
    return j[k].get<std::string>();
  };
  d.name = str("name");
  d.dtype = str("dtype");
  d.meaning =
      j.contains("meaning") && j["meaning"].is_string() ? j["meaning"].get<std::string>() : "";
  if (!j.contains("shape") || !j["shape"].is_array())
    fail(where, ": tensor ", d.name, ": shape must be a list");
  for (const auto& s : j["shape"]) {
    if (s.is_string())
      d.shape.push_back(s.get<std::string>());
    else if (s.is_number_unsigned())
      d.shape.push_back(std::to_string(s.get<uint64_t>()));
    else
      fail(where, ": tensor ", d.name, ": shape entries must be names or non-negative integers");
  }
  d.optional = j.contains("optional") && j["optional"].is_boolean() && j["optional"].get<bool>();
  if (j.contains("layer_slice")) {
    const auto& ls = j["layer_slice"];
    if (!ls.is_array() || ls.size() != 2 || !ls[0].is_number_integer() ||
        !ls[1].is_number_integer())
      fail(where, ": tensor ", d.name, ": layer_slice must be [begin, end]");
    d.layer_slice = {ls[0].get<int>(), ls[1].get<int>()};
  }
  return d;
}
}  // namespace

nlohmann::json contract_to_json(const StageContract& c) {
  nlohmann::json j = {{"inputs", nlohmann::json::array()}, {"outputs", nlohmann::json::array()}};
  for (const auto& d : c.inputs) j["inputs"].push_back(decl_to_json(d));
  for (const auto& d : c.outputs) j["outputs"].push_back(decl_to_json(d));
  return j;
}

StageContract contract_from_json(const nlohmann::json& j, const std::string& where) {
  if (!j.is_object() || !j.contains("inputs") || !j["inputs"].is_array() ||
      !j.contains("outputs") || !j["outputs"].is_array())
    fail(where, ": contract must have inputs and outputs lists");
  StageContract c;
  for (const auto& d : j["inputs"]) c.inputs.push_back(decl_from_json(d, where + " inputs"));
  for (const auto& d : j["outputs"]) c.outputs.push_back(decl_from_json(d, where + " outputs"));
  return c;
}

std::vector<TensorDecl> pipeline_inputs(const ModelConfig& c) {
  std::vector<TensorDecl> in = contract_for(StageRole::Embeddings, {}, c).inputs;
  in.push_back({"positions", {"S"}, "i32", "absolute position of each row"});
  in.push_back({"row_sequence", {"S"}, "i32", "each row's sequence in a batch", true});
  if (c.text.bidirectional_vision)
    in.push_back({"vision_groups", {"S"}, "i32", "each row's image group, -1 elsewhere", true});
  return in;
}

namespace {
std::string names_of(const std::vector<TensorDecl>& decls) {
  std::string s;
  for (const TensorDecl& d : decls) s += (s.empty() ? "" : ", ") + d.name;
  return s.empty() ? "nothing" : s;
}
std::string shape_of(const std::vector<std::string>& dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + dims[i];
  return s + "]";
}
bool is_number(const std::string& s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string::npos;
}
}  // namespace

void check_call_tensors(const StageDecl& stage, const char* side,
                        const std::vector<TensorDecl>& decls, const TensorMap& tensors,
                        DimBindings& dims) {
  const std::string where =
      "stage '" + stage.id + "' (" + stage_role_name(stage.role) + ") " + side;
  for (const auto& entry : tensors) {
    const std::string& name = entry.first;
    const bool known = std::any_of(decls.begin(), decls.end(),
                                   [&](const TensorDecl& d) { return d.name == name; });
    if (!known)
      fail(where, " '", name, "' is not in the stage's contract; its ", side, "s are ",
           names_of(decls));
  }
  for (const TensorDecl& d : decls) {
    auto it = tensors.find(d.name);
    if (it == tensors.end()) {
      if (d.optional) continue;
      fail(where, " '", d.name, "' is missing: expected ", d.dtype, " ", shape_of(d.shape), " (",
           d.meaning, ")");
    }
    const HostTensor& t = it->second;
    if (d.dtype != elem_type_name(t.type()))
      fail(where, " '", d.name, "' must be ", d.dtype, " ", shape_of(d.shape), ", got ",
           elem_type_name(t.type()), " (numpy ", elem_type_numpy_name(t.type()), ")");
    if (t.shape().size() != d.shape.size())
      fail(where, " '", d.name, "' must have shape ", shape_of(d.shape), ", got ",
           shape_str(t.shape()));
    for (size_t i = 0; i < d.shape.size(); ++i) {
      const int64_t got = t.shape()[i];
      const std::string& want = d.shape[i];
      if (is_number(want)) {
        if (std::to_string(got) != want)
          fail(where, " '", d.name, "' must have shape ", shape_of(d.shape), ", got ",
               shape_str(t.shape()), " (dim ", i, " is ", got, ", expected ", want, ")");
        continue;
      }
      auto [b, fresh] = dims.dims.try_emplace(want, got, d.name);
      if (!fresh && b->second.first != got)
        fail(where, " '", d.name, "' has shape ", shape_str(t.shape()), ": its dim ", i, " ('",
             want, "') is ", got, ", but '", b->second.second, "' has ", want, " = ",
             b->second.first, " in the same call");
    }
  }
}

void check_contract_chain(const std::vector<StageDecl>& stages, const ModelConfig& c) {
  // What the pipeline itself provides: the prompt's tensors and each row's position.
  std::map<std::string, TensorDecl> available;
  for (const TensorDecl& d : pipeline_inputs(c)) available[d.name] = d;
  static const char* kIdTensors[] = {"input_ids", "ple_token_ids", "llm_input_ids", "token_ids",
                                     "ple_ids"};
  for (const StageDecl& s : stages) {
    const std::string where = "stage '" + s.id + "' (" + stage_role_name(s.role) + ")";
    for (const TensorDecl& in : s.contract.inputs) {
      if (s.role != StageRole::Embeddings) {
        for (const char* id : kIdTensors)
          if (in.name == id)
            fail(where, " receives token ids ('", in.name,
                 "'): only the embeddings stage may see token ids, so no "
                 "transformer stage can re-derive PLE identity from raw placeholder ids");
        // vision_groups numbers image runs (no token identity), for the large models' image block.
        if ((in.dtype == "i32" || in.dtype == "i64") && in.name != "positions" &&
            in.name != "row_sequence" && in.name != "vision_groups")
          fail(where, " receives integer tensor '", in.name,
               "'; transformer and head stages take only hidden states, "
               "their per_layer_inputs slice, positions and image groups");
      }
      auto it = available.find(in.name);
      if (it == available.end()) {
        if (in.optional) continue;
        fail(where, " needs input '", in.name,
             "', which neither the pipeline nor an earlier stage provides");
      }
      const TensorDecl& have = it->second;
      if (have.dtype != in.dtype)
        fail(where, " input '", in.name, "' has dtype ", in.dtype, " but it is provided as ",
             have.dtype);
      if (in.layer_slice.begin >= 0) {
        if (in.layer_slice.begin != s.layers.begin || in.layer_slice.end != s.layers.end)
          fail(where, " takes per_layer_inputs layers ", in.layer_slice.str(), " but runs layers ",
               s.layers.str());
        if (have.shape.size() != 3 || in.shape.size() != 3 || have.shape[0] != in.shape[0] ||
            have.shape[2] != in.shape[2] ||
            in.shape[1] != std::to_string(in.layer_slice.end - in.layer_slice.begin))
          fail(where, " input '", in.name, "' shape does not match a [S, ",
               in.layer_slice.end - in.layer_slice.begin,
               ", P] slice of what the embeddings stage provides");
      } else if (have.shape != in.shape) {
        std::string a, b;
        for (const auto& x : in.shape) a += x + " ";
        for (const auto& x : have.shape) b += x + " ";
        fail(where, " input '", in.name, "' has shape [ ", a, "] but it is provided as [ ", b, "]");
      }
    }
    for (const TensorDecl& out : s.contract.outputs) available[out.name] = out;
  }
  if (!available.count("logits"))
    fail("no stage produces logits: the bundle needs a final_norm_head stage");
}

}  // namespace gemstage
