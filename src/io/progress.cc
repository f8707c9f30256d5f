#include "io/progress.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>

namespace gemstage {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

Progress::Progress(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)), total_(total), start_(now()), enabled_(enabled) {}

Progress::~Progress() {
  finish();
}

void Progress::advance(uint64_t n) {
  done_ += n;
  draw(false);
}

void Progress::finish() {
  if (finished_) return;
  finished_ = true;
  draw(true);
  if (enabled_) std::fputc('\n', stderr);
}

void Progress::draw(bool force) {
  if (!enabled_) return;
  const double t = now();
  if (!force && t - last_draw_ < 0.2) return;
  last_draw_ = t;
  const double frac = total_ ? static_cast<double>(done_) / static_cast<double>(total_) : 1.0;
  const int width = 30, fill = static_cast<int>(frac * width);
  char bar[width + 1];
  for (int i = 0; i < width; ++i) bar[i] = i < fill ? '#' : '.';
  bar[width] = '\0';
  const double gb = 1e-9;
  const double rate = (t - start_) > 0 ? static_cast<double>(done_) * gb / (t - start_) : 0;
  // '\r' redraws in place on a terminal; in a log each update is its own line, so draw less.
  std::fprintf(stderr, "%s%s [%s] %5.1f%% %.2f/%.2f GB %.2f GB/s", isatty(2) ? "\r" : "",
               label_.c_str(), bar, frac * 100, static_cast<double>(done_) * gb,
               static_cast<double>(total_) * gb, rate);
  if (!isatty(2)) std::fputc('\n', stderr);
  if (!isatty(2)) last_draw_ = t + 4.8;  // at most one line every ~5 s in logs
  std::fflush(stderr);
}

}  // namespace gemstage
