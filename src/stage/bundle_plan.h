// What export and check share about a bundle's stage weights: the weights format a manifest
// names, and which checkpoint tensors each stage holds, in which stored format. Internal to the
// stage room (bundle.cc, bundle_export.cc, bundle_check.cc).
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"
#include "gemma4/config.h"
#include "stage/contract.h"

namespace gemstage::bundle_plan {

struct PlannedTensor {
  std::string key;
  DType dtype;
  Shape shape;             // the table's (loading checked the source against it)
  bool kept_bf16 = false;  // quantized in this bundle, but its input width is not a block multiple
};

// The weights format a manifest or --weights names (f32, bf16, q8_0, q4_0).
DType weights_dtype(const std::string& s);
// A Q8_0 / Q4_0 block covers 32 input columns. A matrix whose input width is not a multiple of
// that is stored in bf16 instead (per tensor, as llama-quantize falls back).
DType stored_dtype(DType planned, const Shape& shape);
bool kept_in_bf16(DType planned, const Shape& shape);
// Which checkpoint tensors each stage holds, and in which format: the table's parts and storage
// classes, in the table's order.
std::vector<PlannedTensor> plan_stage_tensors(const StageDecl& d, const ModelConfig& c, DType w,
                                              DType ple);

}  // namespace gemstage::bundle_plan
