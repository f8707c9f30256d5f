// Every kernel against a plain reference on odd sizes (tails, unaligned rows).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>

#include "core/cpu_features.h"
#include "core/dtype.h"
#include "core/thread_pool.h"
#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kernels/quant.h"

using namespace gemstage;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Stored {
  std::vector<uint8_t> bytes;
  WeightView view;
};

Stored store_as(const std::vector<float>& f, int64_t rows, int64_t cols, DType t) {
  Stored s;
  const size_t es = dtype_size(t);
  s.bytes.resize(f.size() * es);
  for (size_t i = 0; i < f.size(); ++i) {
    if (t == DType::F32) std::memcpy(&s.bytes[i * 4], &f[i], 4);
    if (t == DType::BF16) {
      const uint16_t h = f32_to_bf16(f[i]);
      std::memcpy(&s.bytes[i * 2], &h, 2);
    }
    if (t == DType::F16) {
      const uint16_t h = f32_to_f16(f[i]);
      std::memcpy(&s.bytes[i * 2], &h, 2);
    }
  }
  s.view = WeightView{"w", t, {rows, cols}, s.bytes.data(), s.bytes.size()};
  return s;
}

class MatmulOdd : public ::testing::TestWithParam<std::tuple<DType, int, int, int>> {};

TEST_P(MatmulOdd, MatchesReferenceSimdAndScalar) {
  const auto [t, S, K, N] = GetParam();
  const auto x = randn(static_cast<size_t>(S * K), 1);
  const auto wf = randn(static_cast<size_t>(N * K), 2, 0.1f);
  const Stored w = store_as(wf, N, K, t);
  std::vector<float> ref(static_cast<size_t>(S * N)), got(ref.size());
  matmul_reference(x.data(), S, w.view, ref.data());
  const double tol = 1e-5 * std::sqrt(static_cast<double>(K)) * 4;
  // Every tier this CPU supports (an AVX-512 machine still runs the AVX2 rows), scalar included.
  for (CpuTier tier : cpu_supported_tiers()) {
    ThreadPool pool(2, tier);
    matmul(pool, x.data(), S, w.view, got.data());
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_NEAR(got[i], ref[i], tol)
          << cpu_tier_name(tier) << " (" << matmul_isa(tier) << ") at " << i;
    // Each row alone (the decode GEMV) equals its row of the batch bit for bit: the decoder's
    // incremental-equals-recompute tests rely on it.
    std::vector<float> one(static_cast<size_t>(N));
    for (int64_t s = 0; s < S; ++s) {
      matmul(pool, x.data() + s * K, 1, w.view, one.data());
      for (int64_t r = 0; r < N; ++r)
        ASSERT_EQ(one[static_cast<size_t>(r)], got[static_cast<size_t>(s * N + r)])
            << cpu_tier_name(tier) << " row " << s << " output " << r;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, MatmulOdd,
                         ::testing::Combine(::testing::Values(DType::F32, DType::BF16, DType::F16),
                                            ::testing::Values(1, 3, 5, 9),
                                            ::testing::Values(1, 7, 16, 37, 45, 131),
                                            ::testing::Values(1, 5, 13, 33)));

TEST(Dtype, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  // 1 + 2^-8 is exactly half-way between bf16 1.0 and 1.0078125: ties to even (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(round_to_bf16(std::sqrt(1536.0f)), 39.25f);  // spec: E2B embed scale in bf16
  EXPECT_EQ(round_to_bf16(std::sqrt(2560.0f)), 50.5f);   // E4B
}

TEST(Dtype, F16RoundTripsRepresentableValues) {
  for (float v :
       {0.0f, 1.0f, -2.5f, 65504.0f, 6.103515625e-05f, 5.960464477539063e-08f, 0.333251953125f})
    EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v) << v;
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

TEST(RmsNorm, MatchesDoubleReferenceWithAndWithoutWeight) {
  for (int n : {1, 7, 33, 257}) {
    const auto x = randn(static_cast<size_t>(3 * n), 3, 2.0f);
    const auto w = randn(static_cast<size_t>(n), 4);
    std::vector<float> y(x.size()), y0(x.size());
    rmsnorm_rows(cpu_tier_from_environment(), x.data(), 3, n, w.data(), 1e-6f, y.data());
    rmsnorm_rows(cpu_tier_from_environment(), x.data(), 3, n, nullptr, 1e-6f, y0.data());
    for (int r = 0; r < 3; ++r) {
      double ss = 0;
      for (int i = 0; i < n; ++i) ss += static_cast<double>(x[r * n + i]) * x[r * n + i];
      const double inv = 1.0 / std::sqrt(ss / n + 1e-6);
      for (int i = 0; i < n; ++i) {
        EXPECT_NEAR(y0[r * n + i], x[r * n + i] * inv, 1e-5);
        EXPECT_NEAR(y[r * n + i], x[r * n + i] * inv * w[i], 1e-5);  // w as-is, not 1 + w
      }
    }
  }
}

TEST(Gelu, TanhFormMatchesFormula) {
  for (double x : {-6.0, -1.5, -0.3, 0.0, 0.2, 1.0, 3.7, 10.0}) {
    const double want = 0.5 * x * (1 + std::tanh(std::sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    EXPECT_NEAR(gelu_tanh(static_cast<float>(x)), want, 1e-6) << x;
  }
  const auto g = randn(37, 5), u = randn(37, 6);
  std::vector<float> out(37);
  gelu_tanh_mul(cpu_tier_from_environment(), g.data(), u.data(), 37, out.data());
  for (int i = 0; i < 37; ++i) EXPECT_FLOAT_EQ(out[i], gelu_tanh(g[i]) * u[i]);
}

TEST(Softcap, IsCapTimesTanh) {
  std::vector<float> v = {-100.0f, -1.0f, 0.0f, 5.0f, 90.0f};
  const auto orig = v;
  softcap(cpu_tier_from_environment(), v.data(), 5, 30.0f);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_NEAR(v[i], 30.0 * std::tanh(orig[i] / 30.0), 1e-5);
}

TEST(Rope, StandardRotatesEveryPairLikeRotateHalf) {
  const int hd = 32;
  const RopeTable t = RopeTable::standard(hd, 10000.0);
  auto v = randn(2 * hd, 7);
  const auto orig = v;
  apply_rope(t, 13, v.data(), 2);
  for (int h = 0; h < 2; ++h)
    for (int i = 0; i < hd / 2; ++i) {
      const double a = 13.0 * std::pow(10000.0, -2.0 * i / hd);
      const double x1 = orig[h * hd + i], x2 = orig[h * hd + i + hd / 2];
      EXPECT_NEAR(v[h * hd + i], x1 * std::cos(a) - x2 * std::sin(a), 1e-5);
      EXPECT_NEAR(v[h * hd + i + hd / 2], x2 * std::cos(a) + x1 * std::sin(a), 1e-5);
    }
}

TEST(Rope, ProportionalRotatesOnlyLeadingPairsWithFullWidthFrequencies) {
  const int hd = 512;  // E-series full layers: 64 rotated pairs (0..63 with 256..319)
  const RopeTable t = RopeTable::proportional(hd, 1e6, 0.25);
  EXPECT_EQ(t.n_rotated, 64);
  auto v = randn(hd, 8);
  const auto orig = v;
  apply_rope(t, 1000, v.data(), 1);
  for (int i = 0; i < hd / 2; ++i) {
    if (i < 64) {
      const double a = 1000.0 * std::pow(1e6, -2.0 * i / hd);  // divides by 512, not 128
      EXPECT_NEAR(v[i], orig[i] * std::cos(a) - orig[i + 256] * std::sin(a), 1e-4);
    } else {
      EXPECT_EQ(v[i], orig[i]);
      EXPECT_EQ(v[i + 256], orig[i + 256]);
    }
  }
}

TEST(Rope, RelativePositionInvariance) {
  const RopeTable t = RopeTable::standard(64, 10000.0);
  auto q = randn(64, 9), k = randn(64, 10);
  auto dot_at = [&](int pq, int pk) {
    auto a = q, b = k;
    apply_rope(t, pq, a.data(), 1);
    apply_rope(t, pk, b.data(), 1);
    return dot_f32(cpu_tier_from_environment(), a.data(), b.data(), 64);
  };
  EXPECT_NEAR(dot_at(10, 3), dot_at(107, 100), 1e-4);
}

TEST(Attention, QueriesMatchDoubleReferenceOnOddSizes) {
  // M queries of one KV group, each with its own visible key range, as the decoder calls it for
  // a prefill task (causal and sliding ranges) or a decode row. Sizes cover the vector tails
  // (hd % 16, hd % 32 < 16), query counts off the 4x4 score tiles and the 8-query value tiles,
  // key counts crossing kKeyBlock, ranges that skip whole key blocks, a single visible key, a
  // span past kPrefetchMinBytes (the AVX-512 kernel then prefetches the next block's rows); both
  // the AVX-512 and the portable path, with f32 and with bf16 key/value rows (the reference then
  // reads the same rows widened back to f32).
  for (bool bf16 : {false, true})
    for (CpuTier tier : cpu_supported_tiers())
      for (auto [M, hd, n] :
           {std::tuple{1, 37, 13}, std::tuple{8, 64, 1}, std::tuple{3, 5, 129},
            std::tuple{11, 47, 37}, std::tuple{16, 256, 100}, std::tuple{17, 512, 70},
            std::tuple{5, 32, 37}, std::tuple{8, 512, 1100}}) {
        // Scores of a few units, like the decoder's normalized q and k; not so peaked that one
        // key takes all the weight.
        const float qs = 2.0f / std::sqrt(static_cast<float>(hd));
        const auto q = randn(static_cast<size_t>(M * hd), 21, qs);
        auto k = randn(static_cast<size_t>(n * hd), 22), v = randn(static_cast<size_t>(n * hd), 23);
        std::vector<uint16_t> k16(k.size()), v16(v.size());
        for (size_t i = 0; i < k.size(); ++i) {
          k16[i] = f32_to_bf16(k[i]);
          v16[i] = f32_to_bf16(v[i]);
          if (bf16) k[i] = bf16_to_f32(k16[i]), v[i] = bf16_to_f32(v16[i]);
        }
        std::vector<float> out(static_cast<size_t>(M * hd)), ref(static_cast<size_t>(hd));
        std::mt19937 rng(static_cast<uint32_t>(M * 1000 + n));
        QueryBlock queries;
        queries.tier = tier;
        for (int64_t m = 0; m < M; ++m) {
          int64_t lo = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
          int64_t hi = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
          if (lo > hi) std::swap(lo, hi);
          if (m == 0) lo = 0, hi = n - 1;  // one query sees every key
          queries.add(q.data() + m * hd, out.data() + m * hd, lo, hi);
        }
        AttentionScratch scratch;
        if (bf16)
          attend_contiguous(queries, hd, k16.data(), v16.data(), scratch);
        else
          attend_contiguous(queries, hd, k.data(), v.data(), scratch);
        for (int64_t m = 0; m < M; ++m) {
          const int64_t lo = queries.lo[static_cast<size_t>(m)],
                        hi = queries.hi[static_cast<size_t>(m)];
          attention_reference(q.data() + m * hd, k.data() + lo * hd, v.data() + lo * hd, hd,
                              hi - lo + 1, ref.data());
          for (int64_t i = 0; i < hd; ++i)
            ASSERT_NEAR(out[static_cast<size_t>(m * hd + i)], ref[static_cast<size_t>(i)], 1e-5)
                << "M " << M << " query " << m << " keys [" << lo << ", " << hi << "] hd " << hd
                << " n " << n << " tier " << cpu_tier_name(tier) << " bf16 " << bf16;
        }
      }
}

TEST(Attention, Q8CacheRowsRoundTripWithinHalfACode) {
  // Each 32-value block: codes in [-127, 127], values back within half a step of the f16 scale
  // (plus the scale's own f16 rounding), the block's largest value exact to that step; a zero
  // block decodes to zeros, not NaN.
  auto x = randn(32 * 9, 51, 3.0f);
  for (int i = 0; i < 32; ++i) x[static_cast<size_t>(64 + i)] = 0.0f;  // block 2: all zero
  x[5] = 1e4f;                                                         // one outlier
  std::vector<KvQ8Block> q(9);
  quantize_kv_q8(x.data(), static_cast<int64_t>(x.size()), q.data());
  for (int b = 0; b < 9; ++b) {
    float amax = 0;
    for (int i = 0; i < 32; ++i)
      amax = std::max(amax, std::fabs(x[static_cast<size_t>(b * 32 + i)]));
    const float d = f16_to_f32(q[static_cast<size_t>(b)].d);
    EXPECT_NEAR(d, amax / 127, amax / 127 * 1e-3 + 1e-30) << "block " << b;
    for (int i = 0; i < 32; ++i) {
      const float got = kv_q8_value(q.data(), b * 32 + i);
      ASSERT_TRUE(std::isfinite(got));
      EXPECT_LE(std::fabs(got - x[static_cast<size_t>(b * 32 + i)]), 0.5f * d + amax * 2e-3f)
          << "block " << b << " value " << i;
    }
  }
  EXPECT_EQ(kv_q8_value(q.data(), 64), 0.0f);
}

TEST(Attention, Q8RowsMatchTheDoubleReferenceOnEveryTier) {
  // q8_0 key/value rows read block by block (the AVX-512 and AVX2 twins, the portable loops on
  // the scalar and NEON tiers) against the double reference over the same rows widened to f32:
  // the kernels may not widen differently, so the tolerance is the f32 one. Head sizes are the
  // multiples of 32 a q8_0 cache allows; query and key counts off the tiles, a span past
  // kPrefetchMinBytes.
  for (CpuTier tier : cpu_supported_tiers())
    for (auto [M, hd, n] :
         {std::tuple{1, 32, 13}, std::tuple{8, 64, 1}, std::tuple{3, 96, 129},
          std::tuple{11, 256, 37}, std::tuple{17, 512, 70}, std::tuple{8, 512, 1100}}) {
      const float qs = 2.0f / std::sqrt(static_cast<float>(hd));
      const auto q = randn(static_cast<size_t>(M * hd), 61, qs);
      auto k = randn(static_cast<size_t>(n * hd), 62), v = randn(static_cast<size_t>(n * hd), 63);
      std::vector<KvQ8Block> kq(k.size() / 32), vq(v.size() / 32);
      quantize_kv_q8(k.data(), static_cast<int64_t>(k.size()), kq.data());
      quantize_kv_q8(v.data(), static_cast<int64_t>(v.size()), vq.data());
      for (size_t i = 0; i < k.size(); ++i) {
        k[i] = kv_q8_value(kq.data(), static_cast<int64_t>(i));
        v[i] = kv_q8_value(vq.data(), static_cast<int64_t>(i));
      }
      std::vector<float> out(static_cast<size_t>(M * hd), std::nanf("")),
          ref(static_cast<size_t>(hd));
      std::mt19937 rng(static_cast<uint32_t>(M * 1000 + n));
      QueryBlock queries;
      queries.tier = tier;
      for (int64_t m = 0; m < M; ++m) {
        int64_t lo = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
        int64_t hi = std::uniform_int_distribution<int64_t>(0, n - 1)(rng);
        if (lo > hi) std::swap(lo, hi);
        if (m == 0) lo = 0, hi = n - 1;
        queries.add(q.data() + m * hd, out.data() + m * hd, lo, hi);
      }
      AttentionScratch scratch;
      attend_contiguous(queries, hd, kq.data(), vq.data(), scratch);
      for (int64_t m = 0; m < M; ++m) {
        const int64_t lo = queries.lo[static_cast<size_t>(m)],
                      hi = queries.hi[static_cast<size_t>(m)];
        attention_reference(q.data() + m * hd, k.data() + lo * hd, v.data() + lo * hd, hd,
                            hi - lo + 1, ref.data());
        for (int64_t i = 0; i < hd; ++i)
          ASSERT_NEAR(out[static_cast<size_t>(m * hd + i)], ref[static_cast<size_t>(i)], 1e-5)
              << "M " << M << " query " << m << " hd " << hd << " n " << n << " tier "
              << cpu_tier_name(tier);
      }
    }
}

TEST(Attention, KeySplitPartsMergeToTheWholeRange) {
  // Decode splits one row's keys into parts, one per thread, and merges their unnormalized
  // states; a part past the last key (sum 0, output never written) must not count.
  for (CpuTier tier : cpu_supported_tiers()) {
    const int64_t hd = 40, n = 75, G = 3;
    const auto q = randn(static_cast<size_t>(G * hd), 41, 0.3f), k = randn(n * hd, 42),
               v = randn(n * hd, 43);
    const std::pair<int64_t, int64_t> ranges[] = {{0, 31}, {32, 74}, {75, 74}};  // last: empty
    const int64_t P = 3;
    std::vector<float> part_out(static_cast<size_t>(P * G * hd), std::nanf("")),
        part_max(static_cast<size_t>(P * G)), part_sum(static_cast<size_t>(P * G), 0.0f);
    AttentionScratch scratch;
    for (int64_t p = 0; p < P; ++p) {
      const auto [lo, hi] = ranges[p];
      if (lo > hi) continue;
      QueryBlock queries;
      queries.tier = tier;
      for (int64_t g = 0; g < G; ++g)
        queries.add(q.data() + g * hd, part_out.data() + (p * G + g) * hd, lo, hi);
      attend_queries_partial(
          queries, hd, [&](int64_t j) { return k.data() + j * hd; },
          [&](int64_t j) { return v.data() + j * hd; }, scratch);
      for (int64_t g = 0; g < G; ++g) {
        part_max[static_cast<size_t>(p * G + g)] = scratch.max[static_cast<size_t>(g)];
        part_sum[static_cast<size_t>(p * G + g)] = scratch.sum[static_cast<size_t>(g)];
      }
    }
    std::vector<float> out(static_cast<size_t>(hd)), ref(static_cast<size_t>(hd));
    for (int64_t g = 0; g < G; ++g) {
      merge_partial_attention(tier, part_out.data() + g * hd, part_max.data() + g,
                              part_sum.data() + g, P, G, hd, out.data());
      attention_reference(q.data() + g * hd, k.data(), v.data(), hd, n, ref.data());
      for (int64_t i = 0; i < hd; ++i)
        ASSERT_NEAR(out[static_cast<size_t>(i)], ref[static_cast<size_t>(i)], 1e-5)
            << "head " << g << " tier " << cpu_tier_name(tier);
    }
  }
}

TEST(Attention, ScratchIsReusedAcrossCallsOfDifferentSizes) {
  // The decoder keeps one scratch per thread; a large call followed by a smaller one must not
  // see the first call's running max or sum.
  const int64_t hd = 32;
  const auto q = randn(static_cast<size_t>(20 * hd), 31, 0.3f), k = randn(40 * hd, 32),
             v = randn(40 * hd, 33);
  auto run = [&](int64_t M, int64_t n, AttentionScratch& scratch) {
    std::vector<float> out(static_cast<size_t>(M * hd));
    QueryBlock queries;
    for (int64_t m = 0; m < M; ++m) queries.add(q.data() + m * hd, out.data() + m * hd, 0, n - 1);
    attend_contiguous(queries, hd, k.data(), v.data(), scratch);
    return out;
  };
  AttentionScratch shared, fresh;
  run(20, 40, shared);
  EXPECT_EQ(run(3, 5, shared), run(3, 5, fresh));
}

// Each SIMD tier's twins against the scalar reference on odd sizes, so both the full-vector
// body and the tail run. A tier the CPU lacks is skipped (an AVX-512 machine runs both).
class VectorOps : public ::testing::TestWithParam<CpuTier> {
 protected:
  void SetUp() override {
    if (!cpu_tier_supported(GetParam()))
      GTEST_SKIP() << "this CPU has no " << cpu_tier_name(GetParam()) << " (it has "
                   << cpu_features_string() << ")";
  }
  // The tier under test; each test runs its kernels under it and under CpuTier::Scalar.
  static CpuTier tier() { return GetParam(); }
};

INSTANTIATE_TEST_SUITE_P(Tiers, VectorOps,
                         ::testing::Values(CpuTier::Avx2, CpuTier::Avx512, CpuTier::Neon,
                                           CpuTier::Dotprod, CpuTier::I8mm),
                         [](const ::testing::TestParamInfo<CpuTier>& i) {
                           return std::string(cpu_tier_name(i.param));
                         });

TEST_P(VectorOps, GeluTanhMulMatchesScalarAcrossItsRange) {
  for (int n : {1, 15, 17, 203}) {
    // Mixed scales: |x| < 0.3 exercises the series branch, large |x| the saturation.
    auto g = randn(static_cast<size_t>(n), 31, 3.0f);
    for (int i = 0; i < n; i += 3) g[static_cast<size_t>(i)] *= 0.02f;
    const auto u = randn(static_cast<size_t>(n), 32);
    auto run = [&](CpuTier t) {
      std::vector<float> out(static_cast<size_t>(n));
      gelu_tanh_mul(t, g.data(), u.data(), n, out.data());
      return out;
    };
    const auto want = run(CpuTier::Scalar), got = run(tier());
    for (int i = 0; i < n; ++i) {
      const float w = want[static_cast<size_t>(i)];
      EXPECT_NEAR(got[static_cast<size_t>(i)], w, 4e-7f * std::max(1.0f, std::fabs(w)))
          << "n " << n << " x " << g[static_cast<size_t>(i)];
    }
  }
  const float big[3] = {-20.0f, 20.0f, 1e6f}, one[3] = {1, 1, 1};
  float out[3];
  gelu_tanh_mul(tier(), big, one, 3, out);
  EXPECT_EQ(out[0], -0.0f);
  EXPECT_EQ(out[1], 20.0f);
  EXPECT_EQ(out[2], 1e6f);
}

TEST_P(VectorOps, RmsNormMatchesScalar) {
  for (int n : {1, 15, 33, 256, 1541}) {
    const auto x = randn(static_cast<size_t>(3 * n), 45, 3.0f);
    const auto w = randn(static_cast<size_t>(n), 46);
    for (const float* wp : {w.data(), static_cast<const float*>(nullptr)}) {
      auto run = [&](CpuTier t) {
        std::vector<float> y(x.size());
        rmsnorm_rows(t, x.data(), 3, n, wp, 1e-6f, y.data());
        return y;
      };
      const auto want = run(CpuTier::Scalar), got = run(tier());
      for (size_t i = 0; i < want.size(); ++i)
        EXPECT_NEAR(got[i], want[i], 2e-6f * std::max(1.0f, std::fabs(want[i]))) << n;
    }
  }
}

TEST_P(VectorOps, SoftcapAndSoftmaxMatchScalar) {
  for (int n : {1, 16, 31, 1001}) {
    const auto x = randn(static_cast<size_t>(n), 41, 40.0f);
    auto capped = [&](CpuTier t) {
      auto y = x;
      softcap(t, y.data(), n, 30.0f);
      return y;
    };
    auto soft = [&](CpuTier t) {
      auto y = x;
      softmax_inplace(t, y.data(), n);
      return y;
    };
    const auto cw = capped(CpuTier::Scalar), cg = capped(tier()), sw = soft(CpuTier::Scalar),
               sg = soft(tier());
    for (int i = 0; i < n; ++i) {
      EXPECT_NEAR(cg[static_cast<size_t>(i)], cw[static_cast<size_t>(i)], 4e-6) << n;
      EXPECT_NEAR(sg[static_cast<size_t>(i)], sw[static_cast<size_t>(i)],
                  4e-7 * std::max(1e-3f, sw[static_cast<size_t>(i)]) + 1e-12)
          << n;
    }
  }
}

TEST_P(VectorOps, DotAndAxpyMatchScalar) {
  for (int n : {1, 7, 16, 33, 512, 515}) {
    const auto a = randn(static_cast<size_t>(n), 51), b = randn(static_cast<size_t>(n), 52);
    const float want = dot_f32(CpuTier::Scalar, a.data(), b.data(), n);
    EXPECT_NEAR(dot_f32(tier(), a.data(), b.data(), n), want, 1e-5 * std::sqrt(n)) << n;
    auto ax = [&](CpuTier t) {
      auto y = b;
      axpy_f32(t, 0.37f, a.data(), y.data(), n);
      return y;
    };
    const auto yw = ax(CpuTier::Scalar), yg = ax(tier());
    for (int i = 0; i < n; ++i)
      EXPECT_NEAR(yg[static_cast<size_t>(i)], yw[static_cast<size_t>(i)], 1e-6) << n;
  }
}

// The decode GEMV (one activation row) of each tier against the scalar tier on widths whose
// last chunk is short (a full half plus a tail, a lone block), many rows on two threads; a zero
// activation row gives exact zeros and a NaN poisons every output. The integer block dots are
// exact on every path, so the tiers differ only in f32 summation order; within a tier the decode
// GEMV keeps its prefill tile's order.
TEST_P(VectorOps, QuantGemvMatchesScalar) {
  ThreadPool scalar_pool(2, CpuTier::Scalar), pool(2, tier());
  for (DType t : {DType::Q8_0, DType::Q4_0})
    for (int64_t K : {32, 288, 1184}) {
      const int64_t N = 77;
      const auto wf = randn(static_cast<size_t>(N * K), 80 + static_cast<uint32_t>(K), 0.1f);
      const auto q = quantize_matrix(t, wf.data(), N, K);
      const WeightView w{"w", t, {N, K}, q.data(), q.size()};
      auto x = randn(static_cast<size_t>(K), 81);
      x[static_cast<size_t>(K / 3)] = 25.0f;
      auto run = [&](ThreadPool& p) {
        std::vector<float> y(static_cast<size_t>(N));
        matmul(p, x.data(), 1, w, y.data());
        return y;
      };
      const auto want = run(scalar_pool), got = run(pool);
      // The decode row equals the same row inside a small prefill bit for bit (the decoder's
      // incremental-equals-recompute tests rely on it).
      {
        std::vector<float> x3(static_cast<size_t>(3 * K)), y3(static_cast<size_t>(3 * N));
        for (int64_t k = 0; k < K; ++k) {
          x3[static_cast<size_t>(k)] = -x[static_cast<size_t>(k)];
          x3[static_cast<size_t>(K + k)] = x[static_cast<size_t>(k)];
          x3[static_cast<size_t>(2 * K + k)] = 0.5f * x[static_cast<size_t>(k)];
        }
        matmul(pool, x3.data(), 3, w, y3.data());
        for (int64_t r = 0; r < N; ++r)
          ASSERT_EQ(y3[static_cast<size_t>(N + r)], got[static_cast<size_t>(r)])
              << dtype_name(t) << " K=" << K << " row " << r << " (" << quant_isa(tier(), 1) << ")";
      }
      // The decode row equals the same row inside a small prefill bit for bit (the decoder's
      // incremental-equals-recompute tests rely on it).
      {
        std::vector<float> x3(static_cast<size_t>(3 * K)), y3(static_cast<size_t>(3 * N));
        for (int64_t k = 0; k < K; ++k) {
          x3[static_cast<size_t>(k)] = -x[static_cast<size_t>(k)];
          x3[static_cast<size_t>(K + k)] = x[static_cast<size_t>(k)];
          x3[static_cast<size_t>(2 * K + k)] = 0.5f * x[static_cast<size_t>(k)];
        }
        matmul(pool, x3.data(), 3, w, y3.data());
        for (int64_t r = 0; r < N; ++r)
          ASSERT_EQ(y3[static_cast<size_t>(N + r)], got[static_cast<size_t>(r)])
              << dtype_name(t) << " K=" << K << " row " << r << " (" << quant_isa(tier(), 1) << ")";
      }
      for (int64_t r = 0; r < N; ++r) {
        double mag = 0;
        for (int64_t k = 0; k < K; ++k)
          mag += std::fabs(x[static_cast<size_t>(k)] * wf[static_cast<size_t>(r * K + k)]);
        ASSERT_NEAR(got[static_cast<size_t>(r)], want[static_cast<size_t>(r)], 3e-5 * mag + 1e-6)
            << dtype_name(t) << " K=" << K << " row " << r << " (" << quant_isa(tier(), 1) << ")";
      }
      std::fill(x.begin(), x.end(), 0.0f);
      for (float v : run(pool)) ASSERT_EQ(v, 0.0f) << dtype_name(t) << " K=" << K;
      x[static_cast<size_t>(K - 1)] = NAN;
      for (float v : run(pool)) ASSERT_TRUE(std::isnan(v)) << dtype_name(t) << " K=" << K;
    }
}

TEST(ThreadPool, CoversEveryIndexOnce) {
  ThreadPool pool(3);
  for (size_t n : {size_t{1}, size_t{7}, size_t{1000}}) {
    std::vector<int> hits(n, 0);
    pool.parallel_for(
        n,
        [&](size_t b, size_t e) {
          for (size_t i = b; i < e; ++i) ++hits[i];
        },
        4);
    for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1);
  }
}

TEST(ThreadPool, ChunksCoverEveryIndexOnceInWholeChunks) {
  for (int threads : {1, 2, 3}) {
    ThreadPool pool(threads);
    for (auto [n, chunk] : {std::pair<size_t, size_t>{1, 16}, {7, 3}, {1000, 16}, {1001, 64}}) {
      std::vector<std::atomic<int>> hits(n);
      pool.parallel_chunks(n, chunk, [&](size_t b, size_t e) {
        EXPECT_EQ(b % chunk, 0u);
        EXPECT_TRUE(e - b == chunk || e == n) << b << ".." << e;
        for (size_t i = b; i < e; ++i) ++hits[i];
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i].load(), 1) << threads << " " << n;
    }
  }
  ThreadPool pool(2);
  EXPECT_THROW(pool.parallel_chunks(100, 10,
                                    [](size_t b, size_t) {
                                      if (b == 50) throw std::runtime_error("chunk 5");
                                    }),
               std::runtime_error);
}

// About four chunks per thread, in whole grains, never below one grain.
TEST(ThreadPool, ChunkForGivesEachThreadAboutFourWholeGrains) {
  ThreadPool two(2), three(3);
  EXPECT_EQ(two.chunk_for(6144, 16), 768u);   // 8 chunks
  EXPECT_EQ(two.chunk_for(301, 16), 32u);     // 37 rounded down to whole groups
  EXPECT_EQ(three.chunk_for(1001, 16), 80u);  // 83 rounded down
  EXPECT_EQ(two.chunk_for(40, 16), 16u);      // fewer rows than 4 chunks a thread: one group
  EXPECT_EQ(two.chunk_for(0, 16), 16u);
  EXPECT_EQ(three.chunk_for(192, 1), 16u);  // AMX strips
  EXPECT_EQ(three.chunk_for(5, 1), 1u);
}

// Thousands of back-to-back jobs (the decode pattern) and jobs after the workers have gone to
// sleep (idle longer than their spin) must all run every range exactly once.
TEST(ThreadPool, BackToBackJobsAndJobsAfterSleeping) {
  ThreadPool pool(3);
  std::atomic<long> sum{0};
  auto job = [&](size_t b, size_t e) {
    long s = 0;
    for (size_t i = b; i < e; ++i) s += static_cast<long>(i);
    sum += s;
  };
  for (int rep = 0; rep < 5000; ++rep) pool.parallel_for(64, job, 1);
  EXPECT_EQ(sum.load(), 5000L * (63 * 64 / 2));
  for (int rep = 0; rep < 3; ++rep) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    sum = 0;
    pool.parallel_for(1000, job, 8);
    EXPECT_EQ(sum.load(), 999L * 1000 / 2);
  }
}

TEST(ThreadPool, ExceptionInAWorkerReachesTheCaller) {
  ThreadPool pool(2);
  std::atomic<int> ran{0};
  auto job = [&](size_t b, size_t) {
    ++ran;
    if (b > 0) throw std::runtime_error("range starting at " + std::to_string(b));
  };
  try {
    pool.parallel_for(100, job, 1);
    FAIL() << "expected the worker's exception";
  } catch (const std::runtime_error& e) {
    EXPECT_EQ(std::string(e.what()), "range starting at 50");
  }
  EXPECT_EQ(ran.load(), 2);
  // The pool is still usable afterwards.
  std::atomic<size_t> n{0};
  pool.parallel_for(
      100, [&](size_t b, size_t e) { n += e - b; }, 1);
  EXPECT_EQ(n.load(), 100u);
}

}  // namespace
