// One progress line on stderr for a model's downloads, shared by the threads that fetch its files:
// bytes done of the total, the rate over this run's bytes and the time left at that rate.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

namespace gemstage::hub {

class TransferProgress {
 public:
  // total: every byte the model's missing files hold; enabled false draws nothing.
  TransferProgress(std::string label, uint64_t total, bool enabled);
  ~TransferProgress();
  TransferProgress(const TransferProgress&) = delete;
  TransferProgress& operator=(const TransferProgress&) = delete;

  // Bytes already on disk from an earlier run (they count as done, not towards the rate).
  void resumed(uint64_t n);
  void add(uint64_t n);
  // A restarted file gives back what it had counted.
  void rewind(uint64_t n);
  void finish();

 private:
  void draw_locked(bool force);

  std::mutex mu_;
  std::string label_;
  uint64_t total_, done_ = 0, resumed_ = 0;
  double start_, last_draw_ = 0;
  bool enabled_, tty_, finished_ = false;
};

// "1.23 GB", "45.6 MB", "789 B": sizes in the decimal units the Hub shows.
std::string human_bytes(uint64_t n);

}  // namespace gemstage::hub
