// gemma4_unified (Gemma4UnifiedForConditionalGeneration, the 12B: no towers, image patches and
// raw audio frames through small embedders) against its golden fixtures
// (tests/fixtures/gemma4-tiny-unified, an independent float32 reference; docs in
// ../shared/docs/gemma4-unified.md): every tap within the fixture manifest's
// tolerances_atol_computed, greedy ids (after generation_config.suppress_tokens) exact, on
// whole-prompt and chunked prefill; the BF16 checkpoint by top-1 and logits closeness.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "audio/audio_decode.h"
#include "core/error.h"
#include "gemma4/config.h"
#include "gemma4/multimodal.h"
#include "gemma4/unified_embedder.h"
#include "image/image_decode.h"
#include "image/unified_image.h"
#include "io/mapped_file.h"
#include "io/npy.h"
#include "runtime/sampler.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

std::string unified(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-unified/" + rel;
}

// The fixture manifest's per-tap tolerances (20x the reference's own float32-vs-float64 noise).
std::map<std::string, double> tolerances(const std::string& fixture) {
  const auto j = nlohmann::json::parse(read_text_file(unified(fixture + "/manifest.json")));
  std::map<std::string, double> t;
  for (auto it = j["tolerances_atol_computed"].begin(); it != j["tolerances_atol_computed"].end();
       ++it)
    t[it.key()] = it.value().get<double>();
  return t;
}

std::shared_ptr<const Model> open_model(const std::string& dir) {
  static std::map<std::string, std::shared_ptr<const Model>> cache;
  auto& m = cache[dir];
  if (!m) m = Model::open(dir);
  return m;
}

// Soft tokens of the fixture's image (from image.png) and/or audio (from audio.wav), computed
// by the model's own embedders, in prompt order.
FloatTensor fixture_soft_tokens(ThreadPool& pool, const Model& model, const std::string& fixture,
                                std::span<const int32_t> ids, TapRecorder* taps) {
  const UnifiedEmbedder* emb = model.embeddings().unified();
  FloatTensor vis, aud;
  const std::string dir = unified(fixture) + "/";
  if (std::filesystem::exists(dir + "image.png")) {
    const UnifiedPatches p = preprocess_unified_image(decode_image_file(dir + "image.png"),
                                                      load_processor_config(model.path()));
    UnifiedImageInput im{p.max_soft_tokens, p.pixel_values, p.position_ids};
    vis = emb->encode_images(pool, {im}, taps);
  }
  if (std::filesystem::exists(dir + "audio.wav")) {
    const AudioClip clip = decode_audio_file(dir + "audio.wav");
    aud = emb->encode_audio(
        pool, {unified_audio_frames(clip.samples, emb->audio_config().frame_samples)}, taps);
  }
  return merge_soft_tokens(model.config(), ids, vis.data.empty() ? nullptr : &vis,
                           aud.data.empty() ? nullptr : &aud);
}

