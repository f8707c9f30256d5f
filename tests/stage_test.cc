// Staged bundles: splits, export, the checker (including hand-corrupted bundles), and that a
// pipeline of stages computes exactly what the unstaged model computes.
#include <gtest/gtest.h>

#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "stage/bundle.h"
#include "stage/partition.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;
namespace fs = std::filesystem;

namespace {

TextConfig preset_text(int L, int period, int shared) {
  TextConfig t;
  t.num_hidden_layers = L;
  t.num_kv_shared_layers = shared;
  for (int i = 0; i < L; ++i)
    t.layer_types.push_back(i % period == period - 1 ? LayerType::Full : LayerType::Sliding);
  derive_layer_specs(t, "test");
  return t;
}

TEST(Partition, E2BAndE4BValidCutPoints) {
  const TextConfig e2b = preset_text(35, 5, 20), e4b = preset_text(42, 6, 18);
  std::vector<int> want2, want4;
  for (int c = 1; c <= 13; ++c) want2.push_back(c);  // donors 13 and 14 serve layers 15..34
  for (int c = 1; c <= 22; ++c) want4.push_back(c);  // donors 22 and 23 serve layers 24..41
  EXPECT_EQ(valid_cut_points(e2b), want2);
  EXPECT_EQ(valid_cut_points(e4b), want4);
  EXPECT_NO_THROW(parse_stage_spec("0:21,21:42", e4b));
  EXPECT_NO_THROW(parse_stage_spec("0:13,13:35", e2b));
  const std::string msg = error_of([&] { parse_stage_spec("0:21,21:35", e2b); });
  EXPECT_NE(msg.find("reads the K/V of layer 13"), std::string::npos) << msg;
  EXPECT_NE(msg.find("valid cut points for this model are 1..13"), std::string::npos) << msg;
}

TEST(Partition, BalancedStageCountsUseValidCuts) {
  const TextConfig e4b = preset_text(42, 6, 18);
  const auto r = parse_stage_spec("2", e4b);
  ASSERT_EQ(r.size(), 2u);
  // By weight bytes: the KV-shared layers 24.. hold no k/v, so the midpoint falls before 21.
  EXPECT_EQ(r[0].end, 20);
  const auto r3 = parse_stage_spec("3", e4b);
  ASSERT_EQ(r3.size(), 3u);
  EXPECT_LE(r3[1].end, 22);
}

TEST(Partition, CoverageErrorsNameTheLayers) {
  const TextConfig t = preset_text(6, 3, 2);
  EXPECT_NE(
      error_of([&] { parse_stage_spec("0:2,3:6", t); }).find("layers 2 to 2 are not in any range"),
      std::string::npos);
  EXPECT_NE(error_of([&] { parse_stage_spec("0:3,2:6", t); }).find("overlaps"), std::string::npos);
  EXPECT_NE(error_of([&] { parse_stage_spec("0:2,2:5", t); }).find("must end at 6"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_stage_spec("0:2,x:6", t); }).find("not a range of two integers"),
            std::string::npos);
  EXPECT_NE(error_of([&] { parse_stage_spec("9", t); }).find("at most 3 transformer stages"),
            std::string::npos);
  const std::string donor = error_of([&] { parse_stage_spec("0:4,4:6", t); });
  EXPECT_NE(donor.find("layer 4 (KV-shared, sliding_attention) reads the K/V of layer 3"),
            std::string::npos)
      << donor;
}

std::string export_tiny(const std::string& name, const std::string& stages,
                        const std::string& weights) {
  const std::string out = temp_dir(name);
  ExportOptions opt;
  opt.stages = stages;
  opt.weights = weights;
  opt.max_context = 256;
  opt.progress = false;
  export_bundle(fixture("model"), out, opt);
  return out;
}

