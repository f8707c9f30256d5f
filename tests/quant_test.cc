// Q8_0 / Q4_0: layout, round-trip bounds, readers, and every matmul path against the reference.
#include "kernels/quant.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>

#include "core/cpu_features.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "kernels/matmul.h"
#include "kernels/weight_rows.h"

using namespace gemstage;

namespace {

std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Rows whose blocks span many magnitudes: ordinary, large, all-zero, f16-subnormal-scale and
// single-outlier blocks.
std::vector<float> varied(int64_t rows, int64_t in, uint32_t seed) {
  auto v = randn(static_cast<size_t>(rows * in), seed, 0.05f);
  std::mt19937 rng(seed + 1);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < in / 32; ++b) {
      float* p = v.data() + r * in + b * 32;
      switch (rng() % 6) {
        case 0:
          for (int e = 0; e < 32; ++e) p[e] *= 200.0f;
          break;
        case 1:
          for (int e = 0; e < 32; ++e) p[e] = 0.0f;
          break;
        case 2:
          for (int e = 0; e < 32; ++e) p[e] *= 1e-4f;  // scale ~4e-8: f16 subnormal
          break;
        case 3:
          p[rng() % 32] = (rng() % 2 ? 1.0f : -1.0f) * 3.0f;
          break;
        default:
          break;
      }
    }
  return v;
}

const char* fmt(DType t) {
  return t == DType::Q8_0 ? "Q8_0" : "Q4_0";
}

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

uint16_t f16_bits(float f) {
  return f32_to_f16(f);
}

}  // namespace

TEST(QuantLayout, SizesAreWholeBlocks) {
  EXPECT_EQ(quant_block_bytes(DType::Q8_0), 34u);
  EXPECT_EQ(quant_block_bytes(DType::Q4_0), 18u);
  EXPECT_EQ(quant_row_bytes(DType::Q8_0, 32), 34u);
  EXPECT_EQ(quant_row_bytes(DType::Q4_0, 32), 18u);
  EXPECT_EQ(quant_row_bytes(DType::Q8_0, 1536), 48u * 34u);
  EXPECT_EQ(quant_row_bytes(DType::Q4_0, 1536), 48u * 18u);
  EXPECT_EQ(quant_row_bytes(DType::Q8_0, 6144), 192u * 34u);
  EXPECT_EQ(quant_row_bytes(DType::Q4_0, 1056), 33u * 18u);
  EXPECT_TRUE(dtype_is_quantized(DType::Q8_0));
  EXPECT_FALSE(dtype_is_quantized(DType::BF16));
  EXPECT_EQ(dtype_size(DType::Q8_0), 0u);
  const auto q = quantize_matrix(DType::Q4_0, randn(5 * 96, 1).data(), 5, 96);
  EXPECT_EQ(q.size(), 5u * 3u * 18u);
}

TEST(QuantLayout, WidthNotMultipleOf32IsAClearError) {
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    for (int64_t in : {1, 31, 33, 48, 1000}) {
      const std::string e = error_of([&] { quant_row_bytes(t, in); });
      EXPECT_NE(e.find("multiple of 32"), std::string::npos) << e;
      EXPECT_NE(e.find(std::to_string(in)), std::string::npos) << e;
    }
    std::vector<float> src(48, 1.0f);
    std::vector<uint8_t> dst(100);
    EXPECT_NE(error_of([&] { quantize_row(t, src.data(), 48, dst.data()); }), "");
    // matmul on a quantized view with in = 48.
    const WeightView w{"layer.q_proj", t, {2, 48}, dst.data(), 100};
    ThreadPool pool(1);
    std::vector<float> y(2);
    const std::string m = error_of([&] { matmul(pool, src.data(), 1, w, y.data()); });
    EXPECT_NE(m.find("layer.q_proj"), std::string::npos) << m;
    EXPECT_NE(m.find("multiple of 32"), std::string::npos) << m;
  }
  EXPECT_NE(error_of([] { quant_row_bytes(DType::BF16, 64); }).find("not a block-quantized"),
            std::string::npos);
}

