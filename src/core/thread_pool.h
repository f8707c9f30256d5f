// One pool, created by the CLI, the server or a test and passed down by reference: the compute
// context of everything run on it. Besides its threads it carries the CPU tier whose kernels its
// computations run (core/cpu_features.h) and, optionally, the OpProfile their timers add to, so
// nothing about how a computation runs is process state: two pools in one process may run two
// models at two tiers side by side.
//
// parallel_for splits [0, n) into contiguous ranges, one per worker, and runs them to completion.
//
// Decode issues a few hundred parallel_for calls per token, each only 2-100 us of work, so the
// hand-off has to cost far less than a futex round trip (~40 us measured with a condition
// variable on a 2-core VM). Workers therefore spin on an atomic job counter for a short while
// after each job (kSpin), and only then sleep on it (C++20 atomic wait), so an idle server or
// a CLI between phases does not burn its cores.
//
// Every job runs with subnormal floats flushed to zero (FTZ/DAZ; see thread_pool.cc for the
// measurement), on the workers and on the calling thread alike, so a result does not depend on
// which thread computed it or on the thread count.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/cpu_features.h"
#include "core/op_profile.h"

namespace gemstage {

class ThreadPool {
 public:
  // Runs the kernels of `tier` (which this CPU must support; see checked_cpu_tier).
  ThreadPool(int n_threads, CpuTier tier);
  // Runs cpu_tier_from_environment(): GEMSTAGE_ISA, else the best tier of this CPU.
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  CpuTier tier() const { return tier_; }
  // The profile computations on this pool add their OpTimers to; null (the default): none.
  OpProfile* profile() const { return profile_; }
  void set_profile(OpProfile* profile) { profile_ = profile; }

  // fn(begin, end) over disjoint ranges covering [0, n). Ranges are aligned to `grain`. An
  // exception thrown by fn on any thread is rethrown here once every range has finished.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);

  // fn(begin, end) over [0, n) in ranges of `chunk` (the last may be shorter), each taken in
  // order by whichever thread is free. For work whose threads run at uneven speeds (sharing the
  // DRAM bandwidth, on a hybrid CPU's slower cores, on a busy host), where an even split leaves
  // the faster ones waiting at the end.
  void parallel_chunks(size_t n, size_t chunk, const std::function<void(size_t, size_t)>& fn);

  // A chunk for parallel_chunks that gives each thread about four: enough for the faster threads
  // to take over a slower one's share, few enough that each chunk is still a long run of work.
  // Whole multiples of `grain`, at least one.
  size_t chunk_for(size_t n, size_t grain) const {
    const size_t chunk = n / (4 * static_cast<size_t>(n_threads_)) / grain * grain;
    return chunk > grain ? chunk : grain;
  }

 private:
  void worker_loop(int index);
  void run_share(int index) noexcept;

  int n_threads_;
  CpuTier tier_;
  OpProfile* profile_ = nullptr;
  std::vector<std::thread> workers_;
  // The job being run; written by parallel_for before it bumps generation_.
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_grain_ = 1;
  std::atomic<uint64_t> generation_{0};  // bumped once per job; workers wait on it
  std::atomic<int> pending_{0};          // workers still running the current job
  std::atomic<int> sleeping_workers_{0};
  std::atomic<bool> caller_sleeping_{false};
  std::atomic<bool> stop_{false};
  std::mutex error_mu_;
  std::exception_ptr error_;
};

// A sensible default thread count: the hardware's, at least 1, shared among the ranks of an
// MPI job on this host.
int default_thread_count();

}  // namespace gemstage
