// The large Gemma 4 models (26B-A4B: mixture of experts; 31B: dense, both attention_k_eq_v on
// full layers, no PLE) against their golden fixtures (tests/fixtures/gemma4-tiny-moe and
// gemma4-tiny-dense, an independent reference of the transformers forward; docs in
// docs/gemma4-large.md): every tap within the manifest's tolerance, the experts each
// row chose exact, greedy ids exact, on whole-prompt and chunked prefill.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <sstream>
#include <tuple>

#include "core/error.h"
#include "core/host_tensor.h"
#include "gemma4/config.h"
#include "gemma4/multimodal.h"
#include "gemma4/presets.h"
#include "gemma4/vision_model.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "io/mapped_file.h"
#include "io/npy.h"
#include "kernels/experts.h"
#include "kernels/quant.h"
#include "kernels/weight_rows.h"
#include "stage/bundle.h"
#include "stage/partition.h"
#include "stage/sequence.h"
#include "stage/weights_file.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

std::string large_fixture(const std::string& set, const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/" + set + "/" + rel;
}

struct Case {
  const char* set;
  const char* fixture;
  const char* model;
  int chunk;  // 0: whole prompt
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::string s = std::string(info.param.set) + "_" + info.param.fixture + "_chunk" +
                  std::to_string(info.param.chunk);
  for (char& ch : s)
    if (ch == '-') ch = '_';
  return s;
}

// The manifests' tolerances (f32 reference; the *_bf16 fixtures are the same f32 reference on
// bf16-rounded weights, which is what gemstage computes too). router_topk_weights: the blanket
// 1e-5 sits at the reference's own float32 noise on that tap (its f32-vs-f64 difference is
// 8.5e-6 on `long`, and tolerances_atol_computed, 20x that floor, is 2e-4); we measure up to
// 1.2e-5 in the last layer of `long`, so it is held to 2e-5, still 10x under the computed one.
// router_probs likewise (the reference's own f32-vs-f64 difference is 1.3e-5 on `multimodal`).
const std::vector<std::pair<std::string, double>> kTapTolerances = {
    {"embeds_scaled", 1e-6},    {"inputs_embeds", 5e-5}, {"hidden_after_attn", 1e-2},
    {"hidden_after_mlp", 1e-2}, {"hidden_states", 1e-2}, {"final_hidden", 2e-3},
    {"logits", 5e-4},           {"router_probs", 2e-5},  {"router_topk_weights", 2e-5}};

// Greedy decode with the KV cache from the prefill's last logits: ids exact, logits in tolerance.
void expect_greedy_decode(ThreadPool& pool, Sequence& seq, const FloatTensor& last,
                          const std::string& dir) {
  const std::vector<int64_t> want_ids = load_npy(dir + "decode_ids.npy").to_i64();
  const std::vector<float> want_logits = load_npy(dir + "decode_logits.npy").to_f32();
  const int64_t V = seq.config().text.vocab_size;
  std::vector<float> row(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
  for (size_t step = 0; step < want_ids.size(); ++step) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (row[static_cast<size_t>(i)] > row[static_cast<size_t>(best)]) best = i;
    EXPECT_EQ(best, want_ids[step]) << "decode step " << step;
    const std::vector<float> want_row(want_logits.begin() + static_cast<int64_t>(step) * V,
                                      want_logits.begin() + static_cast<int64_t>(step + 1) * V);
    EXPECT_LE(max_abs_diff(row, want_row), 5e-4) << "decode_logits step " << step;
    const int32_t next = static_cast<int32_t>(want_ids[step]);
    FloatTensor l = seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr);
    row.assign(l.row(0), l.row(0) + V);
  }
}

class LargeTextParity : public ::testing::TestWithParam<Case> {};

