// Shared helpers for tests: fixture paths, loading, and tolerance comparisons.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"
#include "io/npy.h"

namespace gemstage::testing {

inline std::string fixture(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/" + rel;
}

inline std::vector<int32_t> load_ids(const std::string& path) {
  std::vector<int32_t> out;
  for (int64_t v : load_npy(path).to_i64()) out.push_back(static_cast<int32_t>(v));
  return out;
}

// Removes the directories temp_dir made when the test process exits, so a suite run leaves
// none of its exported bundles and checkpoints in /tmp. GEMSTAGE_KEEP_TEST_DIRS=1 keeps them
// for a post-mortem.
class TempDirRegistry {
 public:
  static TempDirRegistry& instance() {
    static TempDirRegistry registry;
    return registry;
  }
  void add(const std::filesystem::path& p) { dirs_.push_back(p); }
  ~TempDirRegistry() {
    if (std::getenv("GEMSTAGE_KEEP_TEST_DIRS") != nullptr) return;
    std::error_code ignored;
    for (const auto& d : dirs_) std::filesystem::remove_all(d, ignored);
  }

 private:
  std::vector<std::filesystem::path> dirs_;
};

inline std::string temp_dir(const std::string& name) {
  // Per process, so the release and sanitizer suites (or parallel ctest runs) never collide.
  const auto p = std::filesystem::temp_directory_path() /
                 ("gemstage_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  TempDirRegistry::instance().add(p);
  return p.string();
}

// The message of the gemstage::Error that fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// How far apart two sequences of values are: the largest |a[i] - b[i]|, or why no tolerance
// can judge them. Two empty sequences, sequences of different sizes, and a NaN or an infinity
// on either side are problems, not distances: std::max(m, NaN) keeps m, so a plain running
// maximum would let a NaN result (or an empty one) pass any tolerance.
struct ValueComparison {
  double max_abs = 0;
  std::string problem;  // empty when the two are comparable
};

template <typename T>
ValueComparison compare_values(std::span<const T> a, std::span<const T> b) {
  ValueComparison c;
  if (a.size() != b.size()) {
    c.problem =
        "comparing " + std::to_string(a.size()) + " values with " + std::to_string(b.size());
    return c;
  }
  if (a.empty()) {
    c.problem = "both sides are empty";
    return c;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) {
      std::ostringstream what;
      what << "value " << i << " is " << a[i] << " vs " << b[i]
           << " (a NaN or an infinity is never within a tolerance)";
      c.problem = what.str();
      return c;
    }
    c.max_abs = std::max(c.max_abs, std::fabs(static_cast<double>(a[i]) - b[i]));
  }
  return c;
}

// The largest |a[i] - b[i]|. Where compare_values finds a problem, records a test failure that
// names it and returns NaN, which fails every EXPECT_LE / EXPECT_GT / EXPECT_EQ put on the result
// (an expected difference included: a NaN is not "far enough apart").
template <typename T>
double max_abs_diff_of(std::span<const T> a, std::span<const T> b) {
  const ValueComparison c = compare_values(a, b);
  if (!c.problem.empty()) {
    ADD_FAILURE() << "max_abs_diff: " << c.problem;
    return std::numeric_limits<double>::quiet_NaN();
  }
  return c.max_abs;
}
inline double max_abs_diff(std::span<const float> a, std::span<const float> b) {
  return max_abs_diff_of(a, b);
}
inline double max_abs_diff(std::span<const double> a, std::span<const double> b) {
  return max_abs_diff_of(a, b);
}

// max_abs_diff over the first n_rows rows of two tensors of one row width (all rows, and as many
// of them, when n_rows < 0). A tensor without rows, unequal widths or too few rows fail the test.
inline double max_abs_diff_rows(const FloatTensor& a, const FloatTensor& b, int64_t n_rows = -1) {
  const auto refuse = [&](const std::string& why) {
    ADD_FAILURE() << "max_abs_diff_rows: " << shape_str(a.shape) << " vs " << shape_str(b.shape)
                  << ": " << why;
    return std::numeric_limits<double>::quiet_NaN();
  };
  if (a.shape.empty() || b.shape.empty() || a.dim(0) <= 0 || b.dim(0) <= 0)
    return refuse("a tensor has no rows");
  const int64_t width = a.numel() / a.dim(0);
  if (width != b.numel() / b.dim(0)) return refuse("row widths differ");
  if (n_rows < 0) {
    if (a.numel() != b.numel()) return refuse("sizes differ");
    n_rows = a.dim(0);
  }
  if (n_rows > a.dim(0) || n_rows > b.dim(0))
    return refuse("fewer than the " + std::to_string(n_rows) + " rows compared");
  const auto n = static_cast<size_t>(n_rows * width);
  return max_abs_diff(std::span<const float>(a.data).first(n),
                      std::span<const float>(b.data).first(n));
}

// Expects `got` to match the reference .npy in shape and within atol.
inline void expect_close(const FloatTensor& got, const std::string& ref_path, double atol,
                         const std::string& what) {
  const NpyArray ref = load_npy(ref_path);
  ASSERT_EQ(got.shape, ref.shape) << what << ": shape mismatch vs " << ref_path;
  const double d = max_abs_diff(got.data, ref.to_f32());
  EXPECT_LE(d, atol) << what << ": max-abs " << d << " exceeds " << atol << " (" << ref_path << ")";
}

}  // namespace gemstage::testing
