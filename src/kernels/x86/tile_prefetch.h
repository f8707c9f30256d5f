// The next key block's rows that an attention score tile prefetches (x86/vec_avx512.cc,
// x86/vec_avx2.cc); x86 only, internal to the kernels library.
//
// A tile of kKeys keys asks for keys j0 .. j0 + kKeys - 1 of the next block, K and V, one 64-byte
// line of each whenever its read offset crosses a line. Issued as one burst per block, a block's
// prefetches fill the core's miss buffers and stall it: one core then read a cache streaming
// from DRAM at 9 GB/s (it streams 28 GB/s alone); spread over the tiles, 12.
#pragma once

#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>

namespace gemstage::x86 {

template <int kKeys>
struct TilePrefetch {
  const char* k[kKeys];
  const char* v[kKeys];
  bool on = false;

  // next_n = 0: nothing to prefetch (the tile only re-touches its own rows).
  template <typename T>
  TilePrefetch(const T* const* next_k, const T* const* next_v, int64_t next_n, int64_t j0,
               const T* const* current, int64_t nk) {
    on = next_n > j0;
    for (int i = 0; i < kKeys; ++i) {
      const bool ahead = j0 + i < next_n;  // else re-touch a row this tile reads anyway
      const T* mine = current[std::min<int64_t>(j0 + i, nk - 1)];
      k[i] = reinterpret_cast<const char*>(ahead ? next_k[j0 + i] : mine);
      v[i] = reinterpret_cast<const char*>(ahead ? next_v[j0 + i] : mine);
    }
  }
  void line(int64_t byte_offset) const {
    if (!on || byte_offset % 64 != 0) return;
    for (int i = 0; i < kKeys; ++i) {
      _mm_prefetch(k[i] + byte_offset, _MM_HINT_T0);
      _mm_prefetch(v[i] + byte_offset, _MM_HINT_T0);
    }
  }
};

}  // namespace gemstage::x86
