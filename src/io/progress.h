// A one-line progress bar on stderr for long work (export, quantize, make-random, load).
#pragma once

#include <cstdint>
#include <string>

namespace gemstage {

class Progress {
 public:
  Progress(std::string label, uint64_t total, bool enabled = true);
  ~Progress();
  void advance(uint64_t n);
  void finish();

 private:
  void draw(bool force);
  std::string label_;
  uint64_t total_, done_ = 0;
  double start_, last_draw_ = 0;
  bool enabled_, finished_ = false;
};

}  // namespace gemstage
