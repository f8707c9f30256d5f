// The x86 loops of the int8 peak probe (kernels/int8_peak.h).
#include <immintrin.h>

#include <cstdint>

#include "kernels/int8_peak.h"

namespace gemstage::peak_loops {

namespace {

// Twelve chains cover VPDPBUSD's latency (4-5 cycles) at two issues a cycle, and the three-op
// VPMADDUBSW -> VPMADDWD -> VPADDD chain at its issue rate; both fit in 16 ymm / 32 zmm registers.
constexpr int kChains = 12;

}  // namespace

__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) uint64_t vnni_zmm(int64_t iters,
                                                                                  int seed) {
  __m512i a = _mm512_set1_epi32(seed * 0x01010101);
  const __m512i b = _mm512_set1_epi32((seed + 1) * 0x01010101);
  __m512i acc[kChains];
  for (auto& x : acc) x = _mm512_setzero_si512();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
    // An operand the compiler cannot see through, so no product is hoisted out of the loop.
    __asm__ volatile("" : "+v"(a));
  }
  __m512i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm512_add_epi32(s, acc[c]);
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, s);
  // Unsigned: the lanes wrapped long ago (they are only kept live, never read for a value).
  volatile uint32_t sink = static_cast<uint32_t>(lanes[0]) + static_cast<uint32_t>(lanes[15]);
  (void)sink;
  return static_cast<uint64_t>(iters) * kChains * 64;
}

__attribute__((target("avx2,fma"))) uint64_t maddubs_ymm(int64_t iters, int seed) {
  __m256i a = _mm256_set1_epi8(static_cast<char>(seed));
  const __m256i b = _mm256_set1_epi8(static_cast<char>(seed + 1));
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[kChains];
  for (auto& x : acc) x = _mm256_setzero_si256();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 12
    for (int c = 0; c < kChains; ++c)
      acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
    // An operand the compiler cannot see through, so no product is hoisted out of the loop.
    __asm__ volatile("" : "+x"(a));
  }
  __m256i s = acc[0];
  for (int c = 1; c < kChains; ++c) s = _mm256_add_epi32(s, acc[c]);
  volatile int sink = _mm256_extract_epi32(s, 0);
  (void)sink;
  return static_cast<uint64_t>(iters) * kChains * 32;
}

namespace {

struct alignas(64) PeakTileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace

// Four 16 x 16 f32 accumulator tiles from two A and two B tiles, as amx.cc's 2 x 2 tile block.
__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16"))) uint64_t amx_bf16(
    int64_t iters, int seed) {
  alignas(64) uint16_t operand[16 * 32];
  for (int i = 0; i < 16 * 32; ++i) operand[i] = static_cast<uint16_t>(0x3f80 + (seed & 7));
  PeakTileConfig cfg;
  for (int i = 0; i < 8; ++i) {
    cfg.rows[i] = 16;
    cfg.colsb[i] = 64;
  }
  _tile_loadconfig(&cfg);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (int64_t i = 0; i < iters; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  alignas(64) float out[16 * 16];
  _tile_stored(0, out, 64);
  _tile_release();
  volatile float sink = out[0];
  (void)sink;
  return static_cast<uint64_t>(iters) * 4 * 16 * 16 * 32;
}

}  // namespace gemstage::peak_loops
