// The tiny Gemma 4 decoder exported with every matrix (embeddings, PLE table, projections, tied LM
// head) stored as Q8_0 / Q4_0: the readers and matmul dispatch work end to end.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <memory>

#include "core/cpu_features.h"
#include "kernels/matmul.h"
#include "kernels/quant.h"
#include "stage/bundle.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

double cosine(const std::vector<float>& a, const std::vector<float>& b) {
  double ab = 0, aa = 0, bb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ab += static_cast<double>(a[i]) * b[i];
    aa += static_cast<double>(a[i]) * a[i];
    bb += static_cast<double>(b[i]) * b[i];
  }
  return ab / std::sqrt(aa * bb);
}

// The tiny model exported as a bundle with every matrix (embeddings, PLE table, projections,
// tied LM head) stored as t: the path users run.
std::string quantized_bundle(DType t) {
  const std::string dir = temp_dir("quant_model_" + std::string(dtype_name(t)));
  ExportOptions o;
  o.stages = "2";
  o.weights = t == DType::Q8_0 ? "q8_0" : "q4_0";
  o.ple_weights = "int8";
  o.progress = false;
  export_bundle(fixture("model"), dir, o);
  return dir;
}

double min_row_cosine(const FloatTensor& a, const FloatTensor& b) {
  double m = 1;
  const int64_t V = a.dim(1);
  for (int64_t r = 0; r < a.dim(0); ++r)
    m = std::min(m, cosine(std::vector<float>(a.row(r), a.row(r) + V),
                           std::vector<float>(b.row(r), b.row(r) + V)));
  return m;
}

}  // namespace

// The tiny model's random weights make its logits very sensitive: bf16-rounding the weights
// alone gives a row cosine of ~0.998 against f32, Q8_0's ~3x larger weight error (0.54% vs
// 0.17% relative RMS) ~0.95, and Q4_0 (no QAT) decorrelates them. So this checks plumbing and
// ordering, not accuracy: the run is finite, Q8_0 tracks f32 (cos >= 0.9) better than Q4_0, and
// the SIMD kernels agree with the scalar path (cos >= 0.995). Per call the two agree to ~2e-7;
// end to end they drift further because a last-bit difference can flip an activation's int8
// code in the next layer.
TEST(QuantModel, RunsEndToEndWithQuantizedMatricesAndTables) {
  const std::vector<int32_t> ids = load_ids(fixture("long/input_ids.npy"));
  // f32 KV rows throughout, so only the weights' format differs between the runs.
  auto run = [&](const std::shared_ptr<const Model>& model, CpuTier tier = cpu_best_tier()) {
    ThreadPool pool(2, tier);
    Sequence seq(model, 256, KvType::F32);
    return seq.forward(pool, ids, nullptr, true, nullptr);
  };
  const FloatTensor want = run(Model::open(fixture("model")));
  double cos[2];
  for (DType t : {DType::Q8_0, DType::Q4_0}) {
    const auto text = Model::open(quantized_bundle(t));
    EXPECT_EQ(text->stages()[1]->text().weights().layers[0].q_proj.dtype, t);
    // The int8 kernels: the best tier short of AMX tiles.
    const CpuTier int8_tier = cpu_best_tier() == CpuTier::Amx ? CpuTier::Avx512 : cpu_best_tier();
    const FloatTensor got = run(text, int8_tier);
    ASSERT_EQ(got.shape, want.shape);
    for (float v : got.data) ASSERT_TRUE(std::isfinite(v));
    const FloatTensor scalar = run(text, CpuTier::Scalar);
    const double self = min_row_cosine(scalar, got);
    EXPECT_GE(self, 0.995) << dtype_name(t);
    std::printf("%s: SIMD vs scalar min row cosine %.6f, max-abs %.4g\n",
                std::string(dtype_name(t)).c_str(), self, max_abs_diff(got.data, scalar.data));
    cos[t == DType::Q8_0 ? 0 : 1] = min_row_cosine(want, got);
    // The prefill on AMX tiles (bf16 operands instead of int8 activations) must track f32 at
    // least about as well as the int8 kernels do.
    if (cpu_tier_supported(CpuTier::Amx)) {
      const FloatTensor tiles = run(text, CpuTier::Amx);
      for (float v : tiles.data) ASSERT_TRUE(std::isfinite(v));
      const double amx_cos = min_row_cosine(want, tiles);
      std::printf("%s: AMX prefill min row cosine vs f32 %.4f (int8 kernels %.4f)\n",
                  std::string(dtype_name(t)).c_str(), amx_cos, cos[t == DType::Q8_0 ? 0 : 1]);
      EXPECT_GE(amx_cos, cos[t == DType::Q8_0 ? 0 : 1] - 0.02) << dtype_name(t);
    }
  }
  EXPECT_GE(cos[0], 0.9);
  EXPECT_GT(cos[0], cos[1]);
  std::printf("min row cosine vs f32: Q8_0 %.4f, Q4_0 %.4f\n", cos[0], cos[1]);
}
