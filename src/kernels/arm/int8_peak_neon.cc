// The aarch64 loops of the int8 peak probe (kernels/int8_peak.h).
#include <arm_neon.h>

#include <cstdint>

#include "kernels/int8_peak.h"

namespace gemstage::peak_loops {

namespace {
constexpr int kChains = 12;  // covers SDOT's 3-4 cycle latency at up to 4 issues a cycle
}

__attribute__((target("arch=armv8.2-a+dotprod"))) uint64_t neon_sdot(int64_t iters, int seed) {
  int8x16_t a = vdupq_n_s8(static_cast<int8_t>(seed));
  const int8x16_t b = vdupq_n_s8(static_cast<int8_t>(seed + 1));
  int32x4_t acc[kChains];
  for (auto& x : acc) x = vdupq_n_s32(0);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = vdotq_s32(acc[c], a, b);
    __asm__ volatile("" : "+w"(a));  // opaque, so no product is hoisted out of the loop
  }
  int32x4_t s = acc[0];
  for (int c = 1; c < kChains; ++c) s = vaddq_s32(s, acc[c]);
  volatile int32_t sink = vaddvq_s32(s);
  (void)sink;
  return static_cast<uint64_t>(iters) * kChains * 16;
}

uint64_t neon_smull(int64_t iters, int seed) {
  int8x16_t a = vdupq_n_s8(static_cast<int8_t>(seed));
  const int8x16_t b = vdupq_n_s8(static_cast<int8_t>(seed + 1));
  int32x4_t acc[kChains];
  for (auto& x : acc) x = vdupq_n_s32(0);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; c += 2) {
      acc[c] = vpadalq_s16(acc[c], vmull_s8(vget_low_s8(a), vget_low_s8(b)));
      acc[c + 1] = vpadalq_s16(acc[c + 1], vmull_high_s8(a, b));
    }
    __asm__ volatile("" : "+w"(a));  // opaque, so no product is hoisted out of the loop
  }
  int32x4_t s = acc[0];
  for (int c = 1; c < kChains; ++c) s = vaddq_s32(s, acc[c]);
  volatile int32_t sink = vaddvq_s32(s);
  (void)sink;
  return static_cast<uint64_t>(iters) * kChains * 8;
}

// SMMLA multiplies a 2x8 by an 8x2 int8 block into a 2x2 int32 tile: 32 multiply-adds.
__attribute__((target("arch=armv8.2-a+i8mm"))) uint64_t neon_smmla(int64_t iters, int seed) {
  int8x16_t a = vdupq_n_s8(static_cast<int8_t>(seed));
  const int8x16_t b = vdupq_n_s8(static_cast<int8_t>(seed + 1));
  int32x4_t acc[kChains];
  for (auto& x : acc) x = vdupq_n_s32(0);
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = vmmlaq_s32(acc[c], a, b);
    __asm__ volatile("" : "+w"(a));  // opaque, so no product is hoisted out of the loop
  }
  int32x4_t s = acc[0];
  for (int c = 1; c < kChains; ++c) s = vaddq_s32(s, acc[c]);
  volatile int32_t sink = vaddvq_s32(s);
  (void)sink;
  return static_cast<uint64_t>(iters) * kChains * 32;
}

}  // namespace gemstage::peak_loops
