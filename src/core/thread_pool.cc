#include "core/thread_pool.h"

#include <algorithm>

namespace gemstage {

namespace {
void run_share(const std::function<void(size_t, size_t)>& fn, size_t n, size_t grain, int index,
               int parts) {
  const size_t blocks = (n + grain - 1) / grain;
  const size_t b0 = blocks * static_cast<size_t>(index) / static_cast<size_t>(parts);
  const size_t b1 = blocks * static_cast<size_t>(index + 1) / static_cast<size_t>(parts);
  const size_t begin = std::min(n, b0 * grain), end = std::min(n, b1 * grain);
  if (begin < end) fn(begin, end);
}
}  // namespace

int default_thread_count() {
  const unsigned h = std::thread::hardware_concurrency();
  return h == 0 ? 1 : static_cast<int>(h);
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) workers_.emplace_back([this, i] { worker_loop(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::worker_loop(int index) {
  unsigned seen = 0;
  for (;;) {
    const std::function<void(size_t, size_t)>* job;
    size_t n, grain;
    {
      std::unique_lock<std::mutex> lock(mu_);
      start_cv_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      job = job_;
      n = job_n_;
      grain = job_grain_;
    }
    run_share(*job, n, grain, index, n_threads_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--pending_ == 0) done_cv_.notify_one();
    }
  }
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn,
                              size_t grain) {
  if (n == 0) return;
  grain = std::max<size_t>(1, grain);
  if (n_threads_ == 1 || n <= grain) {
    fn(0, n);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    job_ = &fn;
    job_n_ = n;
    job_grain_ = grain;
    pending_ = n_threads_ - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  run_share(fn, n, grain, 0, n_threads_);
  std::unique_lock<std::mutex> lock(mu_);
  done_cv_.wait(lock, [&] { return pending_ == 0; });
}

}  // namespace gemstage
