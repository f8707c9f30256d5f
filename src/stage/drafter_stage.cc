#include "stage/drafter_stage.h"

#include <vector>

#include "core/error.h"

namespace gemstage {

StageDecl drafter_stage_decl(const AssistantModel& drafter, const std::string& id) {
  StageDecl d;
  d.id = id;
  d.role = StageRole::Drafter;
  d.contract = drafter_contract(drafter.config().backbone_hidden_size);
  return d;
}

TensorMap run_drafter_stage(ThreadPool& pool, const AssistantModel& drafter, const StageDecl& decl,
                            const DraftContext& ctx, TensorMap inputs) {
  DimBindings dims;
  check_call_tensors(decl, "input", decl.contract.inputs, inputs, dims);
  const int32_t position = inputs.at("position").values<int32_t>()[0];
  if (position != ctx.position)
    fail("stage '", decl.id, "' (drafter) input 'position' is ", position, " but the target's ",
         "caches it reads hold ", ctx.position, " positions; a draft step queries that many");
  const int32_t token = inputs.at("input_token").values<int32_t>()[0];
  const auto given = inputs.at("target_hidden").values<float>();
  std::vector<float> h(given.begin(), given.end());
  const int32_t drafted = drafter.step(pool, ctx, token, h);
  TensorMap out;
  out["draft_token"] = HostTensor({1}, std::vector<int32_t>{drafted});
  const int64_t width = static_cast<int64_t>(h.size());
  out["next_hidden"] = HostTensor({width}, std::move(h));
  check_call_tensors(decl, "output", decl.contract.outputs, out, dims);
  return out;
}

}  // namespace gemstage