TEST_P(LargeTextParity, EveryTapWithinToleranceExpertsAndGreedyDecodeExact) {
  const Case c = GetParam();
  auto seq = Sequence::open(large_fixture(c.set, c.model), 256);
  const std::string dir = large_fixture(c.set, c.fixture) + "/";
  const std::vector<int32_t> ids = load_ids(dir + "input_ids.npy");
  ThreadPool pool(2);
  TapRecorder taps({"all"});
  const size_t chunk = c.chunk > 0 ? static_cast<size_t>(c.chunk) : ids.size();
  FloatTensor last;
  for (size_t b = 0; b < ids.size(); b += chunk)
    last = seq->forward(pool,
                        std::span<const int32_t>(ids).subspan(b, std::min(chunk, ids.size() - b)),
                        nullptr, true, &taps);
  int compared = 0;
  for (const auto& [tap, atol] : kTapTolerances) {
    if (!std::filesystem::exists(dir + tap + ".npy")) continue;
    expect_close(taps.get(tap), dir + tap + ".npy", atol, tap);
    ++compared;
  }
  EXPECT_GE(compared, 2);
  if (std::filesystem::exists(dir + "router_topk_ids.npy")) {
    EXPECT_EQ(taps.get_ids("router_topk_ids"), load_npy(dir + "router_topk_ids.npy").to_i64());
  } else {
    EXPECT_FALSE(taps.has("router_topk_ids")) << "a dense model ran a router";
  }
  if (std::filesystem::exists(dir + "llm_input_ids.npy")) {
    EXPECT_EQ(taps.get_ids("llm_input_ids"), load_npy(dir + "llm_input_ids.npy").to_i64());
  }
  expect_greedy_decode(pool, *seq, last, dir);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, LargeTextParity,
                         ::testing::Values(Case{"gemma4-tiny-moe", "text", "model", 0},
                                           Case{"gemma4-tiny-moe", "text", "model", 5},
                                           Case{"gemma4-tiny-moe", "long", "model", 0},
                                           Case{"gemma4-tiny-moe", "long", "model", 1},
                                           Case{"gemma4-tiny-moe", "long", "model", 7},
                                           Case{"gemma4-tiny-moe", "text_bf16", "model_bf16", 0},
                                           Case{"gemma4-tiny-dense", "text", "model", 0},
                                           Case{"gemma4-tiny-dense", "text", "model", 5},
                                           Case{"gemma4-tiny-dense", "long", "model", 0},
                                           Case{"gemma4-tiny-dense", "long", "model", 9},
                                           Case{"gemma4-tiny-dense", "text_bf16", "model_bf16", 0}),
                         case_name);

// ---------------------------------------------------------------------------------------------
// Images: the large vision tower (standardize, no clip bounds), the bidirectional image block on
// sliding layers, chunked prefill that keeps an image whole.

FloatTensor load_f32(const std::string& path) {
  const NpyArray a = load_npy(path);
  FloatTensor t;
  t.shape = a.shape;
  t.data = a.to_f32();
  return t;
}

struct MmCase {
  const char* set;
  int chunk;  // 0: whole prompt
};

class LargeMultimodal : public ::testing::TestWithParam<MmCase> {};

