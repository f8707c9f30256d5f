// gemma4_unified (Gemma4UnifiedForConditionalGeneration, the 12B: no towers, image patches and
// raw audio frames through small embedders) against its golden fixtures
// (tests/fixtures/gemma4-tiny-unified, an independent float32 reference; docs in
// docs/gemma4-unified.md): every tap within the fixture manifest's
// tolerances_atol_computed, greedy ids (after generation_config.suppress_tokens) exact, on
// whole-prompt and chunked prefill; the BF16 checkpoint by top-1 and logits closeness.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <nlohmann/json.hpp>

#include "audio/audio_decode.h"
#include "core/error.h"
#include "gemma4/config.h"
#include "gemma4/multimodal.h"
#include "gemma4/presets.h"
#include "gemma4/tensor_table.h"
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

namespace {

// The processor: pixel_values and image_position_ids from image.png exactly as the fixture's
// (the 168x240 image fills the 70-token budget as is: resize is the identity).
TEST(UnifiedImage, PatchesFromPngExact) {
  const UnifiedPatches p = preprocess_unified_image(decode_image_file(unified("image/image.png")),
                                                    load_processor_config(unified("model")));
  EXPECT_EQ(p.num_soft_tokens, 70);
  EXPECT_EQ(p.grid_h, 7);
  EXPECT_EQ(p.grid_w, 10);
  const NpyArray pv = load_npy(unified("image/pixel_values.npy"));
  ASSERT_EQ(pv.shape, (Shape{1, 70, 1728}));
  EXPECT_EQ(max_abs_diff(p.pixel_values, pv.to_f32()), 0.0);
  EXPECT_EQ(p.position_ids, load_npy(unified("image/image_position_ids.npy")).to_i64());
}

// The 12B rule: fill 280 blocks of 48 px, small images scaled up, sides floored to 48.
TEST(UnifiedImage, ResizeFillsTheBudgetAndScalesUp) {
  ImageProcessorConfig c;  // patch 16, pooling 3, max_soft_tokens 280: the 12B's
  const ResizeTarget a = unified_resize_target(100, 100, c);
  EXPECT_EQ(a.height, 768);
  EXPECT_EQ(a.width, 768);
  const ResizeTarget b = unified_resize_target(640, 960, c);
  EXPECT_EQ(b.height, 624);
  EXPECT_EQ(b.width, 960);
  EXPECT_LE((b.height / 48) * (b.width / 48), 280);
  // A small image is scaled up: 20x30 pixels -> 260 blocks.
  RgbImage small{30, 20, std::vector<uint8_t>(30 * 20 * 3, 100)};
  const UnifiedPatches p = preprocess_unified_image(small, c);
  EXPECT_EQ(p.resized_h, 624);
  EXPECT_EQ(p.resized_w, 960);
  EXPECT_EQ(p.num_soft_tokens, 260);
  EXPECT_EQ(p.pixel_values.size(), size_t{280} * 6912);
  EXPECT_EQ(p.position_ids[2 * 260], -1);  // padding rows after the real blocks
  EXPECT_EQ(p.position_ids[2 * 259], 19);  // last block: x = 19, y = 12
  EXPECT_EQ(p.position_ids[2 * 259 + 1], 12);
}

// A block is a plain 48x48 pixel cut in (row, column, channel) order.
TEST(UnifiedImage, BlockIsRowColumnChannel) {
  ImageProcessorConfig c;
  c.do_resize = false;
  RgbImage img{96, 48, std::vector<uint8_t>(96 * 48 * 3)};
  for (size_t i = 0; i < img.rgb.size(); ++i) img.rgb[i] = static_cast<uint8_t>(i * 7 % 251);
  const UnifiedPatches p = preprocess_unified_image(img, c);
  ASSERT_EQ(p.num_soft_tokens, 2);
  const float r = static_cast<float>(1.0 / 255.0);
  // Block 1 (x = 1), pixel (row 5, column 7), channel 2.
  const size_t src = (size_t(5) * 96 + 48 + 7) * 3 + 2;
  EXPECT_EQ(p.pixel_values[6912 + (5 * 48 + 7) * 3 + 2], static_cast<float>(img.rgb[src]) * r);
  EXPECT_EQ(p.position_ids[2], 1);
  EXPECT_EQ(p.position_ids[3], 0);
}

TEST(UnifiedAudio, FramesFromWavExactPartialFrameKept) {
  const AudioClip clip = decode_audio_file(unified("audio/audio.wav"));
  EXPECT_EQ(max_abs_diff(clip.samples, load_npy(unified("audio/audio_waveform.npy")).to_f32()),
            0.0);
  const UnifiedAudioInput a = unified_audio_frames(clip.samples, 640);
  EXPECT_EQ(a.frames, 13);  // ceil(8160 / 640): the partial last frame counts
  EXPECT_EQ(max_abs_diff(a.samples, load_npy(unified("audio/audio_frames.npy")).to_f32()), 0.0);
  EXPECT_NE(error_of([] { unified_audio_frames({}, 640); }), "(no error)");
}

// The embeddings stage runs the embedders itself from pixel_values / audio_frames (the contract
// inputs), giving the fixture's inputs_embeds; bad positions and masks are named errors.
TEST(UnifiedStage, EmbeddingsStageRunsTheEmbedders) {
  auto model = open_model(unified("model"));
  const Stage& emb = model->embeddings();
  ThreadPool pool(2);
  {
    TensorMap in;
    const std::vector<int32_t> ids = load_ids(unified("image/input_ids.npy"));
    in["input_ids"] = HostTensor({static_cast<int64_t>(ids.size())}, ids);
    const NpyArray pv = load_npy(unified("image/pixel_values.npy"));
    in["pixel_values"] = HostTensor(pv.shape, pv.to_f32());
    const NpyArray pos = load_npy(unified("image/image_position_ids.npy"));
    in["image_position_ids"] = HostTensor(pos.shape, pos.to_i64());
    TensorMap out = emb.run(pool, std::move(in), nullptr, {}, nullptr);
    expect_close(out.at("hidden_states").take_float(), unified("image/inputs_embeds.npy"),
                 tolerances("image").at("inputs_embeds"), "inputs_embeds");
  }
  {
    TensorMap in;
    const std::vector<int32_t> ids = load_ids(unified("audio/input_ids.npy"));
    in["input_ids"] = HostTensor({static_cast<int64_t>(ids.size())}, ids);
    const NpyArray fr = load_npy(unified("audio/audio_frames.npy"));
    in["audio_frames"] = HostTensor({1, fr.shape[0], fr.shape[1]}, fr.to_f32());
    in["audio_frames_mask"] =
        HostTensor({1, fr.shape[0]}, std::vector<uint8_t>(static_cast<size_t>(fr.shape[0]), 1));
    TensorMap out = emb.run(pool, std::move(in), nullptr, {}, nullptr);
    expect_close(out.at("hidden_states").take_float(), unified("audio/inputs_embeds.npy"),
                 tolerances("audio").at("inputs_embeds"), "inputs_embeds");
    const auto mask = out.at("audio_splice_mask").values<uint8_t>();
    EXPECT_EQ(std::count(mask.begin(), mask.end(), 1), 13);
  }
  {
    TensorMap in;
    in["input_ids"] = HostTensor({1}, std::vector<int32_t>{2040});
    in["pixel_values"] = HostTensor({1, 1, 1728}, std::vector<float>(1728, 0.5f));
    in["image_position_ids"] = HostTensor({1, 1, 2}, std::vector<int64_t>{16, 0});
    EXPECT_NE(error_of([&] {
                emb.run(pool, std::move(in), nullptr, {}, nullptr);
              }).find("mm_posemb_size"),
              std::string::npos);
  }
}

std::string config_text() {
  return read_text_file(unified("model/config.json"));
}

TEST(UnifiedConfig, FieldsRefusedByName) {
  const ModelConfig c = parse_model_config(config_text(), "config.json");
  EXPECT_TRUE(c.unified);
  EXPECT_FALSE(c.text.has_ple());
  EXPECT_TRUE(c.text.bidirectional_vision);
  ASSERT_TRUE(c.unified_vision && c.unified_audio);
  EXPECT_EQ(c.unified_vision->block(), 24);
  EXPECT_EQ(c.unified_vision->mm_posemb_size, 16);
  EXPECT_EQ(c.unified_audio->frame_samples, 640);
  auto with = [&](const std::function<void(nlohmann::json&)>& f) {
    nlohmann::json j = nlohmann::json::parse(config_text());
    f(j);
    return error_of([&] { parse_model_config(j.dump(), "config.json"); });
  };
  EXPECT_NE(with([](auto& j) {
              j["text_config"]["model_type"] = "gemma4_text";
            }).find("expected 'gemma4_unified_text'"),
            std::string::npos);
  EXPECT_NE(with([](auto& j) {
              j["text_config"]["hidden_size_per_layer_input"] = 16;
            }).find("hidden_size_per_layer_input"),
            std::string::npos);
  EXPECT_NE(with([](auto& j) {
              j["vision_config"]["model_type"] = "gemma4_vision";
            }).find("gemma4_unified_vision"),
            std::string::npos);
  EXPECT_NE(
      with([](auto& j) { j["vision_config"]["model_patch_size"] = 16; }).find("model_patch_size"),
      std::string::npos);
  nlohmann::json j = nlohmann::json::parse(config_text());
  j["audio_config"]["brand_new_field"] = 1;
  const ModelConfig w = parse_model_config(j.dump(), "config.json");
  EXPECT_TRUE(std::any_of(w.warnings.begin(), w.warnings.end(), [](const std::string& s) {
    return s.find("brand_new_field") != std::string::npos;
  }));
}

TEST(UnifiedConfig, SuppressTokensAndEosFromGenerationConfig) {
  EXPECT_EQ(load_suppress_tokens(unified("model")), (std::vector<int32_t>{2043, 2042}));
  // Greedy never picks a suppressed id, even at the top.
  std::vector<float> logits(2048, 0.0f);
  logits[2042] = 9;
  logits[7] = 1;
  SamplingParams sp = SamplingParams::greedy();
  sp.suppress_tokens = {2043, 2042};
  EXPECT_EQ(Sampler(sp).sample(logits.data(), 2048, {}), 7);
}

// transformers >= 5.12 saves the embedders as model.embed_vision.* and
// model.embed_vision.multimodal_embedder.embedding_projection: the same model either way.
TEST(UnifiedLoading, RenamedTensorLayoutGivesTheSameModel) {
  const std::string dir = temp_dir("unified_renamed");
  for (const char* f : {"config.json", "generation_config.json", "preprocessor_config.json"})
    std::filesystem::copy_file(unified(std::string("model/") + f), dir + "/" + f);
  std::ifstream in(unified("model/model.safetensors"), std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  nlohmann::json h = nlohmann::json::parse(bytes.substr(8, n)), renamed;
  for (auto it = h.begin(); it != h.end(); ++it) {
    std::string k = it.key();
    if (k.rfind("model.vision_embedder.", 0) == 0)
      k = "model.embed_vision." + k.substr(22);
    else if (k == "model.embed_vision.embedding_projection.weight")
      k = "model.embed_vision.multimodal_embedder.embedding_projection.weight";
    renamed[k] = it.value();
  }
  std::string header = renamed.dump();
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t hn = header.size();
  std::ofstream out(dir + "/model.safetensors", std::ios::binary);
  out.write(reinterpret_cast<const char*>(&hn), 8);
  out << header << bytes.substr(8 + n);
  out.close();

  Sequence renamed_seq(Model::open(dir), 128), seq(open_model(unified("model")), 128);
  EXPECT_TRUE(
      renamed_seq.notes().empty() ||
      std::none_of(renamed_seq.notes().begin(), renamed_seq.notes().end(),
                   [](const std::string& s) { return s.find("not used") != std::string::npos; }));
  ThreadPool pool(2);
  const std::vector<int32_t> ids = load_ids(unified("image/input_ids.npy"));
  const FloatTensor s1 = fixture_soft_tokens(pool, renamed_seq.model(), "image", ids, nullptr);
  const FloatTensor s2 = fixture_soft_tokens(pool, seq.model(), "image", ids, nullptr);
  EXPECT_EQ(max_abs_diff(s1.data, s2.data), 0.0);
  const FloatTensor l1 = renamed_seq.forward(pool, ids, &s1, false, nullptr);
  const FloatTensor l2 = seq.forward(pool, ids, &s2, false, nullptr);
  EXPECT_EQ(max_abs_diff(l1.data, l2.data), 0.0);
}

// `dump --image` / `--audio` on the CLI: greedy ids (with suppress_tokens) exactly the fixture's.
TEST(UnifiedCli, DumpImageAndAudioGreedyIds) {
  for (const char* f : {"image", "audio"}) {
    const std::string out = temp_dir(std::string("unified_dump_") + f);
    const std::string media = std::string(f) == "image" ? " --image " + unified("image/image.png")
                                                        : " --audio " + unified("audio/audio.wav");
    const std::string cmd = std::string(GEMSTAGE_CLI) + " dump --model " + unified("model") +
                            " --ids " + unified(std::string(f) + "/input_ids.npy") + media +
                            " --decode 8 --taps logits,decode_ids --out " + out + " 2>/dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    EXPECT_EQ(load_npy(out + "/decode_ids.npy").to_i64(),
              load_npy(unified(std::string(f) + "/decode_ids.npy")).to_i64());
    EXPECT_LE(max_abs_diff(load_npy(out + "/logits.npy").to_f32(),
                           load_npy(unified(std::string(f) + "/logits.npy")).to_f32()),
              tolerances(f).at("logits"));
  }
}

}  // namespace