// Greedy decode with the KV cache from the prefill's last logits, through the engine's sampler
// with the checkpoint's suppress_tokens: ids exact, raw logits within atol.
void expect_greedy_decode(ThreadPool& pool, Sequence& seq, const FloatTensor& last,
                          const std::string& dir, double atol) {
  const std::vector<int64_t> want_ids = load_npy(dir + "decode_ids.npy").to_i64();
  const std::vector<float> want_logits = load_npy(dir + "decode_logits.npy").to_f32();
  const int64_t V = seq.config().text.vocab_size;
  SamplingParams sp = SamplingParams::greedy();
  sp.suppress_tokens = load_suppress_tokens(seq.path());
  ASSERT_EQ(sp.suppress_tokens.size(), 2u);
  Sampler sampler(sp);
  std::vector<float> row(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
  for (size_t step = 0; step < want_ids.size(); ++step) {
    const int32_t next = sampler.sample(row.data(), V, {});
    EXPECT_EQ(next, want_ids[step]) << "decode step " << step;
    const std::vector<float> want_row(want_logits.begin() + static_cast<int64_t>(step) * V,
                                      want_logits.begin() + static_cast<int64_t>(step + 1) * V);
    EXPECT_LE(max_abs_diff(row, want_row), atol) << "decode_logits step " << step;
    const int32_t fed = static_cast<int32_t>(want_ids[step]);
    FloatTensor l = seq.forward(pool, std::span<const int32_t>(&fed, 1), nullptr, false, nullptr);
    row.assign(l.row(0), l.row(0) + V);
  }
}

struct Case {
  const char* fixture;
  int chunk;  // 0: whole prompt
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return std::string(info.param.fixture) + "_chunk" + std::to_string(info.param.chunk);
}

class UnifiedParity : public ::testing::TestWithParam<Case> {};

TEST_P(UnifiedParity, EveryTapWithinToleranceAndGreedyIdsExact) {
  const Case c = GetParam();
  Sequence seq(open_model(unified("model")), 256);
  const std::string dir = unified(c.fixture) + "/";
  const std::vector<int32_t> ids = load_ids(dir + "input_ids.npy");
  const auto tol = tolerances(c.fixture);
  ThreadPool pool(2);
  TapRecorder taps({"all"});
  const FloatTensor soft = fixture_soft_tokens(pool, seq.model(), c.fixture, ids, &taps);
  const FloatTensor last =
      prefill_chunks(seq.config(), ids, soft.data.empty() ? nullptr : &soft, c.chunk,
                     [&](std::span<const int32_t> part, const FloatTensor* s) {
                       return seq.forward(pool, part, s, true, &taps);
                     });
  int compared = 0;
  for (const auto& [tap, atol] : tol) {
    if (tap == "decode_logits" || !std::filesystem::exists(dir + tap + ".npy")) continue;
    expect_close(taps.get(tap), dir + tap + ".npy", atol, tap);
    ++compared;
  }
  // embeds_scaled: a gather times a float32 constant (manifest: atol 1e-6).
  expect_close(taps.get("embeds_scaled"), dir + "embeds_scaled.npy", 1e-6, "embeds_scaled");
  for (const char* tap : {"hidden_after_attn", "hidden_after_mlp"})
    if (std::filesystem::exists(dir + tap + ".npy"))
      expect_close(taps.get(tap), dir + tap + ".npy", tol.at("hidden_states"), tap);
  EXPECT_GE(compared, 4);
  EXPECT_EQ(taps.get_ids("llm_input_ids"), load_npy(dir + "llm_input_ids.npy").to_i64());
  expect_greedy_decode(pool, seq, last, dir, tol.at("decode_logits"));
}

INSTANTIATE_TEST_SUITE_P(Fixtures, UnifiedParity,
                         ::testing::Values(Case{"text", 0}, Case{"long", 0}, Case{"long", 7},
                                           Case{"image", 0}, Case{"image", 5}, Case{"audio", 0},
                                           Case{"audio", 4}),
                         case_name);

// The BF16 checkpoint: the *_bf16 fixtures are float32 maths on the BF16-rounded weights, which
// is what gemstage computes on bf16 weights too; compared by cosine, top-1 and greedy ids.
TEST(UnifiedBf16, LogitsCosineTop1AndGreedyIds) {
  for (const char* f : {"text", "image", "audio", "long"}) {
    SCOPED_TRACE(f);
    Sequence seq(open_model(unified("model_bf16")), 256);
    const std::vector<int32_t> ids = load_ids(unified(std::string(f) + "/input_ids.npy"));
    ThreadPool pool(2);
    const FloatTensor soft = fixture_soft_tokens(pool, seq.model(), f, ids, nullptr);
    const FloatTensor logits =
        seq.forward(pool, ids, soft.data.empty() ? nullptr : &soft, true, nullptr);
    const std::vector<float> want = load_npy(unified(std::string(f) + "_bf16/logits.npy")).to_f32();
    ASSERT_EQ(logits.data.size(), want.size());
    const int64_t V = seq.config().text.vocab_size, S = logits.dim(0);
    int64_t top1_same = 0;
    double worst_cos = 1;
    for (int64_t r = 0; r < S; ++r) {
      const float* a = logits.row(r);
      const float* b = want.data() + r * V;
      double ab = 0, aa = 0, bb = 0;
      for (int64_t i = 0; i < V; ++i) ab += a[i] * b[i], aa += a[i] * a[i], bb += b[i] * b[i];
      worst_cos = std::min(worst_cos, ab / std::sqrt(aa * bb));
      top1_same += std::max_element(a, a + V) - a == std::max_element(b, b + V) - b;
    }
    // f32 maths on the bf16 weights is exactly what the reference computed: the f32 tolerance
    // holds too, beyond the cosine (>= 0.999) and top-1 the manifest asks of bf16 compute.
    EXPECT_LE(max_abs_diff(logits.data, want), tolerances(std::string(f) + "_bf16").at("logits"));
    EXPECT_GE(worst_cos, 0.999) << "worst row cosine";
    EXPECT_EQ(top1_same, S) << "top-1 agreement";
    const std::string dir = unified(std::string(f) + "_bf16/");
    const std::vector<int64_t> want_ids = load_npy(dir + "decode_ids.npy").to_i64();
    SamplingParams sp = SamplingParams::greedy();
    sp.suppress_tokens = load_suppress_tokens(seq.path());
    Sampler sampler(sp);
    std::vector<float> row(logits.row(S - 1), logits.row(S - 1) + V);
    for (size_t step = 0; step < want_ids.size(); ++step) {
      const int32_t next = sampler.sample(row.data(), V, {});
      EXPECT_EQ(next, want_ids[step]) << "decode step " << step;
      FloatTensor l =
          seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr);
      row.assign(l.row(0), l.row(0) + V);
    }
  }
}

}  // namespace
