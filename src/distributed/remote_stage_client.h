// The front's handle on a stage another rank runs (stage/remote_stage.h over the wire format of
// distributed/wire.h), and the channel it talks through. The channel is abstract so the same
// client runs over MPI between processes (mpi_launch.h) and over an in-process loopback in tests.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/wire.h"
#include "stage/remote_stage.h"

namespace gemstage {

// The front's end of the channels to the worker ranks. Messages to one rank arrive in the order
// sent. Thread-safe.
class StageTransport {
 public:
  virtual ~StageTransport() = default;
  // Sends `request` to `rank`; with want_reply waits for the reply and returns its bytes. Waiting
  // is bounded: a rank that neither answers nor reports that it is still computing within the
  // transport's timeout fails the call (gemstage::Error saying so), as does a rank that failed
  // before. Every later call to that rank fails at once.
  virtual std::vector<uint8_t> exchange(int rank, const std::vector<uint8_t>& request,
                                        bool want_reply) = 0;
  // "rank 1 (host b)", for messages.
  virtual std::string rank_name(int rank) const = 0;
};

class RemoteStageClient final : public RemoteStage {
 public:
  // decode_weight_bytes: what the rank reported for the stage at the handshake.
  RemoteStageClient(StageDecl decl, int rank, std::shared_ptr<StageTransport> transport,
                    double decode_weight_bytes);

  void open_sequence(uint64_t sequence, int64_t max_context, KvType kv_type) override;
  void close_sequence(uint64_t sequence) noexcept override;
  bool can_truncate(uint64_t sequence, int64_t n) override;
  void truncate(uint64_t sequence, int64_t n) override;
  TensorMap run(TensorMap inputs, std::span<const uint64_t> sequences) override;
  void commit(std::span<const uint64_t> sequences) override;
  void drop_uncommitted(std::span<const uint64_t> sequences) noexcept override;
  double decode_weight_bytes() const override { return decode_weight_bytes_; }
  std::string failure() const override;
  RemoteStageStats stats() const override;

 private:
  // Sends m; returns the reply (a Result) for ops that have one. A transport error or a Failure
  // reply that names a dead channel is kept as this stage's failure.
  WireMessage call(WireMessage m);

  StageDecl decl_;
  int rank_;
  std::shared_ptr<StageTransport> transport_;
  double decode_weight_bytes_;
  mutable std::mutex mu_;  // failure_ and stats_
  std::string failure_;
  RemoteStageStats stats_;
};

}  // namespace gemstage