namespace {

// A staged bundle of the unified model: export (balanced --stages), check (its probe runs the
// image and audio embedders and keeps the image block whole in chunks), run-stage of the
// embeddings stage from the contract's pixel inputs, and parity with the image and audio gates.
TEST(UnifiedCli, BundleExportCheckRunStageParity) {
  const std::string b = temp_dir("unified_bundle");
  const std::string cli = GEMSTAGE_CLI;
  auto run = [](const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()); };
  ASSERT_EQ(run(cli + " export -m " + unified("model") + " --out " + b +
                " --stages 2 --weights f32 --force"),
            0);
  EXPECT_EQ(run(cli + " check " + b + " --reference " + unified("model")), 0);
  const std::string out = temp_dir("unified_run_stage");
  const std::vector<int32_t> ids = load_ids(unified("image/input_ids.npy"));
  save_npy(out + "/ids.npy", HostTensor({static_cast<int64_t>(ids.size())}, ids));
  EXPECT_EQ(
      run(cli + " run-stage " + b + " embeddings --in input_ids=" + out + "/ids.npy" +
          " --in pixel_values=" + unified("image/pixel_values.npy") +
          " --in image_position_ids=" + unified("image/image_position_ids.npy") + " --out " + out),
      0);
  FloatTensor hidden(load_npy(out + "/hidden_states.npy").shape);
  hidden.data = load_npy(out + "/hidden_states.npy").to_f32();
  expect_close(hidden, unified("image/inputs_embeds.npy"), tolerances("image").at("inputs_embeds"),
               "run-stage hidden_states");
  for (const char* f : {"image", "audio"}) {
    const std::string gates =
        std::string(" --gate 'logits.max_abs<2e-3' --gate 'teacher_forced>=1'") +
        (std::string(f) == "image" ? " --gate 'image_gate.delta>0.5'"
                                   : " --gate 'audio_gate.delta>0.5'");
    EXPECT_EQ(run(cli + " parity --model " + b + " --reference " + unified(f) + gates), 0) << f;
  }
}

}  // namespace