TEST(QuantLayout, NbytesMismatchIsAnError) {
  const auto wf = randn(4 * 64, 2);
  auto q = quantize_matrix(DType::Q8_0, wf.data(), 4, 64);
  const WeightView w{"w", DType::Q8_0, {4, 64}, q.data(), q.size() - 1};
  ThreadPool pool(1);
  std::vector<float> x(64, 1.0f), y(4);
  const std::string m = error_of([&] { matmul(pool, x.data(), 1, w, y.data()); });
  EXPECT_NE(m.find("bytes"), std::string::npos) << m;
}

// The byte formulas of quant.h, built by hand (not by quantize_row), read back by the readers.
TEST(QuantLayout, DocumentedByteOrder) {
  const int64_t in = 17 * 32;  // one full chunk of 16 blocks and a tail chunk of m = 1
  const int64_t nb = 17;
  auto code8 = [](int64_t b, int64_t e) { return static_cast<int>((b * 7 + e * 5) % 255); };
  auto code4 = [](int64_t b, int64_t e) { return static_cast<int>((b * 3 + e) % 16); };
  auto scale = [](int64_t b) { return 0.25f * static_cast<float>(b + 1); };  // exact in f16
  std::vector<uint8_t> r8(quant_row_bytes(DType::Q8_0, in)), r4(quant_row_bytes(DType::Q4_0, in));
  for (int64_t b = 0; b < nb; ++b) {
    const uint16_t h = f16_bits(b % 2 ? -scale(b) : scale(b));
    std::memcpy(&r8[2 * b], &h, 2);
    std::memcpy(&r4[2 * b], &h, 2);
    const int64_t c = b / 16, i = b % 16, m = std::min<int64_t>(16, nb - 16 * c);
    for (int64_t j = 0; j < 8; ++j)
      for (int64_t t = 0; t < 4; ++t)
        r8[2 * nb + 512 * c + j * 4 * m + 4 * i + t] = static_cast<uint8_t>(code8(b, 4 * j + t));
    for (int64_t g = 0; g < 4; ++g)
      for (int64_t t = 0; t < 4; ++t)
        r4[2 * nb + 256 * c + g * 4 * m + 4 * i + t] =
            static_cast<uint8_t>(code4(b, 8 * g + t) | code4(b, 8 * g + 4 + t) << 4);
  }
  std::vector<float> d8(in), d4(in);
  dequantize_row(DType::Q8_0, r8.data(), in, d8.data());
  dequantize_row(DType::Q4_0, r4.data(), in, d4.data());
  for (int64_t k = 0; k < in; ++k) {
    const int64_t b = k / 32, e = k % 32;
    const float d = b % 2 ? -scale(b) : scale(b);
    ASSERT_EQ(d8[k], static_cast<float>(code8(b, e) - 128) * d) << k;
    ASSERT_EQ(d4[k], static_cast<float>(code4(b, e) - 8) * d) << k;
    ASSERT_EQ(dequantize_at(DType::Q8_0, r8.data(), in, k), d8[k]) << k;
    ASSERT_EQ(dequantize_at(DType::Q4_0, r4.data(), in, k), d4[k]) << k;
  }
}

class QuantRoundTrip : public ::testing::TestWithParam<std::tuple<DType, int>> {};

