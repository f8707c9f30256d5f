// Where a forward pass spends its wall time, by kind of work: `bench --profile` hands its thread
// pool an OpProfile and prints each test's shares. Without one (the default) a timer costs a
// null check.
//
// The model code calls the thread pool synchronously, so the caller's wall time around a call is
// the time the whole pool spent on it. What no timer covers (norms, RoPE, activations, residual
// adds, copies) is the test's total minus the timed kinds. Timers do not nest: each kind is timed
// around calls that contain no other timed kind.
#pragma once

#include <array>
#include <atomic>
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

// Seconds per kind.
using OpSeconds = std::array<double, static_cast<size_t>(OpKind::kCount)>;

// Wall time per kind of work, added to by the OpTimers of every computation on a pool that
// carries this profile (ThreadPool::set_profile). Thread-safe.
class OpProfile {
 public:
  void add(OpKind kind, int64_t ns) {
    ns_[static_cast<size_t>(kind)].fetch_add(ns, std::memory_order_relaxed);
  }
  void reset();
  OpSeconds seconds() const;

 private:
  std::array<std::atomic<int64_t>, static_cast<size_t>(OpKind::kCount)> ns_{};
};

// Adds the wall time of its scope to `kind` in `profile`; does nothing when profile is null.
class OpTimer {
 public:
  OpTimer(OpProfile* profile, OpKind kind);
  ~OpTimer();
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;

 private:
  OpProfile* profile_;
  OpKind kind_;
  int64_t start_ns_ = 0;
};

}  // namespace gemstage