TEST_P(LargeMultimodal, VisionTapsImageBlockExpertsAndGreedyDecodeMatch) {
  const MmCase c = GetParam();
  const std::string dir = large_fixture(c.set, "multimodal/");
  auto seq = Sequence::open(large_fixture(c.set, "model"), 256);
  const ModelConfig& cfg = seq->config();
  ASSERT_TRUE(seq->vision());
  // image.png through the processor (do_resize false) gives the fixture's pixels exactly.
  const ImageProcessorConfig pc = load_processor_config(large_fixture(c.set, "model"));
  EXPECT_FALSE(pc.do_resize);
  const ProcessedImage pi = preprocess_image(decode_image_file(dir + "image.png"), pc);
  const FloatTensor want_pixels = load_f32(dir + "pixel_values.npy");
  ASSERT_EQ(pi.pixel_values, want_pixels.data);
  const std::vector<int64_t> want_pos = load_npy(dir + "image_position_ids.npy").to_i64();
  ASSERT_EQ(pi.position_ids, want_pos);

  ThreadPool pool(2);
  TapRecorder taps({"all"});
  const FloatTensor soft = seq->vision()->encode_all(
      pool, {VisionInput{pi.max_patches, pi.pixel_values, pi.position_ids}}, &taps);
  const std::vector<int32_t> ids = load_ids(dir + "input_ids.npy");
  // The image block's groups are the runs of mm_token_type_ids 1.
  const std::vector<int64_t> mm = load_npy(dir + "mm_token_type_ids.npy").to_i64();
  const std::vector<int32_t> groups = vision_groups(cfg, ids);
  ASSERT_EQ(groups.size(), mm.size());
  for (size_t r = 0; r < mm.size(); ++r) EXPECT_EQ(groups[r] >= 0, mm[r] == 1) << "row " << r;

  const FloatTensor last = seq->prefill(pool, ids, &soft, c.chunk, true, &taps);
  const int64_t n_patches = pi.num_patches;
  EXPECT_LE(max_abs_diff_rows(taps.get("vision_patch_embeds"),
                              load_f32(dir + "vision_patch_embeds.npy"), n_patches),
            5e-5);
  EXPECT_LE(max_abs_diff_rows(taps.get("vision_encoder_out"),
                              load_f32(dir + "vision_encoder_out.npy"), n_patches),
            5e-5);
  for (const char* tap : {"vision_embedder_out", "inputs_embeds"})
    expect_close(taps.get(tap), dir + tap + ".npy", 5e-5, tap);
  // vision_pooled is the encoder output averaged and times sqrt(Hv) (~7 here), which scales the
  // encoder's float32 noise past the blanket 5e-5; held to 5e-4 as the E-series test holds it.
  expect_close(taps.get("vision_pooled"), dir + "vision_pooled.npy", 5e-4, "vision_pooled");
  expect_close(taps.get("hidden_states"), dir + "hidden_states.npy", 1e-2, "hidden_states");
  expect_close(taps.get("final_hidden"), dir + "final_hidden.npy", 2e-3, "final_hidden");
  expect_close(taps.get("logits"), dir + "logits.npy", 5e-4, "logits");
  if (cfg.text.enable_moe_block) {
    // The multimodal manifest's tolerances_atol_computed puts both router taps at 5e-4, 20x the
    // reference's own float32-vs-float64 difference, so that difference is 2.5e-5: a 2e-5 gate
    // sat under it. aarch64's NEON summation order measures 2.2e-5 on router_topk_weights (the x86
    // tiers stay under 2e-5); 5e-5 is twice the reference's noise and still 10x under the computed
    // gate.
    expect_close(taps.get("router_probs"), dir + "router_probs.npy", 5e-5, "router_probs");
    expect_close(taps.get("router_topk_weights"), dir + "router_topk_weights.npy", 5e-5,
                 "router_topk_weights");
    EXPECT_EQ(taps.get_ids("router_topk_ids"), load_npy(dir + "router_topk_ids.npy").to_i64());
  }
  // The known-wrong variants (no image block; the block on full layers too) are far away.
  const std::vector<float> logits = taps.get("logits").data;
  for (const char* wrong : {"logits_vision_causal.npy", "logits_vision_full_layers.npy"})
    EXPECT_GT(max_abs_diff(logits, load_npy(dir + wrong).to_f32()), 0.1) << wrong;
  expect_greedy_decode(pool, *seq, last, dir);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, LargeMultimodal,
    ::testing::Values(MmCase{"gemma4-tiny-moe", 0}, MmCase{"gemma4-tiny-moe", 5},
                      MmCase{"gemma4-tiny-moe", 11}, MmCase{"gemma4-tiny-dense", 0},
                      MmCase{"gemma4-tiny-dense", 10}),
    [](const ::testing::TestParamInfo<MmCase>& p) {
      std::string s = std::string(p.param.set) + "_chunk" + std::to_string(p.param.chunk);
      for (char& ch : s)
        if (ch == '-') ch = '_';
      return s;
    });

// A chunk boundary that falls inside an image moves before it, or after it when the image
// starts the chunk; the E-series (causal) keeps every boundary.
TEST(LargeMultimodal, ChunksNeverSplitAnImage) {
  const ModelConfig cfg = load_model_config(large_fixture("gemma4-tiny-moe", "model"));
  const std::vector<int32_t> ids =
      load_ids(large_fixture("gemma4-tiny-moe", "multimodal/input_ids.npy"));
  int64_t first = -1, last = -1;
  for (size_t r = 0; r < ids.size(); ++r)
    if (ids[r] == cfg.image_token_id) {
      if (first < 0) first = static_cast<int64_t>(r);
      last = static_cast<int64_t>(r);
    }
  ASSERT_GT(last, first + 2);
  EXPECT_EQ(chunk_end_keeping_images_whole(cfg, ids, 0, first + 2), first);
  EXPECT_EQ(chunk_end_keeping_images_whole(cfg, ids, first, first + 2), last + 1);
  EXPECT_EQ(chunk_end_keeping_images_whole(cfg, ids, 0, first), first);
  EXPECT_EQ(chunk_end_keeping_images_whole(cfg, ids, 0, last + 1), last + 1);
  ModelConfig causal = cfg;
  causal.text.bidirectional_vision = false;
  EXPECT_EQ(chunk_end_keeping_images_whole(causal, ids, 0, first + 2), first + 2);
}