TEST_P(QuantRoundTrip, ErrorWithinHalfAScale) {
  const auto [t, in] = GetParam();
  const int64_t rows = 7;
  const auto w = varied(rows, in, 3 + static_cast<uint32_t>(in));
  const auto q = quantize_matrix(t, w.data(), rows, in);
  const size_t rb = quant_row_bytes(t, in);
  std::vector<float> back(static_cast<size_t>(in));
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* row = q.data() + r * rb;
    dequantize_row(t, row, in, back.data());
    for (int64_t b = 0; b < in / 32; ++b) {
      const float d = quant_block_scale(t, row, in, b);
      const float ad = std::fabs(d);
      float amax = 0.0f, ext = 0.0f;
      for (int e = 0; e < 32; ++e) {
        const float v = w[r * in + b * 32 + e];
        amax = std::max(amax, std::fabs(v));
        if (std::fabs(v) > std::fabs(ext)) ext = v;
      }
      if (amax == 0.0f) {
        EXPECT_EQ(d, 0.0f);
      } else if (amax > 1e-2f) {  // f16-normal scales: d is max/127 (max/-8) to f16 precision
        const float want = t == DType::Q8_0 ? amax / 127.0f : ext / -8.0f;
        EXPECT_NEAR(d, want, std::fabs(want) * 1e-3f) << fmt(t) << " block " << b;
      }
      for (int e = 0; e < 32; ++e) {
        const float v = w[r * in + b * 32 + e], got = back[static_cast<size_t>(b * 32 + e)];
        const double err = std::fabs(static_cast<double>(v) - got);
        double bound = ad / 2;
        // Q4_0: only w/d in [-8.5, 7.5] is "in range"; above, the code clamps to 15 (w^ = 7d)
        // and w/d is at most |max / d| <= 8.5 (<= 8 (1 + 2^-11) for f16-normal scales).
        if (t == DType::Q4_0 && d != 0.0f && v / d > 7.5f) {
          ASSERT_LE(v / d, amax > 1e-2f ? 8.01f : 8.5f);
          bound = (v / d - 7.0) * ad;
        }
        ASSERT_LE(err, bound * (1 + 1e-6) + 1e-30) << fmt(t) << " row " << r << " block " << b
                                                   << " elem " << e << " w " << v << " d " << d;
      }
      if (t == DType::Q4_0 && d != 0.0f) {  // the extreme maps to code 0: -8 d
        int at = 0;
        for (int e = 0; e < 32; ++e)
          if (w[r * in + b * 32 + e] == ext) at = e;
        EXPECT_EQ(back[static_cast<size_t>(b * 32 + at)], -8.0f * d);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Widths, QuantRoundTrip,
                         ::testing::Combine(::testing::Values(DType::Q8_0, DType::Q4_0),
                                            ::testing::Values(32, 96, 160, 512, 1056, 1536)));

TEST(QuantRoundTrip, NonFiniteWeightsFail) {
  std::vector<float> w(64 * 40, 0.5f);
  w[64 * 33 + 5] = NAN;
  ThreadPool pool(2);
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const std::string e = error_of([&] { quantize_matrix(t, w.data(), 40, 64, &pool); });
    EXPECT_NE(e.find("non-finite"), std::string::npos) << e;
  }
}

TEST(QuantReaders, WeightRowAndAtMatchDequantizeRow) {
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const int64_t rows = 6, in = 1056;
    const auto w = varied(rows, in, 9);
    const auto q = quantize_matrix(t, w.data(), rows, in);
    const WeightView v{"embed", t, {rows, in}, q.data(), q.size()};
    const size_t rb = quant_row_bytes(t, in);
    std::vector<float> a(in), b(in);
    for (int64_t r = 0; r < rows; ++r) {
      weight_row_to_f32(v, r, a.data());
      dequantize_row(t, q.data() + r * rb, in, b.data());
      for (int64_t k = 0; k < in; ++k) {
        ASSERT_EQ(a[k], b[k]);
        ASSERT_EQ(weight_at(v, r * in + k), b[k]);
      }
    }
    EXPECT_NE(error_of([&] { weight_row_to_f32(v, rows, a.data()); }), "");
  }
}

// matmul on quantized weights vs matmul_reference of the same (dequantized) weights.
//
// Tolerance: the kernels quantize each activation block to int8 with dx = max|x_b| / 127, so
// |x - x^| <= dx / 2 per element and, exactly,
//     |y - y_ref| <= sum_b (dx_b / 2) * sum_{k in b} |w^_k|    (+ f32 accumulation error,
// covered by 1e-5 * sum |x| |w^|). Different implementations see identical integer block dots
// and differ only in f32 summation order: they must agree to 2e-5 * sum |x| |w^|.
class QuantMatmul : public ::testing::TestWithParam<std::tuple<DType, int, int, int>> {};

