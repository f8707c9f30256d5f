#include "hub/transfer_progress.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

namespace gemstage::hub {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string clock_text(double seconds) {
  if (!(seconds >= 0) || seconds > 359999) return "--:--";
  const auto s = static_cast<long>(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ld:%02ld:%02ld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(buf, sizeof buf, "%ld:%02ld", s / 60, s % 60);
  return buf;
}

}  // namespace

std::string human_bytes(uint64_t n) {
  char buf[32];
  const double v = static_cast<double>(n);
  if (n >= 1000000000ULL)
    std::snprintf(buf, sizeof buf, "%.2f GB", v / 1e9);
  else if (n >= 1000000ULL)
    std::snprintf(buf, sizeof buf, "%.1f MB", v / 1e6);
  else if (n >= 1000ULL)
    std::snprintf(buf, sizeof buf, "%.1f kB", v / 1e3);
  else
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(n));
  return buf;
}

TransferProgress::TransferProgress(std::string label, uint64_t total, bool enabled)
    : label_(std::move(label)),
      total_(total),
      start_(now()),
      enabled_(enabled),
      tty_(isatty(2) != 0) {}

TransferProgress::~TransferProgress() {
  finish();
}

void TransferProgress::resumed(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ += n;
  resumed_ += n;
}

void TransferProgress::add(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ += n;
  draw_locked(false);
}

void TransferProgress::rewind(uint64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  done_ -= std::min(done_, n);
  resumed_ -= std::min(resumed_, n);
}

void TransferProgress::finish() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  draw_locked(true);
  if (enabled_ && tty_) std::fputc('\n', stderr);
}

void TransferProgress::draw_locked(bool force) {
  if (!enabled_) return;
  const double t = now();
  // A terminal redraws in place five times a second; a log gets a line every ten seconds.
  if (!force && t - last_draw_ < (tty_ ? 0.2 : 10.0)) return;
  last_draw_ = t;
  const double frac =
      total_ ? static_cast<double>(std::min(done_, total_)) / static_cast<double>(total_) : 1.0;
  constexpr int kWidth = 24;
  char bar[kWidth + 1];
  const int fill = static_cast<int>(frac * kWidth);
  for (int i = 0; i < kWidth; ++i) bar[i] = i < fill ? '#' : '.';
  bar[kWidth] = '\0';
  const double elapsed = t - start_;
  const double fresh = static_cast<double>(done_ - std::min(done_, resumed_));
  const double rate = elapsed > 0.05 ? fresh / elapsed : 0;
  const double left = static_cast<double>(total_ - std::min(done_, total_));
  const std::string eta = rate > 0 ? clock_text(left / rate) : "--:--";
  std::fprintf(stderr, "%s%s [%s] %5.1f%% %s/%s %s/s ETA %s%s", tty_ ? "\r" : "", label_.c_str(),
               bar, frac * 100, human_bytes(done_).c_str(), human_bytes(total_).c_str(),
               human_bytes(static_cast<uint64_t>(rate)).c_str(), eta.c_str(),
               tty_ ? "\033[K" : "\n");
  std::fflush(stderr);
}

}  // namespace gemstage::hub
