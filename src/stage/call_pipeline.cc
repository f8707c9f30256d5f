#include "stage/call_pipeline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "core/error.h"

namespace gemstage {

int CallPipeline::depth(const Model& model, int requested) {
  if (requested > 0) return requested;
  // Split over P calls, each process's time is shared out P ways, though each call batches
  // fewer rows. Measured on E2B (docs/distributed.md, "Pipelining") that gains 55% with the layers
  // split evenly and costs about 5% with rank 0 holding only the head, so every process that runs
  // stages gets a call.
  std::set<int> processes;
  for (const auto& r : model.remote_stages())
    if (r) processes.insert(r->process());
  return 1 + static_cast<int>(processes.size());
}

uint64_t CallPipeline::start(std::span<const BatchEntry> batch, TapRecorder* taps,
                             const TextRunOptions& opt) {
  auto call = std::make_unique<BatchCall>(batch, taps, opt);
  calls_.emplace(++last_, std::move(call));
  return last_;
}

CallPipeline::Finished CallPipeline::next() {
  if (calls_.empty()) fail("call pipeline: next() with no call in flight");
  auto pause = std::chrono::microseconds(0);
  for (;;) {
    // A call that has run every stage is handed back first, so its sequences go on at once.
    for (auto it = calls_.begin(); it != calls_.end(); ++it) {
      if (!it->second->done()) continue;
      Finished f;
      f.call = it->first;
      try {
        f.logits = it->second->finish();
      } catch (...) {
        f.error = std::current_exception();
      }
      calls_.erase(it);
      return f;
    }
    // Otherwise this process works on the call nearest its end that needs no waiting (its
    // reply is in, or its next stage is one of ours)...
    BatchCall* best = nullptr;
    for (auto& [number, call] : calls_)
      if ((!best || call->stages_run() > best->stages_run()) && call->ready()) best = call.get();
    if (best) {
      best->advance(pool_);
      pause = std::chrono::microseconds(0);
      continue;
    }
    // ... or, with every call waiting on another process, waits for the first reply: briefly
    // yielding for a decode hop's short round trip, then sleeping so as not to take a core
    // from the processes it waits on.
    if (pause.count() == 0) {
      std::this_thread::yield();
      pause = std::chrono::microseconds(1);
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min<std::chrono::microseconds>(pause * 2, std::chrono::microseconds(200));
    }
  }
}

}  // namespace gemstage