TEST_P(QuantMatmul, MatchesReferenceOnEveryPath) {
  const auto [t, S, K, N] = GetParam();
  auto x = randn(static_cast<size_t>(S * K), 21 + static_cast<uint32_t>(K));
  if (K >= 64) x[static_cast<size_t>(K / 2)] = 40.0f;  // an activation outlier, as in real models
  const auto wf = varied(N, K, 22 + static_cast<uint32_t>(N));
  const auto q = quantize_matrix(t, wf.data(), N, K);
  const WeightView w{"w", t, {N, K}, q.data(), q.size()};
  std::vector<float> wd(static_cast<size_t>(N * K));
  for (int64_t r = 0; r < N; ++r) weight_row_to_f32(w, r, wd.data() + r * K);

  // The AMX path rounds both operands to bf16 instead (kernels/x86/amx.h):
  //     |y - y_ref| <= (2^-8 + 2^-17) * sum |x| |w^|  (+ the same f32 allowance).
  std::vector<double> bound(static_cast<size_t>(S * N)), mag(bound.size()),
      bf16_bound(bound.size());
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < N; ++r) {
      double bd = 0, mg = 0;
      for (int64_t b = 0; b < K / 32; ++b) {
        double amax = 0, wsum = 0;
        for (int64_t k = b * 32; k < b * 32 + 32; ++k) {
          amax = std::max(amax, std::fabs(static_cast<double>(x[s * K + k])));
          wsum += std::fabs(wd[r * K + k]);
          mg += std::fabs(static_cast<double>(x[s * K + k]) * wd[r * K + k]);
        }
        bd += amax / 127 / 2 * wsum;
      }
      bound[s * N + r] = bd + 1e-5 * mg + 1e-7;
      mag[s * N + r] = 2e-5 * mg + 1e-7;
      bf16_bound[s * N + r] = (std::ldexp(1.0, -8) + std::ldexp(1.0, -17) + 1e-5) * mg + 1e-7;
    }

  std::vector<float> ref(static_cast<size_t>(S * N));
  matmul_reference(x.data(), S, w, ref.data());
  std::vector<float> forced_scalar(ref.size());
  {
    ThreadPool scalar_pool(2, CpuTier::Scalar);
    matmul(scalar_pool, x.data(), S, w, forced_scalar.data());
  }
  for (size_t i = 0; i < ref.size(); ++i)
    ASSERT_NEAR(forced_scalar[i], ref[i], bound[i]) << fmt(t) << " forced scalar at " << i;
  // Every tier this CPU supports, through matmul() and quant_matmul() both: an AVX-512 machine
  // still proves the AVX2 kernels.
  for (CpuTier tier : cpu_supported_tiers()) {
    ThreadPool pool(2, tier);
    const std::string isa = quant_isa(tier, S);
    std::vector<float> via_matmul(ref.size()), got(ref.size());
    matmul(pool, x.data(), S, w, via_matmul.data());
    quant_matmul(pool, x.data(), S, w, got.data());
    ASSERT_EQ(via_matmul, got) << fmt(t) << " tier " << cpu_tier_name(tier);
    for (size_t i = 0; i < ref.size(); ++i) {
      if (isa == "amx-bf16") {
        ASSERT_NEAR(got[i], ref[i], bf16_bound[i]) << fmt(t) << " amx at " << i;
        continue;
      }
      ASSERT_NEAR(got[i], ref[i], bound[i]) << fmt(t) << " " << isa << " at " << i;
      ASSERT_NEAR(got[i], forced_scalar[i], mag[i])
          << fmt(t) << " " << isa << " vs scalar at " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Sizes, QuantMatmul,
                         ::testing::Combine(::testing::Values(DType::Q8_0, DType::Q4_0),
                                            ::testing::Values(1, 3, 5, 17, 40),
                                            ::testing::Values(32, 96, 160, 256, 512, 992, 1056),
                                            ::testing::Values(1, 7, 13, 37)));
// The AMX path's blocking (kernels/x86/amx.cc): K blocks of 2048 columns, passes of 256 rows. 530
// rows x 2080 columns are three passes (the last a single tile pair, mostly padding) of two K
// blocks, the second a one-block short chunk, so accumulators are parked and reloaded. On the
// VNNI and NEON tiers the same shape walks the activation rows in blocks of 124
// (kernels/quant_kernels.h, prefill_tiles): four whole blocks and a last one of 34 rows that ends
// in a 2-row tile; AVX2 keeps each 4-row tile in L1 and passes the 45 weight rows by it.
INSTANTIATE_TEST_SUITE_P(AmxBlocking, QuantMatmul,
                         ::testing::Combine(::testing::Values(DType::Q8_0, DType::Q4_0),
                                            ::testing::Values(530), ::testing::Values(2080),
                                            ::testing::Values(45)));
// prefill_tiles' two loop orders on AVX2, on either side of their switch (4 rows of K codes in
// kRowTileBytes = 16 KiB): K = 4096 passes weight blocks by each 4-row tile. The two threads take
// the 301 rows in chunks of 32; Q8_0's 30-row blocks split each chunk in two (a 2-row last block),
// Q4_0's 56-row ones cover it whole. K = 4128 (a one-block tail chunk) walks activation blocks of
// 60 rows instead.
INSTANTIATE_TEST_SUITE_P(LoopOrders, QuantMatmul,
                         ::testing::Combine(::testing::Values(DType::Q8_0, DType::Q4_0),
                                            ::testing::Values(9, 70), ::testing::Values(4096, 4128),
                                            ::testing::Values(301)));

// Decode-shaped GEMV over a row count that splits unevenly across threads and the 8-row tiles.
TEST(QuantMatmulShapes, GemvManyRowsTwoThreads) {
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const int64_t K = 1536, N = 301;
    const auto x = randn(K, 31);
    const auto wf = randn(static_cast<size_t>(N * K), 32, 0.02f);
    const auto q = quantize_matrix(t, wf.data(), N, K);
    const WeightView w{"w", t, {N, K}, q.data(), q.size()};
    std::vector<float> a(N), b(N);
    ThreadPool p1(1), p2(2);
    matmul(p1, x.data(), 1, w, a.data());
    matmul(p2, x.data(), 1, w, b.data());
    for (int64_t r = 0; r < N; ++r) ASSERT_EQ(a[r], b[r]) << r;
  }
}