// ---------------------------------------------------------------------------------------------
// Expert kernels and bundles.

// The grouped experts against a double-precision reference over the same stored weights
// (dequantized row by row), for every weight format; experts no row chose are never read.
TEST(Experts, GroupedForwardMatchesReferenceInEveryFormatAndReadsOnlyChosenExperts) {
  const int64_t E = 6, I = 32, D = 64, S = 9, K = 2;
  std::vector<float> gu(static_cast<size_t>(E * 2 * I * D)), dn(static_cast<size_t>(E * D * I)),
      x(static_cast<size_t>(S * D));
  uint64_t st = 12345;
  auto rnd = [&] {
    st = st * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<float>(static_cast<double>(st >> 11) / 9007199254740992.0 - 0.5);
  };
  for (float& v : gu) v = rnd() * 0.2f;
  for (float& v : dn) v = rnd() * 0.2f;
  for (float& v : x) v = rnd() * 2.0f;
  // Rows choose experts 0, 2 and 5 only (descending weight order, any id order).
  const std::vector<int32_t> ids = {2, 0, 5, 2, 0, 5, 2, 5, 0, 2, 5, 0, 2, 0, 5, 2, 0, 5};
  std::vector<float> w(static_cast<size_t>(S * K));
  for (float& v : w) v = 0.3f + std::fabs(rnd());
  for (DType dt : {DType::F32, DType::BF16, DType::Q8_0, DType::Q4_0}) {
    // Stored bytes of a stacked tensor: rows converted one by one.
    auto store = [&](const std::vector<float>& src, Shape shape, std::vector<uint8_t>& bytes) {
      const int64_t cols = shape.back(), rows = shape_numel(shape) / cols;
      const size_t rb = dtype_is_quantized(dt) ? quant_row_bytes(dt, cols)
                                               : static_cast<size_t>(cols) * dtype_size(dt);
      bytes.assign(rb * static_cast<size_t>(rows), 0);
      for (int64_t r = 0; r < rows; ++r) {
        const float* row = src.data() + r * cols;
        uint8_t* o = bytes.data() + rb * static_cast<size_t>(r);
        if (dtype_is_quantized(dt))
          quantize_row(dt, row, cols, o);
        else if (dt == DType::BF16)
          for (int64_t c = 0; c < cols; ++c) {
            const uint16_t h = f32_to_bf16(row[c]);
            std::memcpy(o + 2 * c, &h, 2);
          }
        else
          std::memcpy(o, row, rb);
      }
      return WeightView{.name = "experts",
                        .dtype = dt,
                        .shape = shape,
                        .data = bytes.data(),
                        .nbytes = bytes.size()};
    };
    std::vector<uint8_t> gu_bytes, dn_bytes;
    const WeightView gu_v = store(gu, {E, 2 * I, D}, gu_bytes);
    const WeightView dn_v = store(dn, {E, D, I}, dn_bytes);
    // Reference: sum over each row's experts in ascending id of w * down(gelu(gate) * up).
    std::vector<double> want(static_cast<size_t>(S * D), 0.0);
    std::vector<float> wrow(static_cast<size_t>(D));
    for (int64_t r = 0; r < S; ++r) {
      std::vector<std::pair<int32_t, float>> chosen;
      for (int64_t j = 0; j < K; ++j)
        chosen.push_back({ids[static_cast<size_t>(r * K + j)], w[static_cast<size_t>(r * K + j)]});
      std::sort(chosen.begin(), chosen.end());
      for (const auto& [e, wt] : chosen) {
        const WeightView g = expert_slice(gu_v, e), d = expert_slice(dn_v, e);
        std::vector<double> act(static_cast<size_t>(I));
        for (int64_t i = 0; i < I; ++i) {
          double a = 0, b = 0;
          weight_row_to_f32(g, i, wrow.data());
          for (int64_t c = 0; c < D; ++c) a += static_cast<double>(wrow[c]) * x[r * D + c];
          weight_row_to_f32(g, I + i, wrow.data());
          for (int64_t c = 0; c < D; ++c) b += static_cast<double>(wrow[c]) * x[r * D + c];
          act[static_cast<size_t>(i)] = gelu_tanh(static_cast<float>(a)) * b;
        }
        std::vector<float> drow(static_cast<size_t>(I));
        for (int64_t o = 0; o < D; ++o) {
          weight_row_to_f32(d, o, drow.data());
          double y = 0;
          for (int64_t i = 0; i < I; ++i) y += static_cast<double>(drow[i]) * act[i];
          want[static_cast<size_t>(r * D + o)] += y * wt;
        }
      }
    }
    // Experts 1, 3 and 4 are chosen by no row: poison them, they must not be read.
    if (dt == DType::F32)
      for (int64_t e : {1, 3, 4}) {
        float* g = reinterpret_cast<float*>(gu_bytes.data()) + e * 2 * I * D;
        float* d = reinterpret_cast<float*>(dn_bytes.data()) + e * D * I;
        std::fill_n(g, 2 * I * D, std::nanf(""));
        std::fill_n(d, D * I, std::nanf(""));
      }
    ThreadPool pool(2);
    ExpertsWorkspace ws;
    std::vector<float> got(static_cast<size_t>(S * D));
    for (int64_t rows : {S, int64_t{1}}) {  // a prompt chunk, and a decode step (row 0)
      experts_forward(pool, x.data(), rows, gu_v, dn_v, ids.data(), w.data(), K, got.data(), ws);
      const auto n = static_cast<size_t>(rows * D);
      const std::vector<double> got_rows(got.begin(), got.begin() + static_cast<int64_t>(n));
      const double err = max_abs_diff(got_rows, std::span<const double>(want).first(n));
      double ref = 0;
      for (size_t i = 0; i < n; ++i) ref = std::max(ref, std::fabs(want[i]));
      // Quantized kernels also quantize the activations (8-bit blocks): ~1% of the largest value.
      const double tol = dtype_is_quantized(dt) ? 0.02 * ref : 1e-5 * std::max(1.0, ref);
      EXPECT_LE(err, tol) << dtype_name(dt) << " rows " << rows << " (largest " << ref << ")";
    }
  }
  // A choice outside the experts is an error, not an out-of-bounds read.
  std::vector<uint8_t> b1, b2;
  const std::vector<int32_t> bad = {7, 0};
  std::vector<float> out(static_cast<size_t>(D));
  ThreadPool pool(1);
  ExpertsWorkspace ws;
  const WeightView g = {.name = "g",
                        .dtype = DType::F32,
                        .shape = {E, 2 * I, D},
                        .data = gu.data(),
                        .nbytes = gu.size() * 4};
  const WeightView d = {.name = "d",
                        .dtype = DType::F32,
                        .shape = {E, D, I},
                        .data = dn.data(),
                        .nbytes = dn.size() * 4};
  EXPECT_NE(error_of([&] {
              experts_forward(pool, x.data(), 1, g, d, bad.data(), w.data(), K, out.data(), ws);
            }).find("expert 7"),
            std::string::npos);
}

