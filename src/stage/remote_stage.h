// A stage that runs in another process (the MPI ranks of src/distributed): the front process
// holds neither its weights nor its caches, only this handle. Each sequence is addressed by a
// number the front chooses; the process that runs the stage keeps that sequence's cache group.
// Calls carry exactly the stage contract's tensors, so the front builds a remote stage's inputs
// as it builds a local one's.
//
// A remote call appends its rows to the far caches uncommitted, as a local stage does: the front
// commits them once the whole call ran through every stage, or drops them when a later stage
// failed, so a failed call leaves every sequence as it was on every process.
//
// A call is submitted and its reply collected apart, so the front can run its own stages of one
// call, or hand the next call to another process, while this one computes (stage/call_pipeline.h).
// Each process runs what it is sent in the order sent.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <span>
#include <string>

#include "cache/kv_cache.h"
#include "core/host_tensor.h"
#include "stage/contract.h"

namespace gemstage {

// What the remote stage's forward calls cost on the way, for the per-hop table of `bench`.
struct RemoteStageStats {
  uint64_t calls = 0, rows = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;  // tensor payload both ways
  double round_trip_seconds = 0;  // submit to collect, as the front saw it (with a pipeline
                                  // this includes the time the call queued behind others)
  double compute_seconds = 0;     // the far stage's own run, as it reported
};

class RemoteStage {
 public:
  virtual ~RemoteStage() = default;

  // Sizes a cache group for `sequence` (replacing one it had).
  virtual void open_sequence(uint64_t sequence, int64_t max_context, KvType kv_type) = 0;
  // Forgets the sequence. Never throws: a process that is gone holds nothing to free.
  virtual void close_sequence(uint64_t sequence) noexcept = 0;
  // Whether the sequence's caches can forget positions n.. (a sliding ring cannot always).
  virtual bool can_truncate(uint64_t sequence, int64_t n) = 0;
  virtual void truncate(uint64_t sequence, int64_t n) = 0;
  // One call: `inputs` per the contract, `sequences` the cache groups its row_sequence indexes
  // (one entry without row_sequence). Sends it and returns at once with a ticket for the reply.
  virtual uint64_t submit(TensorMap inputs, std::span<const uint64_t> sequences) = 0;
  // Whether collect(ticket) would return (or throw) without waiting.
  virtual bool ready(uint64_t ticket) = 0;
  // The call's outputs per the contract, checked; waits for them (bounded: a process that stops
  // answering fails the call, see failure()). Each ticket is collected once.
  virtual TensorMap collect(uint64_t ticket) = 0;
  // submit and collect.
  TensorMap run(TensorMap inputs, std::span<const uint64_t> sequences) {
    return collect(submit(std::move(inputs), sequences));
  }
  // Keeps (commit) or forgets (drop) the rows the last run appended for these sequences.
  virtual void commit(std::span<const uint64_t> sequences) = 0;
  virtual void drop_uncommitted(std::span<const uint64_t> sequences) noexcept = 0;

  // Bytes of every matrix the stage reads for one decoded token (as Stage::decode_weight_bytes).
  virtual double decode_weight_bytes() const = 0;
  // Which process runs the stage (an MPI rank): stages of one process share its compute, so a
  // pipeline keeps as many calls in flight as there are processes.
  virtual int process() const = 0;
  // Empty while the stage answers; once it stopped answering, why (naming stage, rank and host).
  // Every call after that fails at once with this message.
  virtual std::string failure() const = 0;
  virtual RemoteStageStats stats() const = 0;
};

// How Model::open places a bundle's stages: those named in `local` open here, every other one
// through `remote` (which opens nothing locally). An empty `local` with no `remote` opens all.
struct StagePlacementOptions {
  std::set<std::string> local;
  std::function<std::unique_ptr<RemoteStage>(const StageDecl&)> remote;
};

}  // namespace gemstage
