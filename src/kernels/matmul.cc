#include "kernels/matmul.h"

#include "kernels/weight_rows.h"

#if defined(__x86_64__) || defined(__i386__)
// GCC 12 reports false "uninitialized" warnings inside its own AVX-512 intrinsic headers
// (_mm512_reduce_add_ps, _mm512_cvtph_ps); they are not about this file's code.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif
#if defined(__aarch64__)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"
#include "kernels/cpu_features.h"
#include "kernels/quant.h"

namespace gemstage {

namespace {

// Scalar widening of one weight element; the portable path's inner loop.
inline float widen(const void* base, DType t, int64_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(base)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
    case DType::F16:
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      return 0.0f;
  }
}

void rows_scalar(const float* x, int64_t S, const WeightView& w, float* y, int64_t r0, int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < K; ++k) row[static_cast<size_t>(k)] = widen(w.data, w.dtype, r * K + k);
    for (int64_t s = 0; s < S; ++s) {
      const float* xs = x + s * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += xs[k] * row[static_cast<size_t>(k)];
      y[s * N + r] = acc;
    }
  }
}

#if defined(__x86_64__) || defined(__i386__)
// ---- AVX-512: 4 weight rows x 4 activation rows per step, 16 accumulators ----------------------

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

// ---- AVX2 + FMA + F16C: 4 weight rows x 2 activation rows
// ----------------------------------------

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

__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_hadd_ps(lo, lo);
  lo = _mm_hadd_ps(lo, lo);
  return _mm_cvtss_f32(lo);
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
          float v = hsum256(acc[a][b]);
          for (int64_t k = full; k < K; ++k)
            v += x[(s + a) * K + k] * widen(w.data, T, (r + b) * K + k);
          y[(s + a) * N + r + b] = v;
        }
    }
  }
}

#endif  // x86

#if defined(__aarch64__)
// ---- NEON: 4 weight rows x 2 activation rows per step, as the AVX2 tile -----------------------

template <DType T>
inline float32x4_t load_w4(const void* base, int64_t i) {
  if constexpr (T == DType::F32) {
    return vld1q_f32(static_cast<const float*>(base) + i);
  } else if constexpr (T == DType::BF16) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(static_cast<const uint16_t*>(base) + i), 16));
  } else {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(static_cast<const uint16_t*>(base) + i)));
  }
}

template <DType T>
void rows_neon(const float* x, int64_t S, const WeightView& w, float* y, int64_t r0, int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  const int64_t full = K & ~int64_t{3};
  for (int64_t r = r0; r < r1; r += 4) {
    const int nw = static_cast<int>(std::min<int64_t>(4, r1 - r));
    for (int64_t s = 0; s < S; s += 2) {
      const int nx = static_cast<int>(std::min<int64_t>(2, S - s));
      float32x4_t acc[2][4];
      for (auto& a : acc)
        for (auto& b : a) b = vdupq_n_f32(0);
      for (int64_t k = 0; k < full; k += 4) {
        float32x4_t wv[4];
        for (int b = 0; b < 4; ++b)
          wv[b] = b < nw ? load_w4<T>(w.data, (r + b) * K + k) : vdupq_n_f32(0);
        for (int a = 0; a < nx; ++a) {
          const float32x4_t xv = vld1q_f32(x + (s + a) * K + k);
          for (int b = 0; b < 4; ++b) acc[a][b] = vfmaq_f32(acc[a][b], xv, wv[b]);
        }
      }
      for (int a = 0; a < nx; ++a)
        for (int b = 0; b < nw; ++b) {
          float v = vaddvq_f32(acc[a][b]);
          for (int64_t k = full; k < K; ++k)
            v += x[(s + a) * K + k] * widen(w.data, T, (r + b) * K + k);
          y[(s + a) * N + r + b] = v;
        }
    }
  }
}

#endif  // aarch64

using RowsFn = void (*)(const float*, int64_t, const WeightView&, float*, int64_t, int64_t);

