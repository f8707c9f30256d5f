#include "trace/op_profile.h"

#include <atomic>
#include <chrono>

namespace gemstage {

namespace {

std::atomic<bool> g_enabled{false};
std::array<std::atomic<int64_t>, static_cast<size_t>(OpKind::kCount)> g_ns{};

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::Embeddings:
      return "embeddings";
    case OpKind::AttentionProjections:
      return "attention projections";
    case OpKind::Attention:
      return "attention";
    case OpKind::MlpProjections:
      return "MLP projections";
    case OpKind::Experts:
      return "experts";
    case OpKind::PerLayerInput:
      return "per-layer input";
    case OpKind::Head:
      return "head";
    case OpKind::kCount:
      break;
  }
  return "?";
}

void op_profile_enable(bool on) {
  g_enabled.store(on, std::memory_order_relaxed);
}

bool op_profile_enabled() {
  return g_enabled.load(std::memory_order_relaxed);
}

void op_profile_reset() {
  for (auto& ns : g_ns) ns.store(0, std::memory_order_relaxed);
}

OpSeconds op_profile_seconds() {
  OpSeconds s{};
  for (size_t i = 0; i < s.size(); ++i)
    s[i] = static_cast<double>(g_ns[i].load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

OpTimer::OpTimer(OpKind kind) : kind_(kind), start_ns_(op_profile_enabled() ? now_ns() : -1) {}

OpTimer::~OpTimer() {
  if (start_ns_ < 0) return;
  g_ns[static_cast<size_t>(kind_)].fetch_add(now_ns() - start_ns_, std::memory_order_relaxed);
}

}  // namespace gemstage