FloatTensor run_logits(Sequence& p, const std::vector<int32_t>& ids, int chunk,
                       std::vector<int64_t>* greedy, int n_decode) {
  ThreadPool pool(2);
  p.reset(256);
  FloatTensor all({static_cast<int64_t>(ids.size()), p.config().text.vocab_size});
  int64_t row = 0;
  FloatTensor last;
  for (size_t b = 0; b < ids.size(); b += static_cast<size_t>(chunk)) {
    const size_t n = std::min(static_cast<size_t>(chunk), ids.size() - b);
    last = p.forward(pool, std::span<const int32_t>(ids).subspan(b, n), nullptr, true, nullptr);
    std::copy(last.data.begin(), last.data.end(), all.row(row));
    row += static_cast<int64_t>(n);
  }
  const int64_t V = p.config().text.vocab_size;
  std::vector<float> r(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
  for (int s = 0; s < n_decode; ++s) {
    const int32_t best = static_cast<int32_t>(std::max_element(r.begin(), r.end()) - r.begin());
    greedy->push_back(best);
    const FloatTensor l =
        p.forward(pool, std::span<const int32_t>(&best, 1), nullptr, false, nullptr);
    r.assign(l.data.begin(), l.data.end());
  }
  return all;
}

class StagedEqualsUnstaged : public ::testing::TestWithParam<std::string> {};

TEST_P(StagedEqualsUnstaged, F32BundleLogitsAndGreedyIds) {
  const std::string bundle = export_tiny(
      "bundle_" + std::to_string(std::hash<std::string>{}(GetParam())), GetParam(), "f32");
  auto staged = Sequence::open(bundle, 256);
  auto unstaged = Sequence::open(fixture("model"), 256);
  EXPECT_TRUE(staged->is_bundle());
  const std::vector<int32_t> ids = load_ids(fixture("long/input_ids.npy"));
  std::vector<int64_t> g1, g2;
  const FloatTensor a = run_logits(*staged, ids, 7, &g1, 8);
  const FloatTensor b = run_logits(*unstaged, ids, 7, &g2, 8);
  EXPECT_LE(max_abs_diff(a.data, b.data), 1e-5);
  EXPECT_EQ(g1, g2);
  EXPECT_EQ(g1, load_npy(fixture("long/decode_ids.npy")).to_i64());
  std::ostringstream log;
  EXPECT_EQ(check_bundle(bundle, {}, log), 0) << log.str();
}

INSTANTIATE_TEST_SUITE_P(Splits, StagedEqualsUnstaged,
                         ::testing::Values("0:2,2:6", "0:1,1:6", "0:1,1:2,2:6", "1", "3"));

// A bf16 bundle of the f32 checkpoint rounds every weight to bf16 (RNE), which is exactly the
// fixture's BF16 checkpoint: its logits must match the bf16 golden outputs.
TEST(Bundle, Bf16BundleMatchesTheBf16Reference) {
  const std::string bundle = export_tiny("bundle_bf16", "0:2,2:6", "bf16");
  auto staged = Sequence::open(bundle, 256);
  const std::vector<int32_t> ids = load_ids(fixture("text_bf16/input_ids.npy"));
  std::vector<int64_t> greedy;
  const FloatTensor a = run_logits(*staged, ids, 24, &greedy, 8);
  expect_close(a, fixture("text_bf16/logits.npy"), 5e-4, "bf16 bundle logits");
  EXPECT_EQ(greedy, load_npy(fixture("text_bf16/decode_ids.npy")).to_i64());
}

// Each hand-corruption must fail `check` with a message that says what is wrong.
class CorruptBundle : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = export_tiny(
        "bundle_corrupt_" +
            std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()),
        "0:2,2:6", "f32");
  }
  nlohmann::json manifest() {
    return nlohmann::json::parse(std::ifstream(dir_ + "/manifest.json"));
  }
  void write_manifest(const nlohmann::json& j) {
    std::ofstream(dir_ + "/manifest.json") << j.dump(2);
  }
  std::string check_log() {
    std::ostringstream log;
    const int failures = check_bundle(dir_, {}, log);
    EXPECT_GT(failures, 0) << log.str();
    return log.str();
  }
  std::string dir_;
};

TEST_F(CorruptBundle, TransformerStageFedInputIds) {
  auto j = manifest();
  j["stages"][1]["contract"]["inputs"].push_back(
      {{"name", "input_ids"}, {"shape", {"S"}}, {"dtype", "i32"}, {"meaning", "raw ids"}});
  write_manifest(j);
  const std::string log = check_log();
  EXPECT_NE(log.find("stage 'layers_0_2' (transformer_layers) receives token ids ('input_ids')"),
            std::string::npos)
      << log;
  // The runtime refuses to run it too.
  EXPECT_NE(error_of([&] { Sequence::open(dir_); }).find("receives token ids"), std::string::npos);
}

TEST_F(CorruptBundle, TruncatedWeights) {
  fs::resize_file(dir_ + "/layers_2_6.gsw", fs::file_size(dir_ + "/layers_2_6.gsw") - 100);
  const std::string log = check_log();
  EXPECT_NE(log.find("layers_2_6.gsw is"), std::string::npos) << log;
  EXPECT_NE(log.find("truncated"), std::string::npos) << log;
  EXPECT_NE(error_of([&] { Sequence::open(dir_); }).find("truncated"), std::string::npos);
}

