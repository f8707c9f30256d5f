// Stage contracts: every tensor crossing a stage boundary has a name, a symbolic shape, a dtype
// and a meaning. Token identity for PLE (ple_token_ids) and the image splice
// (image_splice_mask + the spliced hidden_states) are separate named tensors, and only the
// embeddings stage ever sees token ids; check_contract_chain() proves that for a bundle.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/host_tensor.h"
#include "gemma4/config.h"
#include "gemma4/tensor_table.h"
#include "stage/partition.h"

namespace gemstage {

// Drafter: an MTP drafter (gemma4_assistant) run beside the stage whose KV caches it reads; a
// bundle's manifest declares it in its own `drafter` section, never among the pipeline's stages
// (stage/drafter_stage.h runs it).
enum class StageRole { Embeddings, TransformerLayers, FinalNormHead, Drafter };
const char* stage_role_name(StageRole r);
StageRole stage_role_from_name(const std::string& s, const std::string& where);

struct TensorDecl {
  std::string name;
  std::vector<std::string> shape;  // symbolic ("S") or numeric ("128") dims
  std::string dtype;               // "f32", "i32", "i64", "u8"
  std::string meaning;
  bool optional = false;
  LayerRange layer_slice{-1, -1};  // per_layer_inputs of a transformer stage: which layers
};

struct StageContract {
  std::vector<TensorDecl> inputs, outputs;
};

// The one definition of each role's contract (export writes it, the runtime and check use it).
// c is the model's (for a drafter: its target's).
StageContract contract_for(StageRole role, const LayerRange& layers, const ModelConfig& c);
// The drafter's, from its target's hidden size (what contract_for gives for StageRole::Drafter).
StageContract drafter_contract(int64_t target_hidden_size);

nlohmann::json contract_to_json(const StageContract& c);
StageContract contract_from_json(const nlohmann::json& j, const std::string& where);

struct StageDecl {
  std::string id;
  StageRole role;
  LayerRange layers{0, 0};
  StageContract contract;
};

// The model parts (gemma4/tensor_table.h) a stage's weight file holds: the embeddings stage
// also holds the vision tower, which runs where the token ids are.
PartSet stage_parts(const StageDecl& d);

// The inputs a pipeline feeds its stages itself (the embeddings stage's inputs plus the positions
// of each call's rows): the names check_contract_chain starts from.
std::vector<TensorDecl> pipeline_inputs(const ModelConfig& c);

// Symbolic dims ("S", "N_img", ...) bound during one stage call: the value and the tensor that
// bound it first, so a mismatch names both tensors.
struct DimBindings {
  std::map<std::string, std::pair<int64_t, std::string>> dims;
};

// Checks one side of a call against the contract: every given tensor is declared (name), every
// non-optional declared tensor is given, element types match, ranks match, numeric dims match and
// each symbolic dim has one value across all of the call's tensors (inputs and outputs). Throws
// naming the stage, the tensor, what was expected and what was given.
void check_call_tensors(const StageDecl& stage, const char* side,
                        const std::vector<TensorDecl>& decls, const TensorMap& tensors,
                        DimBindings& dims);

// Verifies that contracts chain: every input is provided (by the pipeline or an earlier stage)
// with the same dtype and shape, slices of per_layer_inputs match the stage's layer range, and
// no transformer or head stage receives token ids. Throws naming the stage and tensor.
void check_contract_chain(const std::vector<StageDecl>& stages, const ModelConfig& c);

}  // namespace gemstage
