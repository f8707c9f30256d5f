// Reading stored weights row by row as f32: any float dtype or Q8_0/Q4_0 blocks (kernels/quant.h).
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace gemstage {

// Element i of a float-typed or Q8_0/Q4_0 view as f32 (reference path; not for hot loops).
float weight_at(const WeightView& w, int64_t i);
// Row `row` of a float-typed view converted to f32; Q8_0/Q4_0 views are dequantized
// (nbytes = rows * quant_row_bytes, see kernels/quant.h).
void weight_row_to_f32(const WeightView& w, int64_t row, float* out);
// The same row, read with pread from the view's file when it has one (through the mapping when
// not); `raw` is scratch for the stored bytes. For tables looked up one row per token (token
// embeddings, the PLE table): touching a mapped row maps the kernel's whole fault-around window
// (64 KiB) into the process, so a prompt's random rows left most of the 2.3 GB E2B PLE table
// resident; read rows stay in the page cache and out of the process's memory.
void gather_weight_row_to_f32(const WeightView& w, int64_t row, float* out,
                              std::vector<uint8_t>& raw);

}  // namespace gemstage
