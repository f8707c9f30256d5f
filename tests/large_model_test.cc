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
const std::vector<std::pair<std::string, double>> kTapTolerances = {
    {"embeds_scaled", 1e-6},    {"inputs_embeds", 5e-5}, {"hidden_after_attn", 1e-2},
    {"hidden_after_mlp", 1e-2}, {"hidden_states", 1e-2}, {"final_hidden", 2e-3},
    {"logits", 5e-4},           {"router_probs", 1e-5},  {"router_topk_weights", 2e-5}};

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
