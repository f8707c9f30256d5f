#include "core/thread_pool.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <utility>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define GEMSTAGE_CPU_RELAX() _mm_pause()
#define GEMSTAGE_HAVE_MXCSR 1
#else
#define GEMSTAGE_CPU_RELAX() std::this_thread::yield()
#endif

namespace gemstage {

namespace {

// How long a thread polls before it sleeps: longer than the serial gaps between the matmuls of
// one decoded token (norms, RoPE, attention of one row), short enough to be invisible when idle.
constexpr auto kSpin = std::chrono::microseconds(200);

// Polls `done` until it holds or kSpin has passed; true if it held.
template <typename Pred>
bool spin_until(Pred done) {
  const auto deadline = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (done()) return true;
      GEMSTAGE_CPU_RELAX();
    }
    if (std::chrono::steady_clock::now() > deadline) return done();
    // Lets another runnable thread have this core when there are more threads than cores.
    std::this_thread::yield();
  }
}

// Jobs run with subnormal floats flushed to zero (MXCSR FTZ | DAZ). Softmax tails and the tiny
// products they feed are routinely subnormal, and every x86 operation that produces or consumes
// one takes a microcode assist of ~100+ cycles: on the E2B-shape bundle pp512 ran at 78.6 t/s
// with subnormals and 105.9 t/s flushed. What is lost is below 1.2e-38, far under the f32
// resolution of any sum it would enter.
class FlushSubnormals {
 public:
#ifdef GEMSTAGE_HAVE_MXCSR
  FlushSubnormals() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | kFtzDaz);
  }
  ~FlushSubnormals() {
    _mm_setcsr(saved_);
  }
  static void set_for_this_thread() {
    _mm_setcsr(_mm_getcsr() | kFtzDaz);
  }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;  // FTZ (bit 15) | DAZ (bit 6)
  unsigned saved_;
#else
  static void set_for_this_thread() {}
#endif
};

}  // namespace

int default_thread_count() {
  const unsigned h = std::thread::hardware_concurrency();
  const int cores = h == 0 ? 1 : static_cast<int>(h);
  // Ranks of one mpirun job on this host share its cores (Open MPI and MPICH/Slurm-style
  // launchers say how many there are); each taking all of them would oversubscribe the host.
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* v = std::getenv(var)) {
      const int ranks = std::atoi(v);
      if (ranks > 1) return std::max(1, cores / ranks);
    }
  return cores;
}

ThreadPool::ThreadPool(int n_threads, CpuTier tier)
    : n_threads_(std::max(1, n_threads)), tier_(checked_cpu_tier(tier, "ThreadPool")) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::ThreadPool(int n_threads) : ThreadPool(n_threads, cpu_tier_from_environment()) {}

ThreadPool::~ThreadPool() {
  stop_.store(true);
  generation_.fetch_add(1);
  generation_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run_share(int index) noexcept {
  const size_t n = job_n_, grain = job_grain_, parts = static_cast<size_t>(n_threads_);
  const size_t blocks = (n + grain - 1) / grain;
  const size_t b0 = blocks * static_cast<size_t>(index) / parts;
  const size_t b1 = blocks * static_cast<size_t>(index + 1) / parts;
  const size_t begin = std::min(n, b0 * grain), end = std::min(n, b1 * grain);
  if (begin >= end) return;
  try {
    (*job_)(begin, end);
  } catch (...) {
    std::lock_guard<std::mutex> lock(error_mu_);
    if (!error_) error_ = std::current_exception();
  }
}

void ThreadPool::worker_loop(int index) {
  FlushSubnormals::set_for_this_thread();  // workers run nothing but jobs
  uint64_t seen = 0;
  for (;;) {
    if (!spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; })) {
      // seq_cst increment, then the wait re-reads generation_: parallel_for bumps generation_
      // before it reads sleeping_workers_, so either it sees us and notifies, or we see its job.
      sleeping_workers_.fetch_add(1);
      generation_.wait(seen);
      sleeping_workers_.fetch_sub(1);
      continue;
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    run_share(index);
    if (pending_.fetch_sub(1) == 1 && caller_sleeping_.load()) pending_.notify_one();
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn,
                              size_t grain) {
  if (n == 0) return;
  grain = std::max<size_t>(1, grain);
  [[maybe_unused]] const FlushSubnormals flush;  // a no-op off x86
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  job_ = &fn;
  job_n_ = n;
  job_grain_ = grain;
  error_ = nullptr;
  pending_.store(n_threads_ - 1);
  generation_.fetch_add(1);
  if (sleeping_workers_.load() > 0) generation_.notify_all();
  run_share(0);
  if (!spin_until([&] { return pending_.load(std::memory_order_acquire) == 0; })) {
    caller_sleeping_.store(true);
    for (int left = pending_.load(); left != 0; left = pending_.load()) pending_.wait(left);
    caller_sleeping_.store(false);
  }
  if (error_) std::rethrow_exception(std::exchange(error_, nullptr));
}

void ThreadPool::parallel_chunks(size_t n, size_t chunk,
                                 const std::function<void(size_t, size_t)>& fn) {
  chunk = std::max<size_t>(1, chunk);
  const size_t n_chunks = (n + chunk - 1) / chunk;
  if (n_threads_ == 1 || n_chunks <= 1) return parallel_for(n, fn, n);
  std::atomic<size_t> next{0};
  parallel_for(static_cast<size_t>(n_threads_), [&](size_t, size_t) {
    for (size_t c = next.fetch_add(1); c < n_chunks; c = next.fetch_add(1))
      fn(c * chunk, std::min(n, (c + 1) * chunk));
  });
}

}  // namespace gemstage
