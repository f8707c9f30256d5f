// Shared helpers for tests: fixture paths, loading, and tolerance comparisons.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <limits>
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

// Largest |a[i] - b[i]|. Vectors of different sizes are a test failure (and infinitely far
// apart), so an empty or truncated result can never pass a tolerance.
inline double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) {
    ADD_FAILURE() << "max_abs_diff: comparing " << a.size() << " values with " << b.size();
    return std::numeric_limits<double>::infinity();
  }
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - b[i]));
  return m;
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
