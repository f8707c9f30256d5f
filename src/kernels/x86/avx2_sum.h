// The horizontal sum of an 8-float vector that the AVX2 matmul rows use (x86/quant_avx2.cc,
// x86/float_matmul.cc); x86 only, internal to the kernels library. One definition, because the
// order of its additions is part of the outputs: the quantized GEMV and prefill tile both end in
// it, which keeps a decoded token's outputs bit-identical to the same row recomputed in a prefill.
#pragma once

#include <immintrin.h>

namespace gemstage::x86 {

// ((v0 + v4) + (v1 + v5)) + ((v2 + v6) + (v3 + v7)): the halves added, then two pairwise
// horizontal adds.
__attribute__((target("avx2"))) inline float hsum_hadd(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
}

// hsum_hadd of eight vectors at once, lane i = hsum_hadd(v[i]) bit for bit: the same additions in
// the same order (halves added, then two pairwise horizontal adds), on four vectors at a time
// instead of one, for a tile's outputs (x86/quant_avx2.cc).
__attribute__((target("avx2"))) inline __m256 hsum_hadd_8(const __m256* v) {
  __m256 h[4];  // 128-bit lane 0: the halves of v[2p] added; lane 1: those of v[2p + 1]
  for (int p = 0; p < 4; ++p)
    h[p] = _mm256_add_ps(_mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x20),
                         _mm256_permute2f128_ps(v[2 * p], v[2 * p + 1], 0x31));
  // Lane 0 holds the sums of v[0], v[2], v[4], v[6]; lane 1 those of v[1], v[3], v[5], v[7].
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
  return _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

}  // namespace gemstage::x86
