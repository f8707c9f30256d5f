#include "kernels/experts.h"

#include <algorithm>
#include <cstring>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

namespace gemstage {

WeightView expert_slice(const WeightView& stacked, int64_t e) {
  if (stacked.shape.size() != 3)
    fail("expert weights ", stacked.name, " must be [experts, rows, cols], got ",
         shape_str(stacked.shape));
  const int64_t E = stacked.shape[0], N = stacked.shape[1], K = stacked.shape[2];
  if (e < 0 || e >= E) fail("expert ", e, " is outside the ", E, " experts of ", stacked.name);
  const size_t row_bytes = dtype_is_quantized(stacked.dtype)
                               ? quant_row_bytes(stacked.dtype, K)
                               : static_cast<size_t>(K) * dtype_size(stacked.dtype);
  const size_t bytes = row_bytes * static_cast<size_t>(N);
  if (stacked.nbytes != bytes * static_cast<size_t>(E))
    fail("expert weights ", stacked.name, ": ", stacked.nbytes, " bytes, expected ",
         bytes * static_cast<size_t>(E), " for ", shape_str(stacked.shape), " ",
         dtype_name(stacked.dtype));
  WeightView v = stacked;
  v.name = stacked.name + "[" + std::to_string(e) + "]";
  v.shape = {N, K};
  v.data = static_cast<const uint8_t*>(stacked.data) + bytes * static_cast<size_t>(e);
  v.nbytes = bytes;
  return v;
}

void experts_forward(ThreadPool& pool, const float* x, int64_t S, const WeightView& gate_up,
                     const WeightView& down, const int32_t* ids, const float* weights,
                     int64_t top_k, float* out, ExpertsWorkspace& ws) {
  if (gate_up.shape.size() != 3 || down.shape.size() != 3)
    fail("experts: stacked weights must be 3-D, got ", shape_str(gate_up.shape), " and ",
         shape_str(down.shape));
  const int64_t E = gate_up.shape[0], I = gate_up.shape[1] / 2, D = gate_up.shape[2];
  if (gate_up.shape[1] != 2 * I || down.shape != Shape{E, D, I})
    fail("experts: ", gate_up.name, " ", shape_str(gate_up.shape), " and ", down.name, " ",
         shape_str(down.shape), " do not make [E, 2I, D] and [E, D, I]");
  std::fill_n(out, S * D, 0.0f);
  // Counting sort of the (row, slot) assignments by expert; rows stay in order within one.
  ws.count.assign(static_cast<size_t>(E + 1), 0);
  for (int64_t i = 0; i < S * top_k; ++i) {
    const int32_t e = ids[i];
    if (e < 0 || e >= E) fail("experts: row ", i / top_k, " chose expert ", e, " of ", E);
    ++ws.count[static_cast<size_t>(e + 1)];
  }
  for (int64_t e = 0; e < E; ++e) ws.count[static_cast<size_t>(e + 1)] += ws.count[e];
  ws.assignments.resize(static_cast<size_t>(S * top_k));
  {
    std::vector<int64_t> next(ws.count.begin(), ws.count.end() - 1);
    for (int64_t i = 0; i < S * top_k; ++i)
      ws.assignments[static_cast<size_t>(next[static_cast<size_t>(ids[i])]++)] = i;
  }
  // A decode step (one row) of quantized experts runs as two jobs for the pool, not 2 top_k:
  // the chosen experts' gate/up matrices (which read the same input, quantized once), then their
  // down projections (each reading its own activation). Every matrix here is small (1-2 MB at
  // 26B-A4B's shapes), so per-call hand-offs and the idle tail of each call were a visible share
  // of the step.
  const bool one_job = S == 1 && dtype_is_quantized(gate_up.dtype) &&
                       dtype_is_quantized(down.dtype) && pool.tier() != CpuTier::Scalar;
  if (one_job) {
    std::vector<int64_t> chosen;
    for (int64_t e = 0; e < E; ++e)
      if (ws.count[static_cast<size_t>(e + 1)] > ws.count[static_cast<size_t>(e)])
        chosen.push_back(e);
    const auto n_chosen = static_cast<int64_t>(chosen.size());
    ws.gate_up.resize(static_cast<size_t>(n_chosen * 2 * I));
    ws.act.resize(static_cast<size_t>(n_chosen * I));
    ws.y.resize(static_cast<size_t>(n_chosen * D));
    // One pool job over the chosen experts' slices of matrix m: output j at y + j * out_w; input
    // the shared x, or (own_x set) row j of own_x, in_w wide.
    std::vector<WeightView> slices(chosen.size());
    std::vector<QuantTarget> targets(chosen.size());
    const auto run_chosen = [&](const WeightView& m, const float* shared_x, float* y, int64_t out_w,
                                const float* own_x, int64_t in_w) {
      for (size_t j = 0; j < chosen.size(); ++j) {
        const auto jj = static_cast<int64_t>(j);
        slices[j] = expert_slice(m, chosen[j]);
        targets[j] = {&slices[j], y + jj * out_w, own_x ? own_x + jj * in_w : nullptr};
      }
      quant_matmul_many(pool, shared_x, 1, targets);
    };
    run_chosen(gate_up, x, ws.gate_up.data(), 2 * I, nullptr, 0);
    for (int64_t j = 0; j < n_chosen; ++j) {
      const float* g = ws.gate_up.data() + j * 2 * I;
      gelu_tanh_mul(pool.tier(), g, g + I, I, ws.act.data() + j * I);
    }
    run_chosen(down, nullptr, ws.y.data(), D, ws.act.data(), I);
    // Summed in ascending expert id, as the loop below (and transformers) does.
    for (int64_t j = 0; j < n_chosen; ++j) {
      const int64_t e = chosen[static_cast<size_t>(j)];
      const int64_t a0 = ws.count[static_cast<size_t>(e)],
                    n = ws.count[static_cast<size_t>(e + 1)] - a0;
      const float* y = ws.y.data() + j * D;
      for (int64_t k = 0; k < n; ++k) {  // n > 1 only if the row named this expert twice
        const float w = weights[ws.assignments[static_cast<size_t>(a0 + k)]];
        for (int64_t d = 0; d < D; ++d) out[d] += y[d] * w;
      }
    }
    return;
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t a0 = ws.count[static_cast<size_t>(e)],
                  n = ws.count[static_cast<size_t>(e + 1)] - a0;
    if (n == 0) continue;  // no row chose it: its weights are not read
    ws.x.resize(static_cast<size_t>(n * D));
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(ws.x.data() + j * D, x + ws.assignments[static_cast<size_t>(a0 + j)] / top_k * D,
                  static_cast<size_t>(D) * sizeof(float));
    ws.gate_up.resize(static_cast<size_t>(n * 2 * I));
    matmul(pool, ws.x.data(), n, expert_slice(gate_up, e), ws.gate_up.data());
    ws.act.resize(static_cast<size_t>(n * I));
    for (int64_t j = 0; j < n; ++j) {
      const float* g = ws.gate_up.data() + j * 2 * I;
      gelu_tanh_mul(pool.tier(), g, g + I, I, ws.act.data() + j * I);
    }
    ws.y.resize(static_cast<size_t>(n * D));
    matmul(pool, ws.act.data(), n, expert_slice(down, e), ws.y.data());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = ws.assignments[static_cast<size_t>(a0 + j)];
      const float w = weights[i];
      float* o = out + i / top_k * D;
      const float* y = ws.y.data() + j * D;
      for (int64_t d = 0; d < D; ++d) o[d] += y[d] * w;
    }
  }
}

}  // namespace gemstage
