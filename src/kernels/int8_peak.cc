#include "kernels/int8_peak.h"

#include <algorithm>
#include <chrono>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/quant.h"

namespace gemstage {

namespace peak_loops {

uint64_t scalar(int64_t iters, int seed) {
  // Eight independent 32-bit chains of int8 products, as the scalar GEMM's inner loop; unsigned,
  // so a long run wraps instead of overflowing (the sums are only kept live).
  constexpr int kChains = 8;
  uint32_t acc[kChains];
  int8_t a[kChains], b[kChains];
  for (int c = 0; c < kChains; ++c) {
    acc[c] = 0;
    a[c] = static_cast<int8_t>(seed + c);
    b[c] = static_cast<int8_t>(seed - c);
  }
  for (int64_t i = 0; i < iters; ++i)
    for (int c = 0; c < kChains; ++c)
      acc[c] += static_cast<uint32_t>(a[c] * b[c] + static_cast<int32_t>(i & 1));
  volatile uint32_t sink = 0;
  for (uint32_t x : acc) sink = sink + x;
  return static_cast<uint64_t>(iters) * kChains;
}

#if !(defined(__x86_64__) || defined(__i386__))
uint64_t vnni_zmm(int64_t, int) {
  return 0;
}
uint64_t maddubs_ymm(int64_t, int) {
  return 0;
}
uint64_t amx_bf16(int64_t, int) {
  return 0;
}
#endif
#if !(defined(__aarch64__) || defined(_M_ARM64))
uint64_t neon_sdot(int64_t, int) {
  return 0;
}
uint64_t neon_smull(int64_t, int) {
  return 0;
}
uint64_t neon_smmla(int64_t, int) {
  return 0;
}
#endif

}  // namespace peak_loops

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

Int8Peak probe_int8_peak(ThreadPool& pool, int64_t rows, double seconds) {
  const std::string_view isa = quant_isa(pool.tier(), rows);
  Int8Peak peak;
  uint64_t (*loop)(int64_t, int) = peak_loops::scalar;
  peak.instruction = "int32 multiply-add (scalar)";
  if (isa == "avx512vnni") {
    loop = peak_loops::vnni_zmm;
    peak.instruction = "VPDPBUSD zmm";
  } else if (isa == "avx2") {
    loop = peak_loops::maddubs_ymm;
    peak.instruction = "VPMADDUBSW + VPMADDWD ymm";
  } else if (isa == "amx-bf16") {
    loop = peak_loops::amx_bf16;
    peak.instruction = "TDPBF16PS";
  } else if (isa == "neon-i8mm") {
    loop = peak_loops::neon_smmla;
    peak.instruction = "SMMLA";
  } else if (isa == "neon-dotprod") {
    loop = peak_loops::neon_sdot;
    peak.instruction = "SDOT";
  } else if (isa == "neon") {
    loop = peak_loops::neon_smull;
    peak.instruction = "SMULL + SADALP";
  }
  const size_t n = static_cast<size_t>(pool.size());
  // Every thread runs the same iteration count; the wall time of the slowest bounds the pass.
  auto pass = [&](int64_t iters) {
    std::vector<uint64_t> macs(n, 0);
    const double t0 = seconds_now();
    pool.parallel_for(n, [&](size_t b, size_t e) {
      for (size_t i = b; i < e; ++i) macs[i] = loop(iters, static_cast<int>(i) + 3);
    });
    const double dt = seconds_now() - t0;
    uint64_t total = 0;
    for (uint64_t m : macs) total += m;
    return std::pair{static_cast<double>(total), dt};
  };
  // Calibrate: grow the pass until it would take a few milliseconds at the fastest rate seen,
  // then size it to a third of `seconds`. A pass that was preempted (another process on the
  // core) only looks slow, so the fastest rate decides, never one slow pass: sized on a
  // preempted few-microsecond pass, the measured passes would be as short and as noisy.
  int64_t iters = 1024;
  double best_rate = 0;  // iterations per second
  for (;;) {
    const auto [m, t] = pass(iters);
    (void)m;
    best_rate = std::max(best_rate, static_cast<double>(iters) / std::max(t, 1e-9));
    if (static_cast<double>(iters) / best_rate >= 5e-3 || iters >= (int64_t{1} << 40)) break;
    iters *= 4;
  }
  iters = std::max<int64_t>(iters, static_cast<int64_t>(best_rate * seconds / 3));
  double macs = 0, dt = 0;
  for (int rep = 0; rep < 3; ++rep) {
    std::tie(macs, dt) = pass(iters);
    peak.gmacs = std::max(peak.gmacs, macs / std::max(dt, 1e-9) / 1e9);
  }
  return peak;
}

}  // namespace gemstage
