#include "distributed/stage_worker.h"

#include <chrono>

#include "core/error.h"

namespace gemstage {

StageWorker::StageWorker(std::shared_ptr<const Model> model, ThreadPool& pool, std::string where)
    : model_(std::move(model)), pool_(pool), where_(std::move(where)) {}

size_t StageWorker::sequences() const {
  size_t n = 0;
  for (const auto& [id, seqs] : sequences_) n += seqs.size();
  return n;
}

StageWorker::SequenceState& StageWorker::state(const Stage& stage, uint64_t sequence) {
  auto& seqs = sequences_[stage.id()];
  const auto it = seqs.find(sequence);
  if (it == seqs.end())
    fail("stage ", stage.id(), " on ", where_, ": sequence ", sequence, " was never created here");
  return it->second;
}

WireMessage StageWorker::run(const Stage& stage, const WireMessage& m) {
  check_wire_tensors(m, stage.decl(), "input");
  // Which rows belong to which sequence: row_sequence indexes m.sequences; without it every
  // row is the one sequence's.
  const auto hidden = m.tensors.find("hidden_states");
  const int64_t rows = hidden != m.tensors.end() ? hidden->second.shape()[0] : 0;
  std::vector<int64_t> rows_of(m.sequences.size(), 0);
  if (const auto rs = m.tensors.find("row_sequence"); rs != m.tensors.end()) {
    for (int32_t k : rs->second.values<int32_t>()) {
      if (k < 0 || static_cast<size_t>(k) >= m.sequences.size())
        fail("stage ", stage.id(), " on ", where_, ": row_sequence entry ", k, " outside the ",
             m.sequences.size(), " sequences of the call");
      ++rows_of[static_cast<size_t>(k)];
    }
  } else if (stage.role() == StageRole::TransformerLayers) {
    if (m.sequences.size() != 1)
      fail("stage ", stage.id(), " on ", where_, ": ", m.sequences.size(),
           " sequences without a row_sequence tensor");
    rows_of[0] = rows;
  }
  std::vector<KvCache*> caches;
  if (stage.role() == StageRole::TransformerLayers)
    for (uint64_t s : m.sequences) caches.push_back(state(stage, s).cache.get());
  const auto t0 = std::chrono::steady_clock::now();
  WireMessage out;
  out.op = WireOp::Result;
  out.stage = stage.id();
  out.sequences = m.sequences;
  try {
    out.tensors = stage.run(pool_, m.tensors, caches, TextRunOptions{}, nullptr);
  } catch (...) {
    for (KvCache* c : caches)
      if (c) c->drop_uncommitted();
    throw;
  }
  out.length =
      std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0)
          .count();
  if (stage.role() == StageRole::TransformerLayers)
    for (size_t k = 0; k < m.sequences.size(); ++k)
      state(stage, m.sequences[k]).pending = rows_of[k];
  return out;
}

std::optional<WireMessage> StageWorker::handle(const WireMessage& m) {
  const bool reply = wire_op_has_reply(m.op);
  WireMessage out;
  out.op = WireOp::Result;
  out.stage = m.stage;
  try {
    if (!deferred_error_.empty() && reply) {
      const std::string e = std::move(deferred_error_);
      deferred_error_.clear();
      fail(e);
    }
    const Stage* stage = model_->find_stage(m.stage);
    if (!stage) fail("stage ", m.stage, " is not held by ", where_);
    auto& seqs = sequences_[stage->id()];
    switch (m.op) {
      case WireOp::CreateSequence: {
        if (m.sequences.size() != 1) fail("create: one sequence per message");
        if (m.length < 1 || m.length > model_->max_context())
          fail("stage ", stage->id(), " on ", where_, ": context ", m.length, " outside 1..",
               model_->max_context());
        seqs[m.sequences[0]] = SequenceState{stage->new_cache(m.length, m.kv_type), 0};
        break;
      }
      case WireOp::FreeSequence:
        for (uint64_t s : m.sequences) seqs.erase(s);
        break;
      case WireOp::Forward:
        out = run(*stage, m);
        break;
      case WireOp::Commit:
        for (uint64_t s : m.sequences) {
          SequenceState& st = state(*stage, s);
          if (st.cache) st.cache->advance(st.pending);
          st.pending = 0;
        }
        break;
      case WireOp::Drop:
        for (uint64_t s : m.sequences) {
          const auto it = seqs.find(s);
          if (it == seqs.end()) continue;
          if (it->second.cache) it->second.cache->drop_uncommitted();
          it->second.pending = 0;
        }
        break;
      case WireOp::CanTruncate:
      case WireOp::Truncate: {
        if (m.sequences.size() != 1) fail("truncate: one sequence per message");
        SequenceState& st = state(*stage, m.sequences[0]);
        const bool can =
            !st.cache || (m.length <= st.cache->n_past() && st.cache->can_truncate(m.length));
        if (m.op == WireOp::CanTruncate) {
          out.length = can ? 1 : 0;
        } else {
          if (!can)
            fail("stage ", stage->id(), " on ", where_, ": cannot truncate sequence ",
                 m.sequences[0], " to ", m.length, " positions");
          if (st.cache) st.cache->truncate(m.length);
        }
        break;
      }
      default:
        fail("a worker does not take ", wire_op_name(m.op), " messages");
    }
  } catch (const std::exception& e) {
    if (!reply) {
      if (deferred_error_.empty()) deferred_error_ = e.what();
      return std::nullopt;
    }
    WireMessage f;
    f.op = WireOp::Failure;
    f.stage = m.stage;
    f.error = e.what();
    return f;
  }
  if (!reply) return std::nullopt;
  return out;
}

}  // namespace gemstage
