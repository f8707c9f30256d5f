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

}  // namespace gemstage::x86