std::string export_large(const std::string& set, const std::string& stages,
                         const std::string& weights) {
  const std::string out = temp_dir("large_" + set + "_" + weights);
  ExportOptions opt;
  opt.stages = stages;
  opt.weights = weights;
  opt.max_context = 256;
  opt.progress = false;
  export_bundle(large_fixture(set, "model"), out, opt);
  return out;
}

// A staged f32 bundle gives the checkpoint's numbers exactly (experts and routing included),
// passes check, and the MoE layers' cost is balanced by bytes.
TEST(LargeBundle, F32StagedBundleEqualsCheckpointAndPassesCheck) {
  for (const char* set : {"gemma4-tiny-moe", "gemma4-tiny-dense"}) {
    const std::string bundle = export_large(set, "2", "f32");
    std::ostringstream log;
    CheckOptions co;
    co.reference_model = large_fixture(set, "model");
    EXPECT_EQ(check_bundle(bundle, co, log), 0) << log.str();
    auto staged = Sequence::open(bundle, 256);
    ASSERT_EQ(staged->stages().size(), 4u) << set;
    auto direct = Sequence::open(large_fixture(set, "model"), 256);
    const std::string dir = large_fixture(set, "long/");
    const std::vector<int32_t> ids = load_ids(dir + "input_ids.npy");
    ThreadPool pool(2);
    TapRecorder ta({"router_topk_ids", "logits"}), tb({"router_topk_ids", "logits"});
    const FloatTensor a = staged->prefill(pool, ids, nullptr, 16, true, &ta);
    const FloatTensor b = direct->prefill(pool, ids, nullptr, 16, true, &tb);
    EXPECT_EQ(max_abs_diff(ta.get("logits").data, tb.get("logits").data), 0.0) << set;
    expect_close(ta.get("logits"), dir + "logits.npy", 5e-4, std::string(set) + " staged logits");
    if (ta.has("router_topk_ids")) {
      EXPECT_EQ(ta.get_ids("router_topk_ids"), load_npy(dir + "router_topk_ids.npy").to_i64());
    }
  }
}

