#include "core/op_profile.h"

#include <chrono>

namespace gemstage {

namespace {

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

void OpProfile::reset() {
  for (auto& ns : ns_) ns.store(0, std::memory_order_relaxed);
}

OpSeconds OpProfile::seconds() const {
  OpSeconds s{};
  for (size_t i = 0; i < s.size(); ++i)
    s[i] = static_cast<double>(ns_[i].load(std::memory_order_relaxed)) * 1e-9;
  return s;
}

OpTimer::OpTimer(OpProfile* profile, OpKind kind) : profile_(profile), kind_(kind) {
  if (profile_) start_ns_ = now_ns();
}

OpTimer::~OpTimer() {
  if (profile_) profile_->add(kind_, now_ns() - start_ns_);
}

}  // namespace gemstage
