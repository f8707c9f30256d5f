// y = x * W^T for F32 / BF16 / F16 weights on x86: AVX-512 (4 weight rows x 4 activation rows per
// step, 16 accumulators) and AVX2 + FMA + F16C (4 weight rows x 2 activation rows).
//
// GCC 12 reports false "uninitialized" warnings inside its own AVX-512 intrinsic headers
// (_mm512_reduce_add_ps, _mm512_cvtph_ps); they are not about this file's code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include "kernels/x86/float_matmul.h"

#include <immintrin.h>

#include <algorithm>

#include "kernels/x86/avx2_sum.h"

namespace gemstage {

namespace avx512 {
namespace {

template <DType T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_w16(const void* base,
                                                                            int64_t i,
                                                                            __mmask16 m) {
  if constexpr (T == DType::F32) {
    return _mm512_maskz_loadu_ps(m, static_cast<const float*>(base) + i);
  } else if constexpr (T == DType::BF16) {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(base) + i);
    return _mm512_cvtph_ps(h);
  }
}

template <DType T, int NX>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void block_avx512(const float* x, int64_t K,
                                                                       const void* wbase, int64_t r,
                                                                       int nw,
                                                                       float* out /*[NX][4]*/) {
  __m512 acc[NX][4];
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < 4; ++b) acc[a][b] = _mm512_setzero_ps();
  const int64_t full = K & ~int64_t{15};
  for (int64_t k = 0; k <= K; k += 16) {
    if (k == K) break;
    const __mmask16 m =
        k < full ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (K - k)) - 1u);
    __m512 wv[4];
    for (int b = 0; b < 4; ++b)
      wv[b] = b < nw ? load_w16<T>(wbase, (r + b) * K + k, m) : _mm512_setzero_ps();
    for (int a = 0; a < NX; ++a) {
      const __m512 xv = _mm512_maskz_loadu_ps(m, x + a * K + k);
      for (int b = 0; b < 4; ++b) acc[a][b] = _mm512_fmadd_ps(xv, wv[b], acc[a][b]);
    }
  }
  for (int a = 0; a < NX; ++a)
    for (int b = 0; b < 4; ++b) out[a * 4 + b] = _mm512_reduce_add_ps(acc[a][b]);
}

template <DType T>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void rows_avx512(const float* x, int64_t S,
                                                                      const WeightView& w, float* y,
                                                                      int64_t r0, int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  float out[16];
  for (int64_t r = r0; r < r1; r += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, r1 - r));
    int64_t s = 0;
    for (; s + 4 <= S; s += 4) {
      block_avx512<T, 4>(x + s * K, K, w.data, r, nw, out);
      for (int a = 0; a < 4; ++a)
        for (int b = 0; b < nw; ++b) y[(s + a) * N + r + b] = out[a * 4 + b];
    }
    for (; s < S; ++s) {
      block_avx512<T, 1>(x + s * K, K, w.data, r, nw, out);
      for (int b = 0; b < nw; ++b) y[s * N + r + b] = out[b];
    }
  }
}

}  // namespace

FloatRowsFn float_rows(DType t) {
  if (t == DType::F32) return rows_avx512<DType::F32>;
  if (t == DType::BF16) return rows_avx512<DType::BF16>;
  if (t == DType::F16) return rows_avx512<DType::F16>;
  return nullptr;
}

}  // namespace avx512

namespace avx2 {
namespace {

template <DType T>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_w8(const void* base, int64_t i) {
  if constexpr (T == DType::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  } else if constexpr (T == DType::BF16) {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    return _mm256_cvtph_ps(h);
  }
}

template <DType T>
__attribute__((target("avx2,fma,f16c"))) void rows_avx2(const float* x, int64_t S,
                                                        const WeightView& w, float* y, int64_t r0,
                                                        int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  const int64_t full = K & ~int64_t{7};
  constexpr int64_t es = T == DType::F32 ? 4 : 2;
  for (int64_t r = r0; r < r1; r += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, r1 - r));
    const char* next_group = static_cast<const char*>(w.data) + (r + 4) * K * es;
    for (int64_t s = 0; s < S; s += 2) {
      const int nx = static_cast<int>(std::min<int64_t>(2, S - s));
      __m256 acc[2][4];
      for (auto& a : acc)
        for (auto& b : a) b = _mm256_setzero_ps();
      for (int64_t k = 0; k < full; k += 8) {
        // Decode streams the rows from DRAM: while this group of 4 rows is read, the next
        // group's bytes are prefetched into L2 at the same pace (4 * 8 elements per step). The
        // summation order stays the prefill tile's, so a decoded token's outputs are
        // bit-identical to the same row recomputed in a prefill. Prefetches never fault.
        if (S == 1)
          for (int64_t o = 0; o < 32 * es; o += 64)
            _mm_prefetch(next_group + 4 * k * es + o, _MM_HINT_T2);
        __m256 wv[4];
        for (int b = 0; b < 4; ++b)
          wv[b] = b < nw ? load_w8<T>(w.data, (r + b) * K + k) : _mm256_setzero_ps();
        for (int a = 0; a < nx; ++a) {
          const __m256 xv = _mm256_loadu_ps(x + (s + a) * K + k);
          for (int b = 0; b < 4; ++b) acc[a][b] = _mm256_fmadd_ps(xv, wv[b], acc[a][b]);
        }
      }
      for (int a = 0; a < nx; ++a)
        for (int b = 0; b < nw; ++b) {
          float v = x86::hsum_hadd(acc[a][b]);
          for (int64_t k = full; k < K; ++k)
            v += x[(s + a) * K + k] * widen_weight(w.data, T, (r + b) * K + k);
          y[(s + a) * N + r + b] = v;
        }
    }
  }
}

}  // namespace

FloatRowsFn float_rows(DType t) {
  if (t == DType::F32) return rows_avx2<DType::F32>;
  if (t == DType::BF16) return rows_avx2<DType::BF16>;
  if (t == DType::F16) return rows_avx2<DType::F16>;
  return nullptr;
}

}  // namespace avx2

}  // namespace gemstage