// In a 4-bit bundle each expert is its own block-quantized matrix ([E, 2I, D] stored as E * 2I
// Q4_0 rows); a decoded token's byte count takes top_k / E of the experts; the bundle checks.
TEST(LargeBundle, Q4BundleQuantizesExpertsPerExpertAndCountsTheChosenShare) {
  const std::string bundle = export_large("gemma4-tiny-moe", "0:2,2:5", "q4_0");
  std::ostringstream log;
  EXPECT_EQ(check_bundle(bundle, {}, log), 0) << log.str();
  const BundleManifest m = read_bundle_manifest(bundle);
  const TextConfig& t = m.config.text;
  auto model = Model::open(bundle);
  double experts = 0, other = 0;
  for (const BundleStage& st : m.stages) {
    if (st.decl.role != StageRole::TransformerLayers) continue;
    const WeightsFile wf((std::filesystem::path(bundle) / st.weights_file).string());
    for (int l = st.decl.layers.begin; l < st.decl.layers.end; ++l) {
      const std::string p = "model.language_model.layers." + std::to_string(l) + ".";
      const WeightView gu = wf.view(p + "experts.gate_up_proj");
      EXPECT_EQ(gu.dtype, DType::Q4_0);
      EXPECT_EQ(gu.shape, (Shape{t.num_experts, 2 * t.moe_intermediate_size, t.hidden_size}));
      EXPECT_EQ(expert_slice(gu, 3).nbytes, gu.nbytes / static_cast<size_t>(t.num_experts));
      EXPECT_EQ(wf.view(p + "experts.down_proj").dtype, DType::Q4_0);
      EXPECT_EQ(wf.view(p + "router.proj.weight").dtype, DType::F32);  // never quantized
      experts += static_cast<double>(gu.nbytes + wf.view(p + "experts.down_proj").nbytes);
      for (const char* name :
           {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
            "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"})
        other += static_cast<double>(wf.view(p + name).nbytes);
      if (!t.layers[static_cast<size_t>(l)].k_eq_v)
        other += static_cast<double>(wf.view(p + "self_attn.v_proj.weight").nbytes);
    }
  }
  double head = 0;
  for (const BundleStage& st : m.stages)
    if (st.decl.role == StageRole::FinalNormHead)
      head = static_cast<double>(
          WeightsFile((std::filesystem::path(bundle) / st.weights_file).string())
              .view("model.language_model.embed_tokens.weight")
              .nbytes);
  EXPECT_DOUBLE_EQ(model->decode_weight_bytes(),
                   other + head + experts * t.top_k_experts / t.num_experts);
  // It runs: finite logits, and greedy decoding from the text prompt.
  Sequence seq(model, 64);
  ThreadPool pool(2);
  const FloatTensor l =
      seq.prefill(pool, load_ids(large_fixture("gemma4-tiny-moe", "text/input_ids.npy")), nullptr,
                  0, false, nullptr);
  for (float v : l.data) ASSERT_TRUE(std::isfinite(v));
}