// A batched decode step multiplies one row per sequence at once; each sequence must get exactly
// what it gets decoding alone (greedy ids do not depend on who else is in the batch). Every tier,
// both formats, S on both sides of the streamed decode-sized path (kernels/quant_kernels.h,
// kStreamMaxRows = 8), an odd row count split over two threads, a width with a short last chunk.
TEST(QuantMatmulShapes, BatchedRowsEqualEachRowAlone) {
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const int64_t K = 1056, N = 301;
    const auto wf = randn(static_cast<size_t>(N * K), 81, 0.02f);
    const auto q = quantize_matrix(t, wf.data(), N, K);
    const WeightView w{"w", t, {N, K}, q.data(), q.size()};
    for (CpuTier tier : cpu_supported_tiers()) {
      ThreadPool pool(2, tier);
      for (int64_t S : {2, 3, 4, 5, 7, 8, 9, 16}) {
        const auto x = randn(static_cast<size_t>(S * K), 82 + static_cast<uint32_t>(S));
        std::vector<float> batched(static_cast<size_t>(S * N));
        quant_matmul(pool, x.data(), S, w, batched.data());
        std::vector<float> alone(static_cast<size_t>(N));
        for (int64_t s = 0; s < S; ++s) {
          quant_matmul(pool, x.data() + s * K, 1, w, alone.data());
          for (int64_t r = 0; r < N; ++r)
            ASSERT_EQ(batched[static_cast<size_t>(s * N + r)], alone[static_cast<size_t>(r)])
                << fmt(t) << " tier " << cpu_tier_name(tier) << " S=" << S << " row " << s
                << " out " << r;
        }
      }
    }
  }
}

