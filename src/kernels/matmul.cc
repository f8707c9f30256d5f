#include "kernels/matmul.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/cpu_features.h"
#include "core/error.h"
#include "kernels/arm/float_matmul.h"
#include "kernels/float_rows.h"
#include "kernels/quant.h"
#include "kernels/weight_rows.h"
#include "kernels/x86/float_matmul.h"

namespace gemstage {

namespace {

void rows_scalar(const float* x, int64_t S, const WeightView& w, float* y, int64_t r0, int64_t r1) {
  const int64_t K = w.cols(), N = w.rows();
  std::vector<float> row(static_cast<size_t>(K));
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t k = 0; k < K; ++k)
      row[static_cast<size_t>(k)] = widen_weight(w.data, w.dtype, r * K + k);
    for (int64_t s = 0; s < S; ++s) {
      const float* xs = x + s * K;
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += xs[k] * row[static_cast<size_t>(k)];
      y[s * N + r] = acc;
    }
  }
}

FloatRowsFn pick([[maybe_unused]] CpuTier tier, [[maybe_unused]] DType t) {
  FloatRowsFn fn = nullptr;
#if defined(__x86_64__) || defined(__i386__)
  if (cpu_tier_at_least(tier, CpuTier::Avx512))
    fn = avx512::float_rows(t);
  else if (cpu_tier_at_least(tier, CpuTier::Avx2))
    fn = avx2::float_rows(t);
#endif
#if defined(__aarch64__)
  if (cpu_tier_is_arm(tier)) fn = neon::float_rows(t);
#endif
  return fn ? fn : rows_scalar;
}

}  // namespace

const char* matmul_isa(CpuTier tier) {
  if (cpu_tier_at_least(tier, CpuTier::Avx512)) return "avx512";
  if (cpu_tier_at_least(tier, CpuTier::Avx2)) return "avx2";
  if (cpu_tier_is_arm(tier)) return "neon";
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
  const FloatRowsFn fn = pick(pool.tier(), w.dtype);
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
  bool together = pool.tier() != CpuTier::Scalar;
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
        acc += static_cast<double>(x[s * K + k]) * widen_weight(w.data, w.dtype, r * K + k);
      y[s * N + r] = static_cast<float>(acc);
    }
}

}  // namespace gemstage
