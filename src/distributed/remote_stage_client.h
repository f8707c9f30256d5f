// The front's handle on a stage another rank runs (stage/remote_stage.h over the wire format of
// distributed/wire.h), and the channel it talks through. The channel is abstract so the same
// client runs over MPI between processes (mpi_launch.h) and over an in-process loopback in tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/wire.h"
#include "stage/remote_stage.h"

namespace gemstage {

// The front's end of the channels to the worker ranks. Messages to one rank arrive, and are
// answered, in the order sent; replies are matched to requests by that order. Thread-safe.
class StageTransport {
 public:
  virtual ~StageTransport() = default;
  // Sends `request` to `rank`; with want_reply returns a ticket for the reply (else 0). Sending
  // is bounded by the transport's timeout; a rank that failed before fails the call at once.
  virtual uint64_t post(int rank, const std::vector<uint8_t>& request, bool want_reply) = 0;
  // Whether take(ticket) would return or throw without waiting.
  virtual bool ready(uint64_t ticket) = 0;
  // The reply's bytes. Waiting is bounded: a rank that neither answers nor reports that it is
  // still computing within the transport's timeout fails the call (gemstage::Error saying so),
  // and every later call to that rank fails at once.
  virtual std::vector<uint8_t> take(uint64_t ticket) = 0;
  // "rank 1 (host b)", for messages.
  virtual std::string rank_name(int rank) const = 0;

  std::vector<uint8_t> exchange(int rank, const std::vector<uint8_t>& request, bool want_reply) {
    const uint64_t ticket = post(rank, request, want_reply);
    return want_reply ? take(ticket) : std::vector<uint8_t>{};
  }
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
  uint64_t submit(TensorMap inputs, std::span<const uint64_t> sequences) override;
  bool ready(uint64_t ticket) override;
  TensorMap collect(uint64_t ticket) override;
  void commit(std::span<const uint64_t> sequences) override;
  void drop_uncommitted(std::span<const uint64_t> sequences) noexcept override;
  double decode_weight_bytes() const override { return decode_weight_bytes_; }
  int process() const override { return rank_; }
  std::string failure() const override;
  RemoteStageStats stats() const override;

 private:
  // Sends m; returns the reply (a Result) for ops that have one. A transport error is kept as
  // this stage's failure.
  WireMessage call(WireMessage m);
  // The two halves of call: post returns the reply's ticket (0 for ops without one).
  uint64_t post(WireMessage m);
  WireMessage receive(uint64_t ticket, WireOp op);
  std::string where() const;
  [[noreturn]] void channel_failed(const Error& e);

  // A forward call in flight: what its stats need once the reply is in.
  struct InFlight {
    std::chrono::steady_clock::time_point sent;
    uint64_t rows = 0, bytes = 0;
  };

  StageDecl decl_;
  int rank_;
  std::shared_ptr<StageTransport> transport_;
  double decode_weight_bytes_;
  mutable std::mutex mu_;  // failure_ and stats_
  std::string failure_;
  RemoteStageStats stats_;
  std::map<uint64_t, InFlight> in_flight_;
};

}  // namespace gemstage