// Prefill rows are shared out in chunks taken as threads come free (16-row groups for the
// tiles, 32-row strips for AMX), so which thread computes a row varies from run to run; the
// outputs must not. Every tier, both formats, row counts on the tile and AMX paths, an output
// count that splits into uneven chunks, and a width with a short last chunk and (on AMX) two K
// blocks.
TEST(QuantMatmulShapes, PrefillRowsDoNotDependOnTheThreadCount) {
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const int64_t K = 2080, N = 301;
    const auto wf = randn(static_cast<size_t>(N * K), 91, 0.02f);
    const auto q = quantize_matrix(t, wf.data(), N, K);
    const WeightView w{"w", t, {N, K}, q.data(), q.size()};
    for (CpuTier tier : cpu_supported_tiers()) {
      ThreadPool p1(1, tier), p2(2, tier), p3(3, tier);
      for (int64_t S : {int64_t{9}, kAmxMinRows + 5, 2 * kAmxMinRows + 3}) {
        const auto x = randn(static_cast<size_t>(S * K), 92 + static_cast<uint32_t>(S));
        std::vector<float> one(static_cast<size_t>(S * N)), two(one.size()), three(one.size());
        quant_matmul(p1, x.data(), S, w, one.data());
        quant_matmul(p2, x.data(), S, w, two.data());
        quant_matmul(p3, x.data(), S, w, three.data());
        for (size_t i = 0; i < one.size(); ++i) {
          ASSERT_EQ(two[i], one[i])
              << fmt(t) << " tier " << cpu_tier_name(tier) << " S=" << S << " at " << i;
          ASSERT_EQ(three[i], one[i])
              << fmt(t) << " tier " << cpu_tier_name(tier) << " S=" << S << " at " << i;
        }
      }
    }
  }
}

