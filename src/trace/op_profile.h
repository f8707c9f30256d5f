// Where a forward pass spends its wall time, by kind of work: `bench --profile` switches it on
// and prints each test's shares. Off (the default) a timer costs one relaxed atomic load.
//
// The model code calls the thread pool synchronously, so the caller's wall time around a call is
// the time the whole pool spent on it. What no timer covers (norms, RoPE, activations, residual
// adds, copies) is the test's total minus the timed kinds. Timers do not nest: each kind is timed
// around calls that contain no other timed kind.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

namespace gemstage {

enum class OpKind : int {
  Embeddings,            // the embeddings stage: token and PLE row gathers, PLE projection
  AttentionProjections,  // Q/K/V and output projections
  Attention,             // scores, softmax and values over the cache and the fresh rows
  MlpProjections,        // the dense MLP's gate/up and down projections
  Experts,               // an MoE layer's router and its chosen experts' GEMMs
  PerLayerInput,         // the per-layer-input (PLE) gate, projection and norm of each layer
  Head,                  // final norm and LM head
  kCount,
};

const char* op_kind_name(OpKind k);

// Seconds per kind since the last reset.
using OpSeconds = std::array<double, static_cast<size_t>(OpKind::kCount)>;

void op_profile_enable(bool on);
bool op_profile_enabled();
void op_profile_reset();
OpSeconds op_profile_seconds();

// Adds the wall time of its scope to `kind` while the profile is on.
class OpTimer {
 public:
  explicit OpTimer(OpKind kind);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  OpKind kind_;
  int64_t start_ns_;  // < 0: the profile was off when the scope began
};

}  // namespace gemstage
