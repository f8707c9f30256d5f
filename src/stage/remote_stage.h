// A stage that runs in another process (the MPI ranks of src/distributed): the front process
// holds neither its weights nor its caches, only this handle. Each sequence is addressed by a
// number the front chooses; the process that runs the stage keeps that sequence's cache group.
// Calls carry exactly the stage contract's tensors, so the front builds a remote stage's inputs
// as it builds a local one's.
//
// A remote call appends its rows to the far caches uncommitted, as a local stage does: the front
// commits them once the whole call ran through every stage, or drops them when a later stage
// failed, so a failed call leaves every sequence as it was on every process.
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
  double round_trip_seconds = 0;                // send to reply, as the front saw it
  double compute_seconds = 0;                   // the far stage's own run, as it reported
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
  // (one entry without row_sequence). Returns the contract's outputs, checked.
  virtual TensorMap run(TensorMap inputs, std::span<const uint64_t> sequences) = 0;
  // Keeps (commit) or forgets (drop) the rows the last run appended for these sequences.
  virtual void commit(std::span<const uint64_t> sequences) = 0;
  virtual void drop_uncommitted(std::span<const uint64_t> sequences) noexcept = 0;

  // Bytes of every matrix the stage reads for one decoded token (as Stage::decode_weight_bytes).
  virtual double decode_weight_bytes() const = 0;
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