namespace {

// make-random --preset 12b writes the released 12B's shapes: 11,959,730,224 parameters
// (docs/gemma4-unified.md: embedding 1.007 B, decoder 10.901 B, image embedder 49.9 M,
// audio embedder 2.5 M), 8 x (5 sliding + 1 full) layers, k_eq_v full layers.
TEST(UnifiedPreset, TwelveBHasTheReleasedShapes) {
  const ModelConfig c = parse_model_config(preset_config("12b").dump(), "12b preset");
  EXPECT_TRUE(c.unified);
  int64_t params = 0, vision = 0, audio = 0;
  for (const TensorSpec& s : tensor_table(c)) {
    if (s.role != TensorRole::Required) continue;
    params += shape_numel(s.shape);
    if (s.held_by == kPartVision) vision += shape_numel(s.shape);
    if (s.held_by == kPartAudio) audio += shape_numel(s.shape);
  }
  EXPECT_EQ(params, 11959730224);
  EXPECT_EQ(vision,
            49922304);  // 2 x 6912 + 3840 x 6912 + 3840 + 4 x 3840 + 1120 x 2 x 3840 + 3840^2
  EXPECT_EQ(audio, 3840 * 640);
  int full = 0;
  for (const LayerSpec& l : c.text.layers) {
    full += l.type == LayerType::Full;
    if (l.type == LayerType::Full) {
      EXPECT_TRUE(l.k_eq_v);
      EXPECT_EQ(l.num_kv_heads, 1);
      EXPECT_EQ(l.head_dim, 512);
    } else {
      EXPECT_EQ(l.num_kv_heads, 8);
      EXPECT_EQ(l.head_dim, 256);
    }
  }
  EXPECT_EQ(full, 8);
  EXPECT_EQ(c.text.num_hidden_layers, 48);
}

// generate with an image and with audio on the unified checkpoint (chat format, the embedders
// inside the assistant, suppress_tokens in the sampler).
TEST(UnifiedCli, GenerateWithImageAndAudio) {
  for (const std::string& media :
       {" --image " + unified("image/image.png"), " --audio " + unified("audio/audio.wav")}) {
    const std::string cmd = std::string(GEMSTAGE_CLI) + " generate -m " + unified("model") +
                            " -p hello" + media + " -n 4 --temp 0 >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
}

}  // namespace

namespace {

// Without suppress_tokens the image prompt decodes differently (the fixture's
// decode_ids_nosuppress: <image|>/<audio|> win some steps), so the suppression is load-bearing.
TEST(UnifiedDecode, WithoutSuppressionTheIdsAreTheNoSuppressReference) {
  Sequence seq(open_model(unified("model")), 256);
  ThreadPool pool(2);
  const std::vector<int32_t> ids = load_ids(unified("image/input_ids.npy"));
  const FloatTensor soft = fixture_soft_tokens(pool, seq.model(), "image", ids, nullptr);
  FloatTensor l = seq.forward(pool, ids, &soft, false, nullptr);
  const std::vector<int64_t> want = load_npy(unified("image/decode_ids_nosuppress.npy")).to_i64();
  ASSERT_NE(want, load_npy(unified("image/decode_ids.npy")).to_i64());
  Sampler plain(SamplingParams::greedy());
  const int64_t V = seq.config().text.vocab_size;
  for (size_t step = 0; step < want.size(); ++step) {
    const int32_t next = plain.sample(l.row(0), V, {});
    EXPECT_EQ(next, want[step]) << "step " << step;
    l = seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr);
  }
}

}  // namespace