TEST_F(CorruptBundle, FlippedWeightByte) {
  {
    std::fstream f(dir_ + "/head.gsw", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-7, std::ios::end);
    f.put('\x5a');
  }
  const std::string log = check_log();
  EXPECT_NE(log.find("head.gsw does not match its SHA-256"), std::string::npos) << log;
}

TEST_F(CorruptBundle, EditedCopiedConfig) {
  std::ofstream(dir_ + "/config.json", std::ios::app) << "\n";
  const std::string log = check_log();
  EXPECT_NE(log.find("config.json does not match its SHA-256"), std::string::npos) << log;
}

TEST_F(CorruptBundle, LayerRangeEditedToSplitADonor) {
  auto j = manifest();
  j["stages"][1]["layers"] = {0, 4};
  j["stages"][2]["layers"] = {4, 6};
  write_manifest(j);
  const std::string log = check_log();
  EXPECT_NE(log.find("reads the K/V of layer 3"), std::string::npos) << log;
}

TEST_F(CorruptBundle, CacheTooSmallForTheDeclaredContext) {
  auto j = manifest();
  for (auto& g : j["stages"][2]["cache_groups"])
    if (g["kind"] == "full") g["capacity"] = 16;
  write_manifest(j);
  const std::string log = check_log();
  EXPECT_NE(log.find("full cache capacity 16 is below max_context 256"), std::string::npos) << log;
}

TEST_F(CorruptBundle, WrongSchemaVersionAndMissingFields) {
  auto j = manifest();
  j["schema_version"] = 99;
  write_manifest(j);
  EXPECT_NE(check_log().find("schema_version 99 is not supported"), std::string::npos);
  j = manifest();
  j["schema_version"] = 1;
  j["stages"][0].erase("weights");
  write_manifest(j);
  EXPECT_NE(check_log().find("stages[0] is missing 'weights'"), std::string::npos);
}

TEST_F(CorruptBundle, PerLayerSliceNotMatchingTheRange) {
  auto j = manifest();
  for (auto& in : j["stages"][2]["contract"]["inputs"])
    if (in["name"] == "per_layer_inputs") in["layer_slice"] = {1, 5};
  write_manifest(j);
  const std::string log = check_log();
  EXPECT_NE(log.find("takes per_layer_inputs layers 1:5 but runs layers 2:6"), std::string::npos)
      << log;
}

}  // namespace

