#include "io/npy.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "core/error.h"
#include "test_util.h"

using namespace gemstage;

TEST(Npy, ReadsFixtureIdsAndFloats) {
  const std::string dir = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/text/";
  const NpyArray ids = load_npy(dir + "input_ids.npy");
  EXPECT_EQ(ids.dtype, DType::I64);
  ASSERT_EQ(ids.shape, (Shape{24}));
  const NpyArray logits = load_npy(dir + "logits.npy");
  EXPECT_EQ(logits.dtype, DType::F32);
  EXPECT_EQ(logits.shape, (Shape{24, 2048}));
}

TEST(Npy, RoundTripsF32AndI64) {
  const std::filesystem::path tmp = gemstage::testing::temp_dir("npy_rt");
  const std::vector<float> f = {1.5f, -2.0f, 3.25f, 0.0f, 7.0f, 8.0f};
  save_npy_f32((tmp / "f.npy").string(), {2, 3}, f);
  const NpyArray a = load_npy((tmp / "f.npy").string());
  EXPECT_EQ(a.shape, (Shape{2, 3}));
  EXPECT_EQ(a.to_f32(), f);
  const std::vector<int64_t> i = {5, -1, 1ll << 40};
  save_npy_i64((tmp / "i.npy").string(), {3}, i);
  EXPECT_EQ(load_npy((tmp / "i.npy").string()).to_i64(), i);
}

TEST(Npy, RejectsTruncatedData) {
  const std::filesystem::path tmp = gemstage::testing::temp_dir("npy_trunc");
  const std::vector<float> f(100, 1.0f);
  const std::string p = (tmp / "t.npy").string();
  save_npy_f32(p, {100}, f);
  std::filesystem::resize_file(p, std::filesystem::file_size(p) - 8);
  try {
    load_npy(p);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}