RowsFn pick([[maybe_unused]] DType t) {
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_tier_at_least(CpuTier::Avx512)) {
    if (t == DType::F32) return rows_avx512<DType::F32>;
    if (t == DType::BF16) return rows_avx512<DType::BF16>;
    if (t == DType::F16) return rows_avx512<DType::F16>;
  } else if (cpu_tier_at_least(CpuTier::Avx2)) {
    if (t == DType::F32) return rows_avx2<DType::F32>;
    if (t == DType::BF16) return rows_avx2<DType::BF16>;
    if (t == DType::F16) return rows_avx2<DType::F16>;
  }
#endif
#if defined(__aarch64__)
  if (cpu_tier() == CpuTier::Neon) {
    if (t == DType::F32) return rows_neon<DType::F32>;
    if (t == DType::BF16) return rows_neon<DType::BF16>;
    if (t == DType::F16) return rows_neon<DType::F16>;
  }
#endif
  return rows_scalar;
}

}  // namespace

const char* matmul_isa() {
  if (cpu_tier_at_least(CpuTier::Avx512)) return "avx512";
  if (cpu_tier_at_least(CpuTier::Avx2)) return "avx2";
  if (cpu_tier() == CpuTier::Neon) return "neon";
  return "scalar";
}

void matmul(ThreadPool& pool, const float* x, int64_t S, const WeightView& w, float* y) {
  if (w.shape.size() != 2)
    fail("matmul: weight ", w.name, " is not a matrix: ", shape_str(w.shape));
  if (dtype_is_quantized(w.dtype)) {
    quant_matmul(pool, x, S, w, y);
    return;
  }
  if (w.dtype != DType::F32 && w.dtype != DType::BF16 && w.dtype != DType::F16)
    fail("matmul: weight ", w.name, " has dtype ", dtype_name(w.dtype), " with no kernel");
  const RowsFn fn = pick(w.dtype);
  const int64_t N = w.rows();
  // Rows are split across threads in groups of 16 so every worker streams whole cache lines.
  pool.parallel_for(
      static_cast<size_t>(N),
      [&](size_t b, size_t e) { fn(x, S, w, y, static_cast<int64_t>(b), static_cast<int64_t>(e)); },
      16);
}

void matmul_many(ThreadPool& pool, const float* x, int64_t S,
                 std::initializer_list<MatmulTarget> targets) {
  std::vector<QuantTarget> quantized;
  // The scalar tier keeps one call per matrix, the path the reference-checking tests pin down.
  bool together = cpu_tier() != CpuTier::Scalar;
  for (const MatmulTarget& t : targets) {
    together = together && t.w.shape.size() == 2 && dtype_is_quantized(t.w.dtype) &&
               t.w.dtype == targets.begin()->w.dtype && t.w.cols() == targets.begin()->w.cols();
    quantized.push_back({&t.w, t.y});
  }
  if (together) return quant_matmul_many(pool, x, S, quantized);
  for (const MatmulTarget& t : targets) matmul(pool, x, S, t.w, t.y);
}

void matmul_reference(const float* x, int64_t S, const WeightView& w, float* y) {
  const int64_t K = w.cols(), N = w.rows();
  if (dtype_is_quantized(w.dtype)) {  // dequantize each row, then the same double dot
    std::vector<float> row(static_cast<size_t>(K));
    for (int64_t r = 0; r < N; ++r) {
      weight_row_to_f32(w, r, row.data());
      for (int64_t s = 0; s < S; ++s) {
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k)
          acc += static_cast<double>(x[s * K + k]) * row[static_cast<size_t>(k)];
        y[s * N + r] = static_cast<float>(acc);
      }
    }
    return;
  }
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < N; ++r) {
      double acc = 0.0;
      for (int64_t k = 0; k < K; ++k)
        acc += static_cast<double>(x[s * K + k]) * widen(w.data, w.dtype, r * K + k);
      y[s * N + r] = static_cast<float>(acc);
    }
}

}  // namespace gemstage
