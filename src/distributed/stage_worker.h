// What a worker rank does with each message: runs its own stages on the contract tensors that
// arrive and keeps every sequence's cache group for them. Transport-free (the MPI loop of
// mpi_launch.cc feeds it, and tests feed it directly), so the whole protocol is testable in one
// process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "cache/kv_cache.h"
#include "core/thread_pool.h"
#include "distributed/wire.h"
#include "stage/model.h"

namespace gemstage {

class StageWorker {
 public:
  // model: the bundle opened with only this rank's stages (Model::open with a placement);
  // where: "rank 1 (host b)", for the errors it sends back.
  StageWorker(std::shared_ptr<const Model> model, ThreadPool& pool, std::string where);

  // Handles one message; returns the reply for ops that have one (wire_op_has_reply). An error
  // in an op without a reply (a commit for a sequence it never saw) is kept and returned as the
  // Failure of the next op that has one, so nothing fails unseen.
  std::optional<WireMessage> handle(const WireMessage& m);

  // Sequences with a cache group here, over all stages (for tests and logs).
  size_t sequences() const;

 private:
  struct SequenceState {
    std::unique_ptr<KvCache> cache;  // null for a stage without one
    int64_t pending = 0;             // rows the last forward appended, not yet committed
  };
  WireMessage run(const Stage& stage, const WireMessage& m);
  SequenceState& state(const Stage& stage, uint64_t sequence);

  std::shared_ptr<const Model> model_;
  ThreadPool& pool_;
  std::string where_;
  std::map<std::string, std::map<uint64_t, SequenceState>> sequences_;  // stage id -> number
  std::string deferred_error_;
};

}  // namespace gemstage
