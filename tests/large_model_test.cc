// The large Gemma 4 models (26B-A4B: mixture of experts; 31B: dense, both attention_k_eq_v on
// full layers, no PLE) against their golden fixtures (tests/fixtures/gemma4-tiny-moe and
// gemma4-tiny-dense, an independent reference of the transformers forward; docs in
// ../shared/docs/gemma4-large.md): every tap within the manifest's tolerance, the experts each
// row chose exact, greedy ids exact, on whole-prompt and chunked prefill.
#include <gtest/gtest.h>

#include <filesystem>
#include <memory>

#include "core/error.h"
#include "gemma4/config.h"
#include "gemma4/multimodal.h"
#include "gemma4/vision_model.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "io/mapped_file.h"
#include "io/npy.h"
#include "stage/sequence.h"
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

// Max |a - b| over the first n_rows rows of two tensors of one row width.
double max_abs_rows(const FloatTensor& a, const FloatTensor& b, int64_t n_rows) {
  const int64_t w = a.numel() / a.dim(0);
  EXPECT_EQ(w, b.numel() / b.dim(0));
  EXPECT_LE(n_rows, std::min(a.dim(0), b.dim(0)));
  const std::vector<float> x(a.data.begin(), a.data.begin() + n_rows * w),
      y(b.data.begin(), b.data.begin() + n_rows * w);
  return max_abs_diff(x, y);
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
  EXPECT_LE(max_abs_rows(taps.get("vision_patch_embeds"), load_f32(dir + "vision_patch_embeds.npy"),
                         n_patches),
            5e-5);
  EXPECT_LE(max_abs_rows(taps.get("vision_encoder_out"), load_f32(dir + "vision_encoder_out.npy"),
                         n_patches),
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
    expect_close(taps.get("router_probs"), dir + "router_probs.npy", 2e-5, "router_probs");
    expect_close(taps.get("router_topk_weights"), dir + "router_topk_weights.npy", 2e-5,
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
}

}  // namespace
