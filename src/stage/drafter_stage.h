// The MTP drafter as a stage of role `drafter` (docs/gemma4-mtp.md): one call is one draft step,
// its named inputs and outputs are checked against drafter_contract() on every call as any
// stage's are, and the target state it reads in place (the KV caches of two target layers and
// the target's embedding table) is resolved by name: the donor layers (reads_kv) in the cache
// group of the stage it is placed with.
#pragma once

#include <string>

#include "core/host_tensor.h"
#include "core/thread_pool.h"
#include "gemma4/assistant_model.h"
#include "stage/contract.h"

namespace gemstage {

// The drafter's declaration: id (a bundle's drafter id, or "drafter") and its contract for a
// target of this hidden size.
StageDecl drafter_stage_decl(const AssistantModel& drafter, const std::string& id = "drafter");

// One checked draft step: input_token i32 [1], target_hidden f32 [H_t], position i32 [1] ->
// draft_token i32 [1], next_hidden f32 [H_t]. ctx holds the donor caches and the target's
// embedding table; the position input must be ctx.position (the rows the caches hold).
TensorMap run_drafter_stage(ThreadPool& pool, const AssistantModel& drafter, const StageDecl& decl,
                            const DraftContext& ctx, TensorMap inputs);

}  // namespace gemstage