namespace {

// With the image: a staged f32 bundle gives the unstaged model's logits and the fixture's ids.
TEST(Bundle, StagedMultimodalEqualsUnstagedAndTheFixture) {
  const std::string bundle = export_tiny("bundle_mm", "0:1,1:2,2:6", "f32");
  const std::string d = fixture("multimodal/");
  const std::vector<int32_t> ids = load_ids(d + "input_ids.npy");
  auto run = [&](Sequence& p, std::vector<int64_t>* greedy) {
    ThreadPool pool(2);
    p.reset(256);
    const auto images = vision_inputs_from_arrays(
        load_npy(d + "pixel_values.npy"), load_npy(d + "image_position_ids.npy"),
        p.vision()->patch_dim(), "pixel_values", "image_position_ids");
    const FloatTensor soft = p.vision()->encode_all(pool, images, nullptr);
    TapRecorder taps({"logits"});
    FloatTensor last = p.prefill(pool, ids, &soft, 7, true, &taps);
    const int64_t V = p.config().text.vocab_size;
    std::vector<float> r(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
    for (int s = 0; s < 8; ++s) {
      const int32_t best = static_cast<int32_t>(std::max_element(r.begin(), r.end()) - r.begin());
      greedy->push_back(best);
      const FloatTensor l =
          p.forward(pool, std::span<const int32_t>(&best, 1), nullptr, false, nullptr);
      r.assign(l.data.begin(), l.data.end());
    }
    return taps.get("logits");
  };
  auto staged = Sequence::open(bundle, 256);
  auto unstaged = Sequence::open(fixture("model"), 256);
  std::vector<int64_t> g1, g2;
  const FloatTensor a = run(*staged, &g1), b = run(*unstaged, &g2);
  EXPECT_LE(max_abs_diff(a.data, b.data), 1e-5);
  expect_close(a, d + "logits.npy", 5e-4, "staged multimodal logits");
  EXPECT_EQ(g1, g2);
  EXPECT_EQ(g1, load_npy(d + "decode_ids.npy").to_i64());
}

}  // namespace

namespace {

// Quantized bundles against the f32 model: logits error and teacher-forced top-1 agreement over
// the fixture's reference sequence. The tiny model has random (not quantization-aware) weights,
// so 4-bit is far from f32 here; the bounds are the measured values with a margin, and 8-bit
// must beat 4-bit.
struct QuantStats {
  double max_abs = 0;
  int agree = 0, n = 0;
};

QuantStats measure_bundle(const std::string& weights) {
  const std::string bundle = export_tiny("bundle_" + weights, "0:2,2:6", weights);
  auto q = Sequence::open(bundle, 256);
  auto ref = Sequence::open(fixture("model"), 256);
  // Quantized weights get a bf16 cache unless told otherwise; the f32 reference keeps f32.
  EXPECT_EQ(q->kv_type(), KvType::BF16);
  EXPECT_EQ(ref->kv_type(), KvType::F32);
  const std::vector<int32_t> seq = load_ids(fixture("long/sequence_ids.npy"));
  std::vector<int64_t> unused;
  const FloatTensor a = run_logits(*q, seq, 64, &unused, 0),
                    b = run_logits(*ref, seq, 64, &unused, 0);
  QuantStats s;
  s.max_abs = max_abs_diff(a.data, b.data);
  const int64_t V = a.dim(1);
  for (int64_t r = 0; r < a.dim(0); ++r) {
    const auto ia = std::max_element(a.row(r), a.row(r) + V) - a.row(r);
    const auto ib = std::max_element(b.row(r), b.row(r) + V) - b.row(r);
    s.agree += ia == ib;
    ++s.n;
  }
  std::ostringstream log;
  EXPECT_EQ(check_bundle(bundle, {}, log), 0) << log.str();
  return s;
}

TEST(Bundle, QuantizedBundlesAgainstF32) {
  const QuantStats q8 = measure_bundle("q8_0"), q4 = measure_bundle("q4_0");
  std::cout << "q8_0: logits max-abs " << q8.max_abs << ", teacher-forced top-1 " << q8.agree << "/"
            << q8.n << "\n"
            << "q4_0: logits max-abs " << q4.max_abs << ", teacher-forced top-1 " << q4.agree << "/"
            << q4.n << "\n";
  EXPECT_LE(q8.max_abs, 0.5);
  EXPECT_GE(q8.agree, q8.n * 3 / 4);
  EXPECT_LE(q4.max_abs, 2.0);
  EXPECT_GT(q8.agree, q4.agree);
  EXPECT_LT(q8.max_abs, q4.max_abs);
}

}  // namespace

namespace {

// Rolling the caches back and re-feeding gives exactly what a fresh run gives (chat turns whose
// re-rendered prompt diverges inside the cached reply rely on this).
TEST(Sequence, TruncateThenRefeedEqualsFreshRun) {
  for (KvType kv : {KvType::F32, KvType::BF16}) {
    SCOPED_TRACE(kv_type_name(kv));
    auto p = Sequence::open(fixture("model"), 256);
    p->set_kv_type(kv);
    EXPECT_EQ(p->kv_type(), kv);
    const std::vector<int32_t> seq =
        load_ids(fixture("long/sequence_ids.npy"));  // 40 ids, window 8
    ThreadPool pool(2);
    p->forward(pool, std::span<const int32_t>(seq).first(36), nullptr, false, nullptr);
    ASSERT_TRUE(p->truncate(21));
    EXPECT_EQ(p->n_past(), 21);
    const FloatTensor a =
        p->forward(pool, std::span<const int32_t>(seq).subspan(21, 19), nullptr, true, nullptr);
    p->reset();
    const FloatTensor b = p->forward(pool, seq, nullptr, true, nullptr);
    const std::vector<float> tail(b.data.end() - static_cast<std::ptrdiff_t>(a.data.size()),
                                  b.data.end());
    EXPECT_LE(max_abs_diff(a.data, tail), 1e-6);
    EXPECT_FALSE(p->truncate(100));
  }
}

TEST(Sequence, Bf16CheckpointKeepsAnF32Cache) {
  // bf16 weights compute in f32, as the reference does; only quantized weights default to bf16.
  EXPECT_EQ(Sequence::open(fixture("model_bf16"), 64)->kv_type(), KvType::F32);
}

}  // namespace
