// Several batched calls in flight at once over a model whose stages run in several processes
// (MPI ranks): while another process computes one call, this one runs its own stages of another
// or hands the next call on, so K processes of T threads come close to one process of K*T
// threads. Calls finish in whatever order their stages allow; each is what forward_batch would
// give it alone. With every stage in this process it runs one call after another.
//
// The caller keeps the sequences of the calls in flight out of new calls until their call
// finished (a sequence's next rows take positions after the last call's).
#pragma once

#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "stage/sequence.h"

namespace gemstage {

class CallPipeline {
 public:
  explicit CallPipeline(ThreadPool& pool) : pool_(pool) {}
  // Calls still in flight are dropped: their sequences stay as they were.
  ~CallPipeline() = default;

  // How many calls to keep in flight: `requested` when positive (--pipeline-depth), else enough
  // to keep every process of `model` busy: one per process that runs stages of it (this one and
  // each holding a remote stage).
  static int depth(const Model& model, int requested = 0);

  // Starts a call (checked at once: a batch that cannot run throws here, changing nothing);
  // returns its number. Nothing computes until next().
  uint64_t start(std::span<const BatchEntry> batch, TapRecorder* taps = nullptr,
                 const TextRunOptions& opt = {});

  struct Finished {
    uint64_t call = 0;
    std::vector<FloatTensor> logits;  // per entry, as forward_batch returns them
    std::exception_ptr error;         // set instead when the call failed (no sequence changed)
  };
  // Works the calls in flight until one finishes, and returns it. Needs a call in flight.
  Finished next();
  size_t in_flight() const { return calls_.size(); }

 private:
  ThreadPool& pool_;
  uint64_t last_ = 0;
  std::map<uint64_t, std::unique_ptr<BatchCall>> calls_;  // by number: oldest first
};

}  // namespace gemstage
