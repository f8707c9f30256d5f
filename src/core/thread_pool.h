// One pool, created once per process by the CLI or server and passed down by reference.
// parallel_for splits [0, n) into contiguous ranges, one per worker, and runs them to completion.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace gemstage {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // fn(begin, end) over disjoint ranges covering [0, n). Ranges are aligned to `grain`.
  void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn, size_t grain = 1);

 private:
  void worker_loop(int index);

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  const std::function<void(size_t, size_t)>* job_ = nullptr;
  size_t job_n_ = 0, job_grain_ = 1;
  unsigned generation_ = 0;
  int pending_ = 0;
  bool stop_ = false;
};

// A sensible default thread count: the hardware's, at least 1.
int default_thread_count();

}  // namespace gemstage