// Matrices sharing an input (Q/K/V, gate/up) run as one job and give exactly what each gives on
// its own: the row ranges of the stacked job fall across matrix boundaries at odd places.
TEST(QuantMatmulShapes, ManyMatricesOnOneInputMatchOneByOne) {
  ThreadPool pool(3);
  for (DType t : {DType::Q8_0, DType::Q4_0})
    for (int64_t S : {int64_t{1}, int64_t{3}, kAmxMinRows + 1}) {
      const int64_t K = 96;
      std::vector<std::vector<uint8_t>> q;
      std::vector<WeightView> w;
      for (int64_t N : {37, 5, 101}) {
        const auto wf = randn(static_cast<size_t>(N * K), 50 + static_cast<uint32_t>(N), 0.1f);
        q.push_back(quantize_matrix(t, wf.data(), N, K));
      }
      for (size_t i = 0; i < q.size(); ++i) {
        const int64_t N = static_cast<int64_t>(q[i].size() / quant_row_bytes(t, K));
        const char* names[] = {"q", "k", "v"};
        w.push_back(WeightView{names[i], t, {N, K}, q[i].data(), q[i].size()});
      }
      const auto x = randn(static_cast<size_t>(S * K), 60);
      std::vector<std::vector<float>> one(3), many(3);
      for (size_t i = 0; i < 3; ++i) {
        one[i].resize(static_cast<size_t>(S * w[i].rows()));
        many[i].assign(one[i].size(), NAN);
        matmul(pool, x.data(), S, w[i], one[i].data());
      }
      matmul_many(pool, x.data(), S,
                  {{w[0], many[0].data()}, {w[1], many[1].data()}, {w[2], many[2].data()}});
      for (size_t i = 0; i < 3; ++i)
        for (size_t j = 0; j < one[i].size(); ++j)
          ASSERT_EQ(many[i][j], one[i][j])
              << fmt(t) << " S=" << S << " matrix " << i << " at " << j;
    }
  // Matrices that each read their own input (a decode step's experts' down projections) in one
  // job, beside ones that read the shared input: each equals its own matmul, on every tier.
  for (CpuTier tier : cpu_supported_tiers()) {
    ThreadPool tier_pool(3, tier);
    for (DType t : {DType::Q8_0, DType::Q4_0})
      for (int64_t S : {int64_t{1}, int64_t{2}, kAmxMinRows + 1}) {
        const int64_t K = 544;  // 17 blocks: a whole chunk and a one-block tail
        std::vector<std::vector<uint8_t>> q;
        std::vector<WeightView> w;
        std::vector<std::vector<float>> xs;
        for (int64_t N : {19, 3, 45}) {
          const auto wf = randn(static_cast<size_t>(N * K), 80 + static_cast<uint32_t>(N), 0.1f);
          q.push_back(quantize_matrix(t, wf.data(), N, K));
          xs.push_back(randn(static_cast<size_t>(S * K), 90 + static_cast<uint32_t>(N)));
        }
        for (size_t i = 0; i < q.size(); ++i)
          w.push_back(WeightView{std::string(1, static_cast<char>('a' + i)),
                                 t,
                                 {static_cast<int64_t>(q[i].size() / quant_row_bytes(t, K)), K},
                                 q[i].data(),
                                 q[i].size()});
        const auto shared = randn(static_cast<size_t>(S * K), 99);
        std::vector<std::vector<float>> one(3), many(3);
        for (size_t i = 0; i < 3; ++i) {
          one[i].resize(static_cast<size_t>(S * w[i].rows()));
          many[i].assign(one[i].size(), NAN);
          // Matrix 1 reads the shared input, 0 and 2 their own.
          matmul(tier_pool, i == 1 ? shared.data() : xs[i].data(), S, w[i], one[i].data());
        }
        const QuantTarget targets[] = {{&w[0], many[0].data(), xs[0].data()},
                                       {&w[1], many[1].data()},
                                       {&w[2], many[2].data(), xs[2].data()}};
        quant_matmul_many(tier_pool, shared.data(), S, targets);
        for (size_t i = 0; i < 3; ++i)
          for (size_t j = 0; j < one[i].size(); ++j)
            ASSERT_EQ(many[i][j], one[i][j]) << fmt(t) << " tier " << cpu_tier_name(tier)
                                             << " S=" << S << " matrix " << i << " at " << j;
      }
  }
  // Different formats or widths cannot share one job: they run one by one, or fail by name.
  const auto wf = randn(64 * 7, 70, 0.1f);
  const auto q8 = quantize_matrix(DType::Q8_0, wf.data(), 7, 64);
  const auto q4 = quantize_matrix(DType::Q4_0, wf.data(), 7, 64);
  const WeightView a{"a", DType::Q8_0, {7, 64}, q8.data(), q8.size()};
  const WeightView b{"b", DType::Q4_0, {7, 64}, q4.data(), q4.size()};
  const WeightView f{"f", DType::F32, {7, 64}, wf.data(), wf.size() * 4};
  const auto x = randn(64, 71);
  std::vector<float> ya(7), yb(7), yf(7), ra(7), rb(7), rf(7);
  matmul_many(pool, x.data(), 1, {{a, ya.data()}, {b, yb.data()}, {f, yf.data()}});
  matmul(pool, x.data(), 1, a, ra.data());
  matmul(pool, x.data(), 1, b, rb.data());
  matmul(pool, x.data(), 1, f, rf.data());
  EXPECT_EQ(ya, ra);
  EXPECT_EQ(yb, rb);
  EXPECT_EQ(yf, rf);
  const QuantTarget mixed[] = {{&a, ya.data()}, {&b, yb.data()}};
  const std::string e = error_of([&] { quant_matmul_many(pool, x.data(), 1, mixed); });
  EXPECT_NE(e.find("b is Q4_0"), std::string::npos) << e;
}

