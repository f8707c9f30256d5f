// The comparison helpers of test_util.h can fail: a NaN or an infinity on either side, an empty
// result and a size mismatch are failures, never distances that pass a tolerance.
#include "test_util.h"

#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

using namespace gemstage;
using gemstage::testing::compare_values;
using gemstage::testing::expect_close;
using gemstage::testing::fixture;
using gemstage::testing::max_abs_diff;
using gemstage::testing::max_abs_diff_rows;

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

// The gtest failures fn records, captured instead of failing this test.
int failures_of(const std::function<void()>& fn) {
  ::testing::TestPartResultArray results;
  {
    ::testing::ScopedFakeTestPartResultReporter reporter(
        ::testing::ScopedFakeTestPartResultReporter::INTERCEPT_ONLY_CURRENT_THREAD, &results);
    fn();
  }
  int failed = 0;
  for (int i = 0; i < results.size(); ++i) failed += results.GetTestPartResult(i).failed() ? 1 : 0;
  return failed;
}

std::string problem_of(std::vector<float> a, std::vector<float> b) {
  return compare_values<float>(a, b).problem;
}

}  // namespace

TEST(CompareValues, MeasuresTheLargestDifference) {
  const auto c = compare_values<float>(std::vector<float>{1, 2, 3}, std::vector<float>{1, 2.5f, 2});
  EXPECT_EQ(c.problem, "");
  EXPECT_EQ(c.max_abs, 1.0);
}

TEST(CompareValues, NaNInfinityEmptyAndSizeMismatchAreProblems) {
  EXPECT_NE(problem_of({1, kNaN, 3}, {1, 2, 3}).find("value 1 is nan vs 2"), std::string::npos);
  EXPECT_NE(problem_of({1, 2, 3}, {1, 2, kNaN}).find("value 2 is 3 vs nan"), std::string::npos);
  EXPECT_NE(problem_of({kNaN}, {kNaN}), "");
  EXPECT_NE(problem_of({kInf}, {kInf}), "");
  EXPECT_NE(problem_of({1}, {-kInf}), "");
  EXPECT_EQ(problem_of({}, {}), "both sides are empty");
  EXPECT_EQ(problem_of({1, 2}, {1}), "comparing 2 values with 1");
  EXPECT_EQ(problem_of({}, {1}), "comparing 0 values with 1");
}

TEST(MaxAbsDiff, RecordsAFailureAndReturnsNaNOnEveryProblem) {
  const std::vector<float> zero = {0.0f}, a_nan = {kNaN}, an_inf = {kInf}, none;
  double d = 0;
  EXPECT_EQ(failures_of([&] { d = max_abs_diff(a_nan, zero); }), 1);
  EXPECT_TRUE(std::isnan(d));
  EXPECT_EQ(failures_of([&] { d = max_abs_diff(none, none); }), 1);
  EXPECT_TRUE(std::isnan(d));
  EXPECT_EQ(failures_of([&] {
              d = max_abs_diff(std::vector<double>{1, 2}, std::vector<double>{1});
            }),
            1);
  EXPECT_TRUE(std::isnan(d));
  // The NaN it returns fails the tolerance a caller puts on it, and a "must differ" check too.
  EXPECT_EQ(failures_of([&] { EXPECT_LE(max_abs_diff(a_nan, zero), 1.0); }), 2);
  EXPECT_EQ(failures_of([&] { EXPECT_GT(max_abs_diff(an_inf, zero), 0.1); }), 2);
  EXPECT_EQ(failures_of([&] {
              d = max_abs_diff(std::vector<float>{1, 2}, std::vector<float>{1, 2.25f});
            }),
            0);
  EXPECT_EQ(d, 0.25);
}

TEST(MaxAbsDiffRows, ComparesTheLeadingRowsAndRefusesBadShapes) {
  FloatTensor a({3, 2}), b({2, 2});
  a.data = {1, 2, 3, 4, 5, 6};
  b.data = {1, 2, 3, 4.5f};
  double d = 0;
  EXPECT_EQ(failures_of([&] { d = max_abs_diff_rows(a, b, 2); }), 0);
  EXPECT_EQ(d, 0.5);
  EXPECT_EQ(failures_of([&] { d = max_abs_diff_rows(a, b, 3); }), 1);  // b has 2 rows
  EXPECT_EQ(failures_of([&] { d = max_abs_diff_rows(a, b); }), 1);     // all rows: sizes differ
  EXPECT_EQ(failures_of([&] { d = max_abs_diff_rows(a, FloatTensor({3, 3}), 1); }), 1);
  EXPECT_EQ(failures_of([&] {
              d = max_abs_diff_rows(FloatTensor({0, 2}), FloatTensor({0, 2}));
            }),
            1);
  EXPECT_TRUE(std::isnan(d));
}

// A golden comparison as the parity tests make it: the golden itself passes at distance 0, and
// the same values with one NaN injected fail, whatever the tolerance.
TEST(ExpectClose, ANaNInjectedIntoAGoldenComparisonFails) {
  const std::string golden = fixture("text/logits.npy");
  const NpyArray ref = load_npy(golden);
  FloatTensor got(ref.shape);
  got.data = ref.to_f32();
  ASSERT_FALSE(got.data.empty());
  EXPECT_EQ(failures_of([&] { expect_close(got, golden, 0.0, "logits"); }), 0);
  got.data[got.data.size() / 2] = kNaN;
  EXPECT_GE(failures_of([&] { expect_close(got, golden, 1e30, "logits"); }), 1);
  got.data[got.data.size() / 2] = kInf;
  EXPECT_GE(failures_of([&] { expect_close(got, golden, 1e30, "logits"); }), 1);
  FloatTensor empty({0});
  EXPECT_GE(failures_of([&] { expect_close(empty, golden, 1e30, "logits"); }), 1);
}
