// Audio: decoding (libsndfile formats, channel mix-down, resampling, limits), the log-mel feature
// extractor (FFT against a direct DFT, the mel bank, every feature against the fixture), the
// audio tower's taps against the golden fixture (tests/fixtures/gemma4-tiny-audio) within the
// manifest's tolerances, the embeddings stage's audio contract and the full audio prefill +
// greedy decode, with the raw-id diagnostic.
#include <gtest/gtest.h>
#include <httplib.h>
#include <sndfile.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <numbers>
#include <string>

#include "audio/audio_decode.h"
#include "audio/audio_features.h"
#include "core/error.h"
#include "gemma4/audio_model.h"
#include "gemma4/multimodal.h"
#include "gemma4/tensor_table.h"
#include "io/npy.h"
#include "kernels/weight_rows.h"
#include "server/api.h"
#include "server/server.h"
#include "server_test_util.h"
#include "stage/sequence.h"
#include "test_util.h"
#include "tokenizer/chat_format.h"

using namespace gemstage;
using namespace gemstage::server;
using gemstage::testing::max_abs_diff;
using gemstage::testing::max_abs_diff_rows;

namespace {

std::string afx(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-audio/" + rel;
}

FloatTensor load_f32(const std::string& path) {
  const NpyArray a = load_npy(path);
  FloatTensor t;
  t.shape = a.shape;
  t.data = a.to_f32();
  return t;
}

std::vector<int32_t> load_ids32(const std::string& path) {
  std::vector<int32_t> out;
  for (int64_t v : load_npy(path).to_i64()) out.push_back(static_cast<int32_t>(v));
  return out;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Writes interleaved int16 frames with libsndfile in the given format (libsndfile widens them
// exactly to 24/32-bit PCM and to float as v / 32768).
void write_shorts(const std::string& path, int format, int rate, int channels,
                  const std::vector<short>& interleaved) {
  SF_INFO info{};
  info.samplerate = rate;
  info.channels = channels;
  info.format = format;
  SNDFILE* f = sf_open(path.c_str(), SFM_WRITE, &info);
  ASSERT_NE(f, nullptr) << sf_strerror(nullptr);
  const sf_count_t frames = static_cast<sf_count_t>(interleaved.size()) / channels;
  ASSERT_EQ(sf_writef_short(f, interleaved.data(), frames), frames);
  sf_close(f);
}

// Writes interleaved float frames with libsndfile in the given format.
void write_sound(const std::string& path, int format, int rate, int channels,
                 const std::vector<float>& interleaved) {
  SF_INFO info{};
  info.samplerate = rate;
  info.channels = channels;
  info.format = format;
  SNDFILE* f = sf_open(path.c_str(), SFM_WRITE, &info);
  ASSERT_NE(f, nullptr) << sf_strerror(nullptr);
  const sf_count_t frames = static_cast<sf_count_t>(interleaved.size()) / channels;
  ASSERT_EQ(sf_writef_float(f, interleaved.data(), frames), frames);
  sf_close(f);
}

std::vector<float> tone(int rate, double seconds, double hz, double amp, int channels = 1) {
  const int64_t n = static_cast<int64_t>(seconds * rate);
  std::vector<float> v(static_cast<size_t>(n * channels));
  for (int64_t i = 0; i < n; ++i)
    for (int c = 0; c < channels; ++c)
      v[static_cast<size_t>(i * channels + c)] = static_cast<float>(
          amp * (c + 1) / channels * std::sin(2 * std::numbers::pi * hz * i / rate));
  return v;
}

const std::shared_ptr<const Model>& audio_model() {
  static const std::shared_ptr<const Model> m = Model::open(afx("model"));
  return m;
}

AudioInput fixture_clip() {
  const AudioClip clip = decode_audio_file(afx("audio/audio.wav"));
  const LogMelFeatures f = log_mel_features(clip.samples);
  return {f.frames, f.values, f.mask};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// decoding

TEST(AudioDecode, FixtureWavIsTheReferenceWaveformExactly) {
  const AudioClip clip = decode_audio_file(afx("audio/audio.wav"));
  const FloatTensor want = load_f32(afx("audio/audio_waveform.npy"));
  EXPECT_EQ(clip.source_rate, 16000);
  EXPECT_EQ(clip.source_channels, 1);
  ASSERT_EQ(clip.samples.size(), want.data.size());
  EXPECT_EQ(clip.samples, want.data);  // int16 × 1/32768, bit-exact
}

TEST(AudioDecode, StereoIsTheMeanOfTheChannelsAndFormatsAgree) {
  const std::string d = gemstage::testing::temp_dir("audio_formats");
  // PCM16 values exactly representable, so every lossless format decodes to the same floats.
  std::vector<short> pcm(2 * 4000);
  std::vector<float> st(pcm.size());
  for (size_t i = 0; i < st.size(); ++i) {
    pcm[i] = static_cast<short>(static_cast<int>((i * 7919) % 60000) - 30000);
    st[i] = static_cast<float>(pcm[i]) * (1.0f / 32768.0f);
  }
  std::vector<float> want(4000);
  for (size_t i = 0; i < want.size(); ++i) want[i] = (st[2 * i] + st[2 * i + 1]) / 2.0f;
  struct Case {
    const char* name;
    int format;
  } cases[] = {{"s16.wav", SF_FORMAT_WAV | SF_FORMAT_PCM_16},
               {"s24.wav", SF_FORMAT_WAV | SF_FORMAT_PCM_24},
               {"s32.wav", SF_FORMAT_WAV | SF_FORMAT_PCM_32},
               {"f32.wav", SF_FORMAT_WAV | SF_FORMAT_FLOAT},
               {"s16.flac", SF_FORMAT_FLAC | SF_FORMAT_PCM_16}};
  for (const Case& c : cases) {
    const std::string p = d + "/" + c.name;
    if ((c.format & SF_FORMAT_SUBMASK) == SF_FORMAT_FLOAT)
      write_sound(p, c.format, 16000, 2, st);  // float files store the values as given
    else
      write_shorts(p, c.format, 16000, 2, pcm);
    const AudioClip clip = decode_audio_file(p);
    EXPECT_EQ(clip.source_channels, 2) << c.name;
    EXPECT_EQ(clip.samples, want) << c.name;
  }
  // MP3 (the other input_audio format OpenAI defines) goes through libsndfile's mpg123.
  write_sound(d + "/t.mp3", SF_FORMAT_MPEG | SF_FORMAT_MPEG_LAYER_III, 16000, 1,
              tone(16000, 1.0, 440, 0.5));
  const AudioClip mp3 = decode_audio_file(d + "/t.mp3");
  EXPECT_EQ(mp3.source_channels, 1);
  EXPECT_NEAR(static_cast<double>(mp3.samples.size()), 16000.0, 2000.0);
  double peak = 0;
  for (float v : mp3.samples) peak = std::max(peak, std::abs(static_cast<double>(v)));
  EXPECT_NEAR(peak, 0.5, 0.1);
  // OGG/Vorbis is lossy: close, not equal.
  const std::vector<float> t = tone(16000, 1.0, 440, 0.5, 2);
  write_sound(d + "/t.ogg", SF_FORMAT_OGG | SF_FORMAT_VORBIS, 16000, 2, t);
  const AudioClip ogg = decode_audio_file(d + "/t.ogg");
  ASSERT_EQ(ogg.samples.size(), 16000u);
  std::vector<double> got, mono;
  for (size_t i = 1000; i < 15000; ++i) {
    got.push_back(ogg.samples[i]);
    mono.push_back((t[2 * i] + t[2 * i + 1]) / 2.0);
  }
  EXPECT_LT(max_abs_diff(got, mono), 0.05);
}

TEST(AudioDecode, OtherRatesAreResampledTo16k) {
  const std::string d = gemstage::testing::temp_dir("audio_resample");
  const std::vector<float> t48 = tone(48000, 1.0, 1000, 0.5);
  write_sound(d + "/t48.wav", SF_FORMAT_WAV | SF_FORMAT_FLOAT, 48000, 1, t48);
  const AudioClip clip = decode_audio_file(d + "/t48.wav");
  EXPECT_EQ(clip.source_rate, 48000);
  ASSERT_NEAR(static_cast<double>(clip.samples.size()), 16000.0, 1.0);
  std::vector<double> got, sine;
  for (size_t i = 500; i < 15500; ++i) {
    got.push_back(clip.samples[i]);
    sine.push_back(0.5 * std::sin(2 * std::numbers::pi * 1000 * static_cast<double>(i) / 16000));
  }
  EXPECT_LT(max_abs_diff(got, sine), 2e-3);
}

TEST(AudioDecode, BadInputGetsClearErrors) {
  const std::string d = gemstage::testing::temp_dir("audio_bad");
  // Over 30 s: refused before the samples are read.
  write_sound(d + "/long.wav", SF_FORMAT_WAV | SF_FORMAT_PCM_16, 16000, 1,
              std::vector<float>(16000 * 31, 0.0f));
  const std::string e1 = error_of([&] { decode_audio_file(d + "/long.wav"); });
  EXPECT_NE(e1.find("long.wav"), std::string::npos) << e1;
  EXPECT_NE(e1.find("at most 30 s"), std::string::npos) << e1;
  std::ofstream(d + "/junk.wav") << "this is not audio at all";
  const std::string e2 = error_of([&] { decode_audio_file(d + "/junk.wav"); });
  EXPECT_NE(e2.find("junk.wav"), std::string::npos) << e2;
  EXPECT_NE(e2.find("not an audio format"), std::string::npos) << e2;
  const uint8_t none[1] = {0};
  EXPECT_NE(error_of([&] { decode_audio(none, 0, "request audio 1"); }).find("request audio 1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { decode_audio_file(d + "/missing.wav"); }).find("missing.wav"),
            std::string::npos);
  // Too short for one feature frame.
  const std::vector<float> tiny(100, 0.1f);
  EXPECT_NE(error_of([&] { log_mel_features(tiny, "tiny clip"); }).find("tiny clip"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// features

TEST(AudioFeatures, FftMatchesADirectDft) {
  std::vector<double> frame(320);
  for (size_t i = 0; i < frame.size(); ++i)
    frame[i] = std::sin(0.37 * static_cast<double>(i)) +
               0.25 * std::cos(1.9 * static_cast<double>(i * i % 97));
  std::vector<double> padded = frame;
  padded.resize(512, 0.0);
  const std::vector<double> direct = dft_magnitude_reference(padded);
  const std::vector<double> fast = fft_magnitude(frame, 512);
  ASSERT_EQ(direct.size(), 257u);
  ASSERT_EQ(fast.size(), 257u);
  EXPECT_LT(max_abs_diff(direct, fast), 1e-10);
}

TEST(AudioFeatures, MelBankIsHtkWithAnEmptyFirstFilter) {
  const std::vector<double> bank = htk_mel_filter_bank();
  ASSERT_EQ(bank.size(), 257u * 128u);
  double f0 = 0, top = 0;
  for (int k = 0; k < 257; ++k) {
    f0 += bank[static_cast<size_t>(k * 128)];
    for (int m = 0; m < 128; ++m) top = std::max(top, bank[static_cast<size_t>(k * 128 + m)]);
  }
  EXPECT_EQ(f0, 0.0);
  EXPECT_LE(top, 1.0);
  EXPECT_GT(top, 0.5);
}

TEST(AudioFeatures, MatchTheFixtureWithinTolerance) {
  const AudioClip clip = decode_audio_file(afx("audio/audio.wav"));
  const LogMelFeatures f = log_mel_features(clip.samples);
  const FloatTensor want = load_f32(afx("audio/audio_features.npy"));
  ASSERT_EQ(f.frames, want.dim(0));
  FloatTensor got({f.frames, 128});
  got.data = f.values;
  const double e = max_abs_diff_rows(got, want);
  std::cout << "audio_features max_abs " << e << " (tolerance 5e-4)\n";
  EXPECT_LE(e, 5e-4);
  const std::vector<int64_t> mask = load_npy(afx("audio/audio_features_mask.npy")).to_i64();
  EXPECT_EQ(std::vector<int64_t>(f.mask.begin(), f.mask.end()), mask);
  EXPECT_EQ(f.valid_frames, 158);
  EXPECT_EQ(audio_soft_tokens_for_samples(25400), 40);
  // The processor's golden counts (gemma4-chat-format.md): 48000 samples -> 75, 640000 -> 750.
  EXPECT_EQ(audio_soft_tokens_for_samples(48000), 75);
  EXPECT_EQ(audio_soft_tokens_for_samples(640000), 750);
}

// ---------------------------------------------------------------------------------------------
// the tower vs the fixture

TEST(AudioTowerFixture, EveryTapWithinTheManifestTolerance) {
  const Model& m = *audio_model();
  ASSERT_NE(m.audio(), nullptr);
  ThreadPool pool(2);
  TapRecorder taps({"all"});
  const FloatTensor soft = m.audio()->encode_all(pool, {fixture_clip()}, &taps);
  const std::vector<int64_t> valid = load_npy(afx("audio/audio_subsample_mask.npy")).to_i64();
  EXPECT_EQ(taps.get_ids("audio_subsample_mask"), valid);
  int64_t nv = 0;
  for (int64_t v : valid) nv += v;
  ASSERT_EQ(nv, 40);
  ASSERT_EQ(soft.dim(0), nv);
  struct Tap {
    const char* name;
    double tol;
  } checks[] = {{"audio_subsample_out", 5e-5},
                {"audio_encoder_out", 1e-4},
                {"audio_tower_out", 1e-4},
                {"audio_embedder_out", 2e-5}};
  for (const Tap& t : checks) {
    const double e = max_abs_diff_rows(taps.get(t.name),
                                       load_f32(afx(std::string("audio/") + t.name + ".npy")), nv);
    std::cout << t.name << " max_abs (valid rows) " << e << " (tolerance " << t.tol << ")\n";
    EXPECT_LE(e, t.tol) << t.name;
  }
  const FloatTensor layers = taps.get("audio_layer_out"),
                    want = load_f32(afx("audio/audio_layer_out.npy"));
  ASSERT_EQ(layers.shape, want.shape);
  const int64_t T = want.dim(1), H = want.dim(2);
  double e = 0;
  for (int64_t l = 0; l < want.dim(0); ++l)
    for (int64_t i = 0; i < nv * H; ++i)
      e = std::max(e,
                   std::abs(static_cast<double>(layers.data[static_cast<size_t>(l * T * H + i)]) -
                            want.data[static_cast<size_t>(l * T * H + i)]));
  std::cout << "audio_layer_out max_abs (valid rows) " << e << " (tolerance 1e-4)\n";
  EXPECT_LE(e, 1e-4);
}

TEST(AudioTowerFixture, TensorTableDeclaresEveryAudioWeight) {
  const ModelConfig& c = audio_model()->config();
  const std::vector<TensorSpec> specs = audio_tensor_specs(c);
  EXPECT_EQ(specs.size(), 7u + 62u * 2u + 1u);  // manifest audio_weight_count 132 (+ embed_audio)
  for (const TensorSpec& s : specs) {
    EXPECT_EQ(s.held_by, kPartAudio) << s.key;
    EXPECT_TRUE(s.storage == TensorStorage::VisionMatrix ||
                s.storage == TensorStorage::VisionVector)
        << s.key;
  }
}

TEST(AudioTowerFixture, BadFeatureMasksAreRefused) {
  const Model& m = *audio_model();
  ThreadPool pool(1);
  AudioInput clip = fixture_clip();
  clip.mask[3] = 0;  // a hole: not what the feature extractor makes
  EXPECT_NE(error_of([&] { m.audio()->encode(pool, clip, nullptr); }).find("follows an invalid"),
            std::string::npos);
  clip = fixture_clip();
  clip.features.resize(10);
  EXPECT_NE(error_of([&] { m.audio()->encode(pool, clip, nullptr); }).find("128 mel bins"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// the embeddings stage contract and the full forward

TEST(AudioStage, EmbeddingsStageNamesTheAudioInputsAndMasksAudioRows) {
  const Model& m = *audio_model();
  const Stage& st = m.embeddings();
  auto has = [](const std::vector<TensorDecl>& v, const char* n) {
    return std::any_of(v.begin(), v.end(), [&](const TensorDecl& d) { return d.name == n; });
  };
  EXPECT_TRUE(has(st.contract().inputs, "audio_features"));
  EXPECT_TRUE(has(st.contract().inputs, "audio_features_mask"));
  EXPECT_TRUE(has(st.contract().inputs, "audio_soft_tokens"));
  EXPECT_TRUE(has(st.contract().outputs, "audio_splice_mask"));
  const AudioInput clip = fixture_clip();
  const std::vector<int32_t> ids = load_ids32(afx("audio/input_ids.npy"));
  TensorMap in;
  in["input_ids"] = HostTensor({static_cast<int64_t>(ids.size())}, ids);
  in["audio_features"] = HostTensor({1, clip.frames, 128}, clip.features);
  in["audio_features_mask"] = HostTensor({1, clip.frames}, clip.mask);
  ThreadPool pool(2);
  TensorMap out = st.run(pool, in, nullptr, {}, nullptr);
  const auto amask = out.at("audio_splice_mask").values<uint8_t>();
  const auto imask = out.at("image_splice_mask").values<uint8_t>();
  const auto ple = out.at("ple_token_ids").values<int32_t>();
  for (size_t r = 0; r < ids.size(); ++r) {
    EXPECT_EQ(amask[r], ids[r] == 2041 ? 1 : 0) << "row " << r;
    EXPECT_EQ(imask[r], 0) << "row " << r;
    if (ids[r] == 2041) {
      EXPECT_EQ(ple[r], 0) << "row " << r;
    }
  }
  FloatTensor hs = out.at("hidden_states").take_float();
  const double e = max_abs_diff_rows(hs, load_f32(afx("audio/inputs_embeds.npy")));
  std::cout << "embeddings stage hidden_states vs inputs_embeds max_abs " << e
            << " (tolerance 2e-5)\n";
  EXPECT_LE(e, 2e-5);
  // A wrong placeholder count is refused, naming both counts.
  in["input_ids"] = HostTensor({5}, std::vector<int32_t>{2, 2041, 2041, 5, 6});
  const std::string err = error_of([&] { st.run(pool, in, nullptr, {}, nullptr); });
  EXPECT_NE(err.find("2 audio placeholder rows"), std::string::npos) << err;
  EXPECT_NE(err.find("yields 40 soft tokens"), std::string::npos) << err;
}

struct AudioRun {
  std::unique_ptr<TapRecorder> taps;
  std::vector<int64_t> decode_ids;
  FloatTensor decode_logits;
};

AudioRun run_audio(PleIdentity mode, int64_t chunk, int steps) {
  const Model& m = *audio_model();
  AudioRun r;
  r.taps = std::make_unique<TapRecorder>(std::vector<std::string>{"all"});
  ThreadPool pool(2);
  const std::vector<int32_t> ids = load_ids32(afx("audio/input_ids.npy"));
  const FloatTensor soft = m.audio()->encode_all(pool, {fixture_clip()}, r.taps.get());
  TextRunOptions opt;
  opt.ple_identity = mode;
  Sequence seq(audio_model(), static_cast<int64_t>(ids.size()) + steps + 1);
  const FloatTensor last = seq.prefill(pool, ids, &soft, chunk, true, r.taps.get(), opt);
  const int64_t V = m.config().text.vocab_size;
  std::vector<float> row(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
  r.decode_logits = FloatTensor({steps, V});
  for (int s = 0; s < steps; ++s) {
    const int64_t best = std::max_element(row.begin(), row.end()) - row.begin();
    r.decode_ids.push_back(best);
    std::copy(row.begin(), row.end(), r.decode_logits.row(s));
    if (s + 1 == steps) break;
    const int32_t next = static_cast<int32_t>(best);
    const FloatTensor l =
        seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr, opt);
    row.assign(l.row(0), l.row(0) + V);
  }
  return r;
}

TEST(AudioFixture, PrefillAndGreedyDecodeMatch) {
  const AudioRun r = run_audio(PleIdentity::Pad, 0, 8);
  const TapRecorder& t = *r.taps;
  const double e_ie =
      max_abs_diff_rows(t.get("inputs_embeds"), load_f32(afx("audio/inputs_embeds.npy")));
  const double e_pli =
      max_abs_diff_rows(t.get("per_layer_inputs"), load_f32(afx("audio/per_layer_inputs.npy")));
  const double e_lg = max_abs_diff_rows(t.get("logits"), load_f32(afx("audio/logits.npy")));
  const double e_dl = max_abs_diff_rows(r.decode_logits, load_f32(afx("audio/decode_logits.npy")));
  std::cout << "audio prompt: max_abs inputs_embeds " << e_ie << " (2e-5), per_layer_inputs "
            << e_pli << " (1e-4), logits " << e_lg << " (2e-4), decode_logits " << e_dl
            << " (2e-4)\n";
  EXPECT_LE(e_ie, 2e-5);
  EXPECT_LE(e_pli, 1e-4);
  EXPECT_LE(e_lg, 2e-4);
  EXPECT_LE(e_dl, 2e-4);
  EXPECT_EQ(r.decode_ids, load_npy(afx("audio/decode_ids.npy")).to_i64());
  EXPECT_EQ(t.get_ids("llm_input_ids"), load_npy(afx("audio/llm_input_ids.npy")).to_i64());
  EXPECT_EQ(t.get_ids("ple_ids"), load_npy(afx("audio/ple_ids.npy")).to_i64());
}

TEST(AudioFixture, ChunkedPrefillSplicesEachChunksOwnRows) {
  const AudioRun whole = run_audio(PleIdentity::Pad, 0, 8);
  const AudioRun chunked = run_audio(PleIdentity::Pad, 5, 8);
  EXPECT_EQ(chunked.decode_ids, whole.decode_ids);
  EXPECT_LE(max_abs_diff_rows(chunked.taps->get("inputs_embeds"), whole.taps->get("inputs_embeds")),
            0.0);
  EXPECT_LE(max_abs_diff_rows(chunked.taps->get("logits"), load_f32(afx("audio/logits.npy"))),
            2e-4);
}

TEST(AudioFixture, RawIdDiagnosticShowsTheBugOnlyOnAudioRows) {
  const AudioRun pad = run_audio(PleIdentity::Pad, 0, 8);
  const AudioRun raw = run_audio(PleIdentity::Raw, 0, 8);
  EXPECT_EQ(raw.decode_ids, load_npy(afx("audio/decode_ids_rawid.npy")).to_i64());
  EXPECT_NE(raw.decode_ids, pad.decode_ids);
  EXPECT_LE(max_abs_diff_rows(raw.taps->get("per_layer_inputs"),
                              load_f32(afx("audio/per_layer_inputs_rawid.npy"))),
            1e-4);
  const std::vector<int32_t> ids = load_ids32(afx("audio/input_ids.npy"));
  const FloatTensor a = pad.taps->get("per_layer_inputs"), b = raw.taps->get("per_layer_inputs");
  const int64_t w = a.numel() / a.dim(0);
  ASSERT_EQ(a.shape, b.shape);
  for (int64_t r = 0; r < a.dim(0); ++r) {
    const auto at = static_cast<size_t>(r * w), n = static_cast<size_t>(w);
    const double d = max_abs_diff(std::span<const float>(a.data).subspan(at, n),
                                  std::span<const float>(b.data).subspan(at, n));
    if (ids[static_cast<size_t>(r)] == 2041)
      EXPECT_GT(d, 1e-3) << "audio row " << r;
    else
      EXPECT_EQ(d, 0.0) << "text row " << r;
  }
}

// ---------------------------------------------------------------------------------------------
// bundles and the command line

namespace {

int run_cli(const std::string& args, const std::string& log) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + log + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

}  // namespace

TEST(AudioBundle, ExportedTowerRunsInTheEmbeddingsStageAndChecks) {
  const std::string d = gemstage::testing::temp_dir("audio_bundle"), log = d + "/log.txt";
  ASSERT_EQ(
      run_cli("export -m " + afx("model") + " --out " + d + "/b --stages 2 --weights q8_0", log), 0)
      << read_text(log);
  ASSERT_EQ(run_cli("check " + d + "/b", log), 0) << read_text(log);
  EXPECT_NE(read_text(log).find("a synthetic 1 s clip through the audio tower"), std::string::npos)
      << read_text(log);
  // The tower stays f32/bf16 in a quantized bundle, so its soft tokens are the checkpoint's.
  const auto bundle = Model::open(d + "/b");
  ASSERT_NE(bundle->audio(), nullptr);
  ThreadPool pool(2);
  const FloatTensor a = bundle->audio()->encode_all(pool, {fixture_clip()}, nullptr);
  const FloatTensor b = audio_model()->audio()->encode_all(pool, {fixture_clip()}, nullptr);
  EXPECT_LE(max_abs_diff_rows(a, b), 2e-2);  // bf16 tower matrices in a q8_0 bundle
  EXPECT_LE(max_abs_diff_rows(a, load_f32(afx("audio/audio_embedder_out.npy"))), 2e-2);
}

TEST(AudioCli, DumpWritesTheFixtureTapsAndInfoListsTheTower) {
  const std::string d = gemstage::testing::temp_dir("audio_cli"), log = d + "/log.txt";
  const std::string args = "dump -m " + afx("model") + " --ids " + afx("audio/input_ids.npy") +
                           " --audio " + afx("audio/audio.wav") + " --out " + d +
                           "/taps --decode 8 --chunk 9 -t 2 --taps all";
  ASSERT_EQ(run_cli(args, log), 0) << read_text(log);
  for (const char* tap : {"audio_features", "audio_subsample_out", "audio_encoder_out",
                          "audio_tower_out", "audio_embedder_out", "audio_layer_out"}) {
    const FloatTensor got = load_f32(d + "/taps/" + tap + ".npy");
    const FloatTensor want = load_f32(afx(std::string("audio/") + tap + ".npy"));
    EXPECT_EQ(got.shape, want.shape) << tap;
    if (std::string(tap) != "audio_layer_out") {
      EXPECT_LE(max_abs_diff_rows(got, want, 40), 5e-4) << tap;
    }
  }
  EXPECT_EQ(load_f32(d + "/taps/audio_waveform.npy").data,
            load_f32(afx("audio/audio_waveform.npy")).data);
  EXPECT_EQ(load_npy(d + "/taps/decode_ids.npy").to_i64(),
            load_npy(afx("audio/decode_ids.npy")).to_i64());
  EXPECT_LE(max_abs_diff_rows(load_f32(d + "/taps/logits.npy"), load_f32(afx("audio/logits.npy"))),
            2e-4);
  // audio_splice_mask marks exactly the audio rows; image_splice_mask none of them.
  const std::vector<int64_t> ids = load_npy(afx("audio/input_ids.npy")).to_i64();
  const std::vector<int64_t> am = load_npy(d + "/taps/audio_splice_mask.npy").to_i64();
  const std::vector<int64_t> im = load_npy(d + "/taps/image_splice_mask.npy").to_i64();
  for (size_t r = 0; r < ids.size(); ++r) {
    EXPECT_EQ(am[r], ids[r] == 2041 ? 1 : 0) << r;
    EXPECT_EQ(im[r], 0) << r;
  }
  // A prompt whose placeholder count does not match the clip is refused.
  EXPECT_NE(run_cli("dump -m " + afx("model") + " --ids " + afx("audio/decode_ids.npy") +
                        " --audio " + afx("audio/audio.wav") + " --out " + d + "/t2",
                    log),
            0);
  EXPECT_NE(read_text(log).find("audio placeholder tokens"), std::string::npos) << read_text(log);
  ASSERT_EQ(run_cli("info --model " + afx("model"), log), 0) << read_text(log);
  EXPECT_NE(read_text(log).find("audio        hidden=64 layers=2 heads=4"), std::string::npos)
      << read_text(log);
  EXPECT_NE(read_text(log).find("audio tower + embedder"), std::string::npos) << read_text(log);
}

TEST(AudioCli, GenerateTakesAnAudioFileAndRefusesBadOnes) {
  const std::string d = gemstage::testing::temp_dir("audio_gen"), log = d + "/log.txt";
  ASSERT_EQ(run_cli("generate -m " + afx("model") + " --audio " + afx("audio/audio.wav") +
                        " -p hello -n 4 --temp 0 --json",
                    log),
            0)
      << read_text(log);
  const std::string out = read_text(log);
  // <|audio> + 40 × <|audio|> + <audio|> in the prompt.
  std::string forty;
  for (int i = 0; i < 40; ++i) forty += "2041,";
  EXPECT_NE(out.find("2001," + forty + "2043"), std::string::npos) << out;
  std::ofstream(d + "/bad.mp3") << "not an mp3";
  EXPECT_NE(run_cli("generate -m " + afx("model") + " --audio " + d + "/bad.mp3 -p x -n 1", log),
            0);
  EXPECT_NE(read_text(log).find("bad.mp3: not an audio format"), std::string::npos)
      << read_text(log);
  // A model without an audio tower says so.
  EXPECT_NE(run_cli("generate -m " + std::string(GEMSTAGE_FIXTURES) +
                        "/gemma4-tiny/model --audio " + afx("audio/audio.wav") + " -p x -n 1",
                    log),
            0);
  EXPECT_NE(read_text(log).find("no audio tower"), std::string::npos) << read_text(log);
}

TEST(AudioCli, ParityHasAudioRowsAnAudioGateAndShowsTheRawIdBugOnAudioRowsOnly) {
  const std::string d = gemstage::testing::temp_dir("audio_parity"), log = d + "/log.txt";
  const std::string base =
      "parity -m " + afx("model") + " -r " + afx("audio") + " -t 2 --report " + d + "/r.json";
  ASSERT_EQ(run_cli(base + " --gate 'per_layer_inputs.audio.cos_min>=0.999'" +
                        " --gate 'audio_gate.step_logits_change>0' --gate 'teacher_forced>=1'" +
                        " --gate 'audio_encoder_out.max_abs<=1e-4'",
                    log),
            0)
      << read_text(log);
  EXPECT_NE(read_text(log).find("audio 40"), std::string::npos) << read_text(log);
  EXPECT_NE(read_text(log).find("audio gate (blank = silence)"), std::string::npos);
  EXPECT_NE(read_text(log).find("no divergence"), std::string::npos) << read_text(log);
  // The raw-id diagnostic: text rows stay exact, audio rows diverge (gate fails: exit 3).
  EXPECT_EQ(run_cli(base + " --ple-identity raw --gate 'per_layer_inputs.text.max_abs<=1e-4'" +
                        " --gate 'per_layer_inputs.audio.cos_min>=0.999'",
                    log),
            3)
      << read_text(log);
  EXPECT_NE(read_text(log).find("gate PASS  per_layer_inputs.text.max_abs<=1e-4"),
            std::string::npos)
      << read_text(log);
  EXPECT_NE(read_text(log).find("gate FAIL  per_layer_inputs.audio.cos_min>=0.999"),
            std::string::npos)
      << read_text(log);
}

// ---------------------------------------------------------------------------------------------
// serve: OpenAI input_audio content parts

namespace {

std::string wav_base64() {
  const std::string bytes = read_text(afx("audio/audio.wav"));
  return encode_base64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}

nlohmann::json audio_message(const std::string& data, const std::string& format) {
  return {{"role", "user"},
          {"content",
           nlohmann::json::array(
               {{{"type", "input_audio"}, {"input_audio", {{"data", data}, {"format", format}}}},
                {{"type", "text"}, {"text", "hello"}}})}};
}

// The error of a request the parser refuses: status, param and message.
std::string api_error(const nlohmann::json& body, std::string* param = nullptr) {
  try {
    parse_chat_request(body);
  } catch (const ApiError& e) {
    if (param) *param = e.param();
    return std::to_string(e.status()) + " " + e.what();
  }
  return "(accepted)";
}

}  // namespace

TEST(AudioServe, InputAudioPartsAreDecodedOrRefusedWithA400) {
  const nlohmann::json ok = {{"messages", {audio_message(wav_base64(), "wav")}}};
  const ChatRequest r = parse_chat_request(ok);
  ASSERT_EQ(r.messages[0].parts.size(), 2u);
  ASSERT_TRUE(r.messages[0].parts[0].audio);
  EXPECT_EQ(r.messages[0].parts[0].audio->samples, load_f32(afx("audio/audio_waveform.npy")).data);
  std::string param;
  std::string e = api_error({{"messages", {audio_message(wav_base64(), "aac")}}}, &param);
  EXPECT_NE(e.find("400 audio format 'aac' cannot be decoded"), std::string::npos) << e;
  EXPECT_EQ(param, "messages[0].content[0].input_audio.format");
  const std::string junk = encode_base64(reinterpret_cast<const uint8_t*>("not audio"), 9);
  e = api_error({{"messages", {audio_message(junk, "mp3")}}}, &param);
  EXPECT_NE(e.find("400 the mp3 audio in messages[0].content[0].input_audio.data: not an audio "
                   "format gemstage can decode"),
            std::string::npos)
      << e;
  e = api_error({{"messages", {audio_message("%%%", "wav")}}});
  EXPECT_NE(e.find("not valid base64"), std::string::npos) << e;
  nlohmann::json assistant = audio_message(wav_base64(), "wav");
  assistant["role"] = "assistant";
  e = api_error({{"messages", {assistant}}});
  EXPECT_NE(e.find("audio is only accepted in user and tool messages"), std::string::npos) << e;
}

TEST(AudioServe, ChatCompletionWithInputAudioEqualsGenerateAudio) {
  ServerOptions o = gemstage::testing::tiny_server_options();
  o.model_path = afx("model");
  o.parallel = 1;
  o.defaults.max_tokens = 4;
  const auto server = gemstage::testing::start_server(std::move(o));
  Server& s = *server;
  httplib::Client c = gemstage::testing::server_client(s);
  const nlohmann::json body = {
      {"messages", {audio_message(wav_base64(), "wav")}}, {"max_tokens", 4}, {"temperature", 0}};
  const auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const nlohmann::json j = nlohmann::json::parse(r->body);
  const std::string d = gemstage::testing::temp_dir("audio_serve"), log = d + "/log.txt";
  ASSERT_EQ(run_cli("generate -m " + afx("model") + " --audio " + afx("audio/audio.wav") +
                        " -p hello -n 4 --temp 0 --json -t 2",
                    log),
            0)
      << read_text(log);
  const std::string out = read_text(log);
  const nlohmann::json want = nlohmann::json::parse(out.substr(0, out.find('\n')));
  EXPECT_EQ(j["choices"][0]["message"]["content"], want["text"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_tokens"]);
  // vLLM's audio_url part with a data URL is the same clip.
  const nlohmann::json url_body = {
      {"messages",
       {{{"role", "user"},
         {"content",
          {{{"type", "audio_url"},
            {"audio_url", {{"url", "data:audio/wav;base64," + wav_base64()}}}},
           {{"type", "text"}, {"text", "hello"}}}}}}},
      {"max_tokens", 4},
      {"temperature", 0}};
  const auto by_url = c.Post("/v1/chat/completions", url_body.dump(), "application/json");
  ASSERT_TRUE(by_url);
  ASSERT_EQ(by_url->status, 200) << by_url->body;
  EXPECT_EQ(nlohmann::json::parse(by_url->body)["choices"][0]["message"]["content"], want["text"]);
  // An undecodable clip is a 400 that says so.
  const auto bad =
      c.Post("/v1/chat/completions",
             nlohmann::json({{"messages", {audio_message(wav_base64(), "m4a")}}}).dump(),
             "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_NE(bad->body.find("audio format 'm4a' cannot be decoded"), std::string::npos) << bad->body;
  s.shutdown();
}

TEST(AudioSplice, ImageAndAudioSoftTokensFillTheirOwnRowsInOrder) {
  const ModelConfig& c = audio_model()->config();
  const std::vector<int32_t> ids = {2,
                                    c.boa_token_id,
                                    c.audio_token_id,
                                    c.audio_token_id,
                                    c.eoa_token_id,
                                    c.boi_token_id,
                                    c.image_token_id,
                                    c.eoi_token_id,
                                    7,
                                    c.audio_token_id};
  FloatTensor vis({1, 2}), aud({3, 2});
  vis.data = {10, 11};
  aud.data = {20, 21, 30, 31, 40, 41};
  const FloatTensor m = merge_soft_tokens(c, ids, &vis, &aud);
  EXPECT_EQ(m.data, (std::vector<float>{20, 21, 30, 31, 10, 11, 40, 41}));
  FloatTensor two({2, 2});
  EXPECT_NE(error_of([&] { merge_soft_tokens(c, ids, &vis, &two); }).find("3 audio placeholder"),
            std::string::npos);
  EXPECT_NE(error_of([&] { merge_soft_tokens(c, ids, nullptr, &aud); }).find("no image was given"),
            std::string::npos);
  // More than 30 s of frames is refused before the tower runs.
  AudioInput huge;
  huge.frames = 3001;
  huge.features.assign(3001 * 128, 0.0f);
  huge.mask.assign(3001, 1);
  ThreadPool pool(1);
  EXPECT_NE(error_of([&] { audio_model()->audio()->encode(pool, huge, nullptr); }).find("30 s"),
            std::string::npos);
}