// A zero activation row gives exact zeros (no 0/0 scale); a NaN activation poisons its outputs
// as a float matmul would, on every path.
TEST(QuantMatmulShapes, ZeroAndNanActivations) {
  for (DType t : {DType::Q8_0, DType::Q4_0})
    for (int64_t S : {int64_t{3}, kAmxMinRows + 4}) {
      const int64_t K = 96, N = 9;
      const auto wf = randn(static_cast<size_t>(N * K), 41, 0.1f);
      const auto q = quantize_matrix(t, wf.data(), N, K);
      const WeightView w{"w", t, {N, K}, q.data(), q.size()};
      auto x = randn(static_cast<size_t>(S * K), 42);
      for (int64_t k = 0; k < K; ++k) x[static_cast<size_t>(K + k)] = 0.0f;  // row 1 zero
      x[2 * K + 40] = NAN;                                                   // row 2 NaN
      for (CpuTier tier : cpu_supported_tiers()) {
        ThreadPool pool(2, tier);
        std::vector<float> y(static_cast<size_t>(S * N));
        quant_matmul(pool, x.data(), S, w, y.data());
        for (int64_t r = 0; r < N; ++r) {
          EXPECT_TRUE(std::isfinite(y[r]));
          EXPECT_EQ(y[N + r], 0.0f);
          EXPECT_TRUE(std::isnan(y[2 * N + r])) << cpu_tier_name(tier);
        }
      }
    }
}

// The i8mm tier's SMMLA prefill kernel (kernels/arm/quant_i8mm.h) against the dotprod tier's SDOT
// kernel: the same integer block dots, scaled and summed in the same order, so the same floats
// bit for bit; odd row counts, widths with a short last chunk and a short last quarter, weight
// strips cut short. A decoded row (which runs the SDOT kernel on the i8mm tier) equals the same
// row inside an SMMLA prefill, as the decoder's incremental-equals-recompute tests need.
TEST(QuantMatmulShapes, I8mmEqualsDotprodBitForBit) {
  if (!cpu_tier_supported(CpuTier::I8mm))
    GTEST_SKIP() << "this CPU has no i8mm (it has " << cpu_features_string() << ")";
  ThreadPool dot(2, CpuTier::Dotprod), mm(2, CpuTier::I8mm);
  EXPECT_STREQ(quant_isa(CpuTier::I8mm, 1), "neon-dotprod");
  EXPECT_STREQ(quant_isa(CpuTier::I8mm, 7), "neon-dotprod");
  EXPECT_STREQ(quant_isa(CpuTier::I8mm, 8), "neon-i8mm");
  struct Shape {
    int64_t S, K, N;
  };
  for (DType t : {DType::Q8_0, DType::Q4_0})
    for (const Shape sh : {Shape{8, 32, 7}, Shape{9, 96, 13}, Shape{13, 160, 1},
                           Shape{17, 1056, 37}, Shape{40, 992, 5}, Shape{70, 4128, 13}}) {
      const auto [S, K, N] = sh;
      auto x = randn(static_cast<size_t>(S * K), 61 + static_cast<uint32_t>(K));
      x[static_cast<size_t>(K / 2)] = 40.0f;
      const auto wf = varied(N, K, 62 + static_cast<uint32_t>(N));
      const auto q = quantize_matrix(t, wf.data(), N, K);
      const WeightView w{"w", t, {N, K}, q.data(), q.size()};
      std::vector<float> want(static_cast<size_t>(S * N)), got(want.size());
      quant_matmul(dot, x.data(), S, w, want.data());
      quant_matmul(mm, x.data(), S, w, got.data());
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(std::memcmp(&want[i], &got[i], sizeof(float)), 0)
            << fmt(t) << " S=" << S << " K=" << K << " N=" << N << " at " << i << ": dotprod "
            << want[i] << ", i8mm " << got[i];
      // Row 4 decoded alone on the i8mm tier (SDOT) against its place in the prefill (SMMLA).
      std::vector<float> row(static_cast<size_t>(N));
      quant_matmul(mm, x.data() + 4 * K, 1, w, row.data());
      for (int64_t r = 0; r < N; ++r)
        ASSERT_EQ(row[static_cast<size_t>(r)], got[static_cast<size_t>(4 * N + r)])
            << fmt(t) << " S=" << S << " K=" << K << " row " << r;
    }
}