// --stages N balances weight bytes: the real 26B-A4B splits into 5 stages of 6 layers and the
// 31B into 6 of 10 (how the seed's staged runtime publishes them), and an MoE layer weighs many
// dense ones.
TEST(LargeBundle, StageCountsBalanceTheRealModelsByBytes) {
  const ModelConfig a = parse_model_config(preset_config("26b-a4b").dump(), "26b-a4b");
  const ModelConfig b = parse_model_config(preset_config("31b").dump(), "31b");
  for (const auto& [cfg, n, per] : {std::tuple{&a, "5", 6}, std::tuple{&b, "6", 10}}) {
    const auto ranges = parse_stage_spec(n, cfg->text);
    ASSERT_EQ(ranges.size(), static_cast<size_t>(std::stoi(n)));
    for (const LayerRange& r : ranges) EXPECT_EQ(r.end - r.begin, per) << r.str();
  }
  EXPECT_GT(layer_parameters(a.text, 0),
            10 * (layer_parameters(a.text, 0) -
                  a.text.num_experts * 3.0 * a.text.moe_intermediate_size * a.text.hidden_size));
  EXPECT_TRUE(a.text.enable_moe_block && a.text.layers[5].k_eq_v && !a.text.has_ple());
  EXPECT_EQ(a.vision->hidden_size, 1152);
  EXPECT_FALSE(b.text.enable_moe_block);
  EXPECT_EQ(b.text.layers[5].num_kv_heads, 4);
}

// make-random --bundle writes the bundle that make-random + export would, byte for byte, with no
// checkpoint on disk in between (the way to a real-size 4-bit 26B-A4B / 31B on a small disk).
TEST(LargeBundle, MakeRandomStraightIntoABundleEqualsCheckpointThenExport) {
  const std::string dir = temp_dir("make_random_bundle");
  auto run = [&](const std::string& args) {
    const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + dir + "/log 2>&1";
    return std::system(cmd.c_str());
  };
  ASSERT_EQ(run("make-random --preset tiny --seed 3 --out " + dir + "/ckpt"), 0);
  ASSERT_EQ(run("export -m " + dir + "/ckpt --out " + dir + "/a --weights q4_0 --stages 2"), 0);
  ASSERT_EQ(run("make-random --preset tiny --seed 3 --bundle q4_0 --stages 2 --out " + dir + "/b"),
            0);
  const BundleManifest a = read_bundle_manifest(dir + "/a"), b = read_bundle_manifest(dir + "/b");
  ASSERT_EQ(a.stages.size(), b.stages.size());
  for (size_t i = 0; i < a.stages.size(); ++i)
    EXPECT_EQ(a.stages[i].sha256, b.stages[i].sha256) << a.stages[i].decl.id;
  std::ostringstream log;
  EXPECT_EQ(check_bundle(dir + "/b", {}, log), 0) << log.str();
  EXPECT_NE(b.raw["source_model"].get<std::string>().find("make-random --preset tiny --seed 3"),
            std::string::npos);
}

// The image block crosses stage boundaries as the transformer stages' `vision_groups` input:
// chaining a bundle's stages by hand with `run-stage` gives the fixture's logits with it, and the
// known-wrong causal variant without it.
TEST(LargeBundle, RunStageCarriesTheImageGroups) {
  const std::string set = "gemma4-tiny-moe";
  const std::string bundle = export_large(set, "0:2,2:5", "f32");
  const std::string dir = temp_dir("large_run_stage"), mm = large_fixture(set, "multimodal/");
  auto run = [&](const std::string& args) {
    const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + dir + "/log 2>&1";
    return std::system(cmd.c_str());
  };
  const ModelConfig cfg = load_model_config(large_fixture(set, "model"));
  const std::vector<int32_t> ids = load_ids(mm + "input_ids.npy");
  const int64_t S = static_cast<int64_t>(ids.size());
  std::vector<int32_t> pos(ids.size());
  for (size_t i = 0; i < pos.size(); ++i) pos[i] = static_cast<int32_t>(i);
  save_npy(dir + "/ids.npy", HostTensor({S}, ids));
  save_npy(dir + "/pos.npy", HostTensor({S}, pos));
  save_npy(dir + "/groups.npy", HostTensor({S}, vision_groups(cfg, ids)));
  save_npy(dir + "/pli02.npy", HostTensor({S, 2, 0}, std::vector<float>{}));
  save_npy(dir + "/pli25.npy", HostTensor({S, 3, 0}, std::vector<float>{}));
  ASSERT_EQ(run("run-stage " + bundle + " embeddings --in input_ids=" + dir +
                "/ids.npy --in pixel_values=" + mm + "pixel_values.npy --in image_position_ids=" +
                mm + "image_position_ids.npy --out " + dir + "/emb"),
            0);
  for (const bool groups : {true, false}) {
    std::string hidden = dir + "/emb/hidden_states.npy";
    for (const auto& [id, pli] :
         {std::pair{"layers_0_2", "pli02"}, std::pair{"layers_2_5", "pli25"}}) {
      const std::string out = dir + "/" + id + (groups ? "_g" : "_c");
      ASSERT_EQ(run("run-stage " + bundle + " " + id + " --in hidden_states=" + hidden +
                    " --in per_layer_inputs=" + dir + "/" + pli + ".npy --in positions=" + dir +
                    "/pos.npy" + (groups ? " --in vision_groups=" + dir + "/groups.npy" : "") +
                    " --out " + out),
                0);
      hidden = out + "/hidden_states.npy";
    }
    const std::string head = dir + (groups ? "/head_g" : "/head_c");
    ASSERT_EQ(run("run-stage " + bundle + " head --in hidden_states=" + hidden + " --out " + head),
              0);
    const std::vector<float> got = load_npy(head + "/logits.npy").to_f32();
    const char* match = groups ? "logits.npy" : "logits_vision_causal.npy";
    const char* other = groups ? "logits_vision_causal.npy" : "logits.npy";
    EXPECT_LE(max_abs_diff(got, load_npy(mm + match).to_f32()), 5e-4) << match;
    EXPECT_GT(max_abs_diff(got, load_npy(mm + other).to_f32()), 0.1) << other;
  }
}

