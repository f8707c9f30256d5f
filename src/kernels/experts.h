// The experts of a mixture-of-experts block over stacked expert weights: gate_up [E, 2 I, D]
// (gate = the first I rows of an expert) and down [E, D, I], in any weight dtype matmul takes.
// Each expert's matrix is a contiguous slice of whole rows (expert_slice), so a quantized
// (Q8_0 / Q4_0) stack is E independently quantized matrices multiplied by the ordinary kernels
// in place, never dequantized whole.
//
// The rows of a call are grouped by expert (a grouped GEMM): every expert that some row chose
// multiplies the rows that chose it in one matmul, so its matrix is read once per call (a prompt
// chunk), and an expert no row chose is not read at all; a decode step reads only the top-k
// experts its row picked.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"

namespace gemstage {

// Expert e's [N, K] matrix of a stacked [E, N, K] view.
WeightView expert_slice(const WeightView& stacked, int64_t e);

// Buffers reused from layer to layer.
struct ExpertsWorkspace {
  std::vector<float> x, gate_up, act, y;
  std::vector<int64_t> count, assignments;
};

// out[r] = sum over the top_k experts e of row r (ids[r * top_k + j], weight
// weights[r * top_k + j]) of  weight * down_e(gelu_tanh(gate_e x_r) * up_e x_r),  accumulated in
// ascending expert id (the order of transformers' eager loop). x and out are [S, D].
void experts_forward(ThreadPool& pool, const float* x, int64_t S, const WeightView& gate_up,
                     const WeightView& down, const int32_t* ids, const float* weights,
                     int64_t top_k, float* out, ExpertsWorkspace& ws);

}  // namespace gemstage
