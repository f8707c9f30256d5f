// Helpers shared by the subcommands: thread pool sizing, timing, argmax, warnings.
#pragma once

#include <chrono>
#include <cstdint>
#include <iostream>
#include <string>
#include <vector>

#include "gemma4/model.h"

namespace gemstage::cli {

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// First index of the maximum (greedy decoding takes the first index on ties).
inline int64_t argmax_first(const float* v, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

inline void print_model_notes(const std::vector<std::string>& notes, bool verbose) {
  if (notes.empty()) return;
  if (verbose) {
    for (const auto& n : notes) std::cerr << "note: " << n << "\n";
  } else {
    std::cerr << "note: " << notes.size()
              << " config field(s) / tensor(s) not used by gemstage (--verbose lists them)\n";
  }
}

}  // namespace gemstage::cli