TEST(LargeConfig, ParsesTheMoeAndDenseLargeConfigs) {
  const ModelConfig moe = load_model_config(large_fixture("gemma4-tiny-moe", "model"));
  EXPECT_TRUE(moe.text.enable_moe_block);
  EXPECT_EQ(moe.text.num_experts, 8);
  EXPECT_EQ(moe.text.top_k_experts, 2);
  EXPECT_EQ(moe.text.moe_intermediate_size, 32);
  EXPECT_FALSE(moe.text.has_ple());
  EXPECT_TRUE(moe.text.bidirectional_vision);
  const LayerSpec& full = moe.text.layers.back();
  EXPECT_TRUE(full.k_eq_v && full.moe);
  EXPECT_EQ(full.num_kv_heads, 1);
  EXPECT_EQ(full.head_dim, 64);
  EXPECT_FALSE(moe.text.layers.front().k_eq_v);
  EXPECT_EQ(moe.text.layers.front().num_kv_heads, 2);
  ASSERT_TRUE(moe.vision.has_value());
  EXPECT_TRUE(moe.vision->standardize);
  EXPECT_FALSE(moe.vision->use_clipped_linears);

  const ModelConfig dense = load_model_config(large_fixture("gemma4-tiny-dense", "model"));
  EXPECT_FALSE(dense.text.enable_moe_block);
  EXPECT_FALSE(dense.text.layers.back().moe);
  EXPECT_TRUE(dense.text.layers.back().k_eq_v);
  EXPECT_EQ(dense.text.layers.back().num_kv_heads, 2);
  EXPECT_EQ(dense.text.layers.front().num_kv_heads, 4);
}

// Config errors name the field.
TEST(LargeConfig, BadLargeConfigsAreClearErrors) {
  const std::string base = read_text_file(large_fixture("gemma4-tiny-moe", "model/config.json"));
  auto with = [&](const std::string& from, const std::string& to) {
    std::string s = base;
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) s.replace(at, from.size(), to);
    return error_of([&] { parse_model_config(s, "config.json"); });
  };
  EXPECT_NE(with("\"num_global_key_value_heads\": 1", "\"num_global_key_value_heads\": null")
                .find("num_global_key_value_heads"),
            std::string::npos);
  EXPECT_NE(with("\"use_bidirectional_attention\": \"vision\"",
                 "\"use_bidirectional_attention\": \"all\"")
                .find("use_bidirectional_attention"),
            std::string::npos);
  EXPECT_NE(with("\"top_k_experts\": 2", "\"top_k_experts\": 9").find("top_k_experts"),
            std::string::npos);
  EXPECT_NE(with("\"num_experts\": 8", "\"num_experts\": null").find("num_experts"),
            std::string::npos);
  EXPECT_NE(with("\"num_experts\": 8", "\"num_experts\": 100000").find("out of range"),
            std::string::npos);
}

}  // namespace
