// Video decoding and preprocessing (src/video) against the goldens scripts/video_reference.py
// wrote for the clips in tests/fixtures/video: a numpy port of transformers' Gemma 4 video path
// (torchcodec's exact-mode metadata, BaseVideoProcessor.sample_frames, torch's uint8 antialiased
// bicubic resize, the fused rescale/normalize, patches, positions, replace_video_token's
// timestamps) with frames decoded by the ffmpeg program. docs/video.md says what is ported.
#include <openssl/evp.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/mapped_file.h"
#include "test_util.h"
#include "video/video_decode.h"
#include "video/video_processor.h"

namespace gemstage {
namespace {

using testing::error_of;
using testing::max_abs_diff;

std::string clip_path(const std::string& name) {
  return std::string(GEMSTAGE_FIXTURES) + "/video/" + name;
}

const nlohmann::json& goldens() {
  static const nlohmann::json j = nlohmann::json::parse(read_text_file(clip_path("goldens.json")));
  return j;
}

std::vector<std::string> clip_names() {
  std::vector<std::string> names;
  for (const auto& [name, _] : goldens().items()) names.push_back(name);
  return names;
}

std::string sha256_hex(const std::vector<uint8_t>& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), digest, &n, EVP_sha256(), nullptr);
  static const char* hex = "0123456789abcdef";
  std::string out;
  for (unsigned i = 0; i < n; ++i) {
    out += hex[digest[i] >> 4];
    out += hex[digest[i] & 15];
  }
  return out;
}

VideoProcessorConfig config_of(const nlohmann::json& g) {
  VideoProcessorConfig c;
  c.frame.patch_size = g["patch_size"].get<int>();
  c.frame.pooling_kernel_size = g["pooling_kernel_size"].get<int>();
  c.frame.max_soft_tokens = g["max_soft_tokens"].get<int>();
  c.num_frames = g["num_frames"].get<int>();
  return c;
}

std::vector<int64_t> golden_indices(const nlohmann::json& g) {
  return g["indices"].get<std::vector<int64_t>>();
}

// ---------------------------------------------------------------------------------------------
// Sampling and timestamps

TEST(VideoSampling, MatchesTorchArangeOnHandComputedCases) {
  // numpy: (np.arange(ceil(total / step)) * step).astype(float32).astype(int32), step =
  // total / n, i.e. torch.arange(0, total, total / n).int().
  EXPECT_EQ(uniform_frame_indices(100, 3), (std::vector<int64_t>{0, 33, 66}));
  EXPECT_EQ(uniform_frame_indices(7, 3), (std::vector<int64_t>{0, 2, 4}));
  EXPECT_EQ(uniform_frame_indices(1000, 7),
            (std::vector<int64_t>{0, 142, 285, 428, 571, 714, 857}));
  EXPECT_EQ(uniform_frame_indices(50, 32),
            (std::vector<int64_t>{0,  1,  3,  4,  6,  7,  9,  10, 12, 14, 15, 17, 18, 20, 21, 23,
                                  25, 26, 28, 29, 31, 32, 34, 35, 37, 39, 40, 42, 43, 45, 46, 48}));
  const std::vector<int64_t> long_clip = uniform_frame_indices(36000, 32);  // 10 min at 60 fps
  ASSERT_EQ(long_clip.size(), 32u);
  EXPECT_EQ(long_clip[1], 1125);
  EXPECT_EQ(long_clip[31], 34875);
  // Fewer frames than asked: every frame (transformers raises).
  EXPECT_EQ(uniform_frame_indices(10, 32), (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  EXPECT_EQ(uniform_frame_indices(1, 32), (std::vector<int64_t>{0}));
  // 15 / (15 / 13) rounds above 13: torch's arange has 14 elements, the last one 15 (past the
  // end, where transformers fails); it is dropped.
  EXPECT_EQ(uniform_frame_indices(15, 13),
            (std::vector<int64_t>{0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12, 13}));
  EXPECT_EQ(uniform_frame_indices(17, 7), (std::vector<int64_t>{0, 2, 4, 7, 9, 12, 14}));
  EXPECT_NE(error_of([] { uniform_frame_indices(0, 32); }), "(no error)");
  EXPECT_NE(error_of([] { uniform_frame_indices(10, 0); }), "(no error)");
}

TEST(VideoSampling, TimestampsFormatLikePython) {
  // f"{int(s // 60):02d}:{int(s % 60):02d}" evaluated by CPython.
  EXPECT_EQ(format_timestamp(0.0), "00:00");
  EXPECT_EQ(format_timestamp(0.04), "00:00");
  EXPECT_EQ(format_timestamp(59.999), "00:59");
  EXPECT_EQ(format_timestamp(60.0), "01:00");
  EXPECT_EQ(format_timestamp(61.5), "01:01");
  EXPECT_EQ(format_timestamp(119.99999999999999), "01:59");
  EXPECT_EQ(format_timestamp(3599.9), "59:59");
  EXPECT_EQ(format_timestamp(3600.5), "60:00");
  EXPECT_EQ(format_timestamp(6000.0), "100:00");
  EXPECT_EQ(format_timestamp(100000.5), "1666:40");
  EXPECT_NE(error_of([] { format_timestamp(NAN); }), "(no error)");
}

TEST(VideoSampling, IndicesAndTimestampsMatchTheGoldens) {
  for (const std::string& name : clip_names()) {
    const nlohmann::json& clip = goldens()[name];
    for (const char* cfg : {"default", "small", "small8"}) {
      const nlohmann::json& g = clip[cfg];
      SCOPED_TRACE(name + " " + cfg);
      const auto indices = uniform_frame_indices(clip["total_frames"].get<int64_t>(),
                                                 g["num_frames"].get<int64_t>());
      EXPECT_EQ(indices, golden_indices(g));
      const double fps = clip["fps"].get<double>();
      const auto stamps = g["timestamps"].get<std::vector<std::string>>();
      ASSERT_EQ(stamps.size(), indices.size());
      for (size_t k = 0; k < indices.size(); ++k)
        EXPECT_EQ(format_timestamp(static_cast<double>(indices[k]) / fps), stamps[k]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Decoding

TEST(VideoDecode, MetadataMatchesTheScanOfAnotherReader) {
  for (const std::string& name : clip_names()) {
    SCOPED_TRACE(name);
    const nlohmann::json& g = goldens()[name];
    auto d = VideoDecoder::open_file(clip_path(name));
    const VideoInfo& info = d->info();
    EXPECT_EQ(info.total_frames, g["total_frames"].get<int64_t>());
    EXPECT_EQ(info.width, g["width"].get<int>());
    EXPECT_EQ(info.height, g["height"].get<int>());
    EXPECT_EQ(info.codec, g["codec"].get<std::string>());
    // The same double operations as the reference: equal, not just close.
    EXPECT_EQ(info.fps, g["fps"].get<double>());
    EXPECT_EQ(info.duration_seconds, g["duration"].get<double>());
  }
}

TEST(VideoDecode, SampledFramesEqualTheFfmpegProgramsFrames) {
  for (const std::string& name : clip_names()) {
    for (const char* cfg : {"default", "small8"}) {
      SCOPED_TRACE(name + " " + cfg);
      const nlohmann::json& g = goldens()[name][cfg];
      const auto indices = golden_indices(g);
      const auto sha = g["rgb_sha256"].get<std::vector<std::string>>();
      auto d = VideoDecoder::open_file(clip_path(name));
      size_t seen = 0;
      const VideoDecodeStats stats = d->decode_frames(indices, [&](size_t k, const RgbImage& rgb) {
        ASSERT_EQ(k, seen);
        EXPECT_EQ(rgb.width, d->info().width);
        EXPECT_EQ(rgb.height, d->info().height);
        EXPECT_EQ(sha256_hex(rgb.rgb), sha[k]) << "frame index " << indices[k];
        ++seen;
      });
      EXPECT_EQ(seen, indices.size());
      EXPECT_EQ(stats.frames_converted, static_cast<int64_t>(indices.size()));
    }
  }
}

TEST(VideoDecode, SeeksInsteadOfDecodingTheWholeClip) {
  // 130 frames, a key frame every 20: the last frame needs its own group only.
  auto d = VideoDecoder::open_file(clip_path("h264_1fps_32x24.mp4"));
  const std::vector<int64_t> last = {0, 129};
  int calls = 0;
  const VideoDecodeStats s = d->decode_frames(last, [&](size_t, const RgbImage&) { ++calls; });
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(s.seeks, 2);
  EXPECT_LT(s.packets_decoded, 50) << "decoded " << s.packets_decoded << " of 130 packets";
  EXPECT_EQ(s.frames_converted, 2);
  // Samples inside one group of pictures continue decoding without seeking again.
  const std::vector<int64_t> close = {40, 42, 44};
  const VideoDecodeStats c = d->decode_frames(close, [](size_t, const RgbImage&) {});
  EXPECT_EQ(c.seeks, 1);
  EXPECT_EQ(c.frames_converted, 3);
}

TEST(VideoDecode, MemoryInputDecodesLikeTheFile) {
  const std::string name = "vp9_30fps_80x80.webm";
  MappedFile f(clip_path(name));
  std::vector<uint8_t> bytes(f.data(), f.data() + f.size());
  auto d = VideoDecoder::open_memory(bytes, "request video 1");
  EXPECT_EQ(d->info().total_frames, goldens()[name]["total_frames"].get<int64_t>());
  const nlohmann::json& g = goldens()[name]["default"];
  const auto sha = g["rgb_sha256"].get<std::vector<std::string>>();
  d->decode_frames(golden_indices(g),
                   [&](size_t k, const RgbImage& rgb) { EXPECT_EQ(sha256_hex(rgb.rgb), sha[k]); });
}

TEST(VideoDecode, BadInputIsAClearError) {
  const std::string missing = clip_path("no_such_clip.mp4");
  EXPECT_NE(error_of([&] { VideoDecoder::open_file(missing); }).find(missing), std::string::npos);
  const std::vector<uint8_t> garbage(4096, 0x5a);
  const std::string e = error_of([&] { VideoDecoder::open_memory(garbage, "request video 2"); });
  EXPECT_NE(e.find("request video 2"), std::string::npos) << e;
  EXPECT_NE(e.find("not a video"), std::string::npos) << e;
  EXPECT_NE(error_of([] { VideoDecoder::open_memory({}, "request video 3"); }), "(no error)");
  // A PNG (another FFmpeg demuxer) is not on the list of containers.
  const std::string png = std::string(GEMSTAGE_FIXTURES) + "/image/resize/src.png";
  EXPECT_NE(error_of([&] { VideoDecoder::open_file(png); }).find("not a video"), std::string::npos);
  // Every prefix of a clip either opens and decodes or fails with an Error; none crashes.
  MappedFile f(clip_path("h264_25fps_96x64.mp4"));
  for (size_t n :
       {size_t{16}, size_t{64}, size_t{700}, f.size() / 3, f.size() / 2, f.size() - 100}) {
    std::vector<uint8_t> part(f.data(), f.data() + n);
    error_of([&] {
      auto d = VideoDecoder::open_memory(part, "truncated clip");
      const auto idx = uniform_frame_indices(d->info().total_frames, 32);
      d->decode_frames(idx, [](size_t, const RgbImage&) {});
    });
  }
}

TEST(VideoDecode, LimitsAreCheckedBeforeDecoding) {
  VideoLimits small_frames;
  small_frames.max_frame_pixels = 1000;  // the clip is 96 x 64
  const std::string e =
      error_of([&] { VideoDecoder::open_file(clip_path("h264_25fps_96x64.mp4"), small_frames); });
  EXPECT_NE(e.find("over the limit of 1000 pixels"), std::string::npos) << e;
  VideoLimits few_frames;
  few_frames.max_stream_frames = 10;
  const std::string f =
      error_of([&] { VideoDecoder::open_file(clip_path("h264_1fps_32x24.mp4"), few_frames); });
  EXPECT_NE(f.find("more than 10 frames"), std::string::npos) << f;
  auto d = VideoDecoder::open_file(clip_path("gif_10fps_48x32.gif"));
  const std::vector<int64_t> past_end = {10};
  EXPECT_NE(error_of([&] {
              d->decode_frames(past_end, [](size_t, const RgbImage&) {});
            }).find("outside the video's 10 frames"),
            std::string::npos);
  const std::vector<int64_t> backwards = {3, 2};
  EXPECT_NE(error_of([&] {
              d->decode_frames(backwards, [](size_t, const RgbImage&) {});
            }).find("must increase"),
            std::string::npos);
}

// ---------------------------------------------------------------------------------------------
// Preprocessing

TEST(VideoProcessor, FullTensorsEqualTheReference) {
  for (const std::string& name : clip_names()) {
    SCOPED_TRACE(name);
    const nlohmann::json& g = goldens()[name]["small8"];
    const ProcessedVideo v = process_video_file(clip_path(name), config_of(g));
    EXPECT_EQ(v.frame_indices, golden_indices(g));
    EXPECT_EQ(v.num_soft_tokens_per_frame, g["soft_tokens_per_frame"].get<int>());
    const std::string stem = clip_path(name) + ".small8.";
    const NpyArray pv = load_npy(stem + "pixel_values_videos.npy");
    const NpyArray pid = load_npy(stem + "video_position_ids.npy");
    ASSERT_EQ(pv.shape, (Shape{v.num_frames, v.max_patches, v.patch_dim}));
    EXPECT_EQ(max_abs_diff(v.pixel_values, pv.to_f32()), 0.0);
    EXPECT_EQ(v.position_ids, pid.to_i64());
  }
}

TEST(VideoProcessor, PerFrameSumsEqualTheReference) {
  for (const std::string& name : clip_names()) {
    for (const char* cfg : {"default", "small"}) {
      SCOPED_TRACE(name + " " + cfg);
      const nlohmann::json& g = goldens()[name][cfg];
      const ProcessedVideo v = process_video_file(clip_path(name), config_of(g));
      ASSERT_EQ(v.frame_indices, golden_indices(g));
      EXPECT_EQ(v.num_soft_tokens_per_frame, g["soft_tokens_per_frame"].get<int>());
      EXPECT_EQ((std::vector<int>{v.resized_h, v.resized_w}), g["resized"].get<std::vector<int>>());
      EXPECT_EQ(v.max_patches, g["max_patches"].get<int>());
      const auto sums = g["pixel_sums"].get<std::vector<double>>();
      const auto sq = g["pixel_sq_sums"].get<std::vector<double>>();
      const size_t per_frame = static_cast<size_t>(v.max_patches) * v.patch_dim;
      for (int f = 0; f < v.num_frames; ++f) {
        double s = 0, s2 = 0;
        for (size_t i = 0; i < per_frame; ++i) {
          const double x = v.pixel_values[f * per_frame + i];
          s += x;
          s2 += x * x;
        }
        // One pixel off by one step (1/255) moves a sum by >= 0.0039; summation order only
        // by rounding.
        EXPECT_NEAR(s, sums[f], 1e-6 * std::max(1.0, std::fabs(sums[f]))) << "frame " << f;
        EXPECT_NEAR(s2, sq[f], 1e-6 * std::max(1.0, std::fabs(sq[f]))) << "frame " << f;
      }
      // Positions: (x, y) over the grid, row-major, then (-1, -1).
      const int pw = v.patches_w;
      for (int f = 0; f < v.num_frames; ++f)
        for (int n = 0; n < v.max_patches; ++n) {
          const int64_t* p = &v.position_ids[(size_t(f) * v.max_patches + n) * 2];
          const bool real = n < v.patches_h * v.patches_w;
          ASSERT_EQ(p[0], real ? n % pw : -1);
          ASSERT_EQ(p[1], real ? n / pw : -1);
        }
    }
  }
}

TEST(VideoProcessor, DefaultBudgetFirstPatchRowEqualsTheReference) {
  const std::string name = "h264_25fps_96x64.mp4";
  const NpyArray ref = load_npy(clip_path(name) + ".default_frame0_row0.pixel_values.npy");
  const ProcessedVideo v = process_video_file(clip_path(name), VideoProcessorConfig{});
  ASSERT_EQ(v.frame_indices.front(), 0);
  ASSERT_EQ(ref.shape, (Shape{v.patches_w, v.patch_dim}));
  const std::vector<float> row(v.pixel_values.begin(),
                               v.pixel_values.begin() + int64_t{v.patches_w} * v.patch_dim);
  EXPECT_EQ(max_abs_diff(row, ref.to_f32()), 0.0);
}

TEST(VideoProcessor, FusedRescaleNormalizeDividesBy255) {
  // Video: do_rescale and do_normalize (mean 0, std 1), fused by transformers into x / 255.0f;
  // the image processor's plain rescale is x * float(1/255). The two differ for some bytes, so
  // the video path must not reuse the image default.
  std::vector<RgbImage> frames(1);
  frames[0].width = 48;
  frames[0].height = 48;
  frames[0].rgb.resize(48 * 48 * 3);
  for (size_t i = 0; i < frames[0].rgb.size(); ++i) frames[0].rgb[i] = static_cast<uint8_t>(i);
  VideoProcessorConfig c;
  c.frame.max_soft_tokens = 70;
  c.frame.do_resize = false;  // 48 x 48 = 9 patches, one soft token
  const ProcessedVideo v = process_video_frames(frames, {0}, 25.0, c);
  ASSERT_EQ(v.num_soft_tokens_per_frame, 1);
  int differ = 0;
  for (int py = 0; py < 3; ++py)
    for (int px = 0; px < 3; ++px)
      for (int dy = 0; dy < 16; ++dy)
        for (int dx = 0; dx < 16; ++dx)
          for (int ch = 0; ch < 3; ++ch) {
            const uint8_t b = frames[0].rgb[((py * 16 + dy) * 48 + px * 16 + dx) * 3 + ch];
            const float got = v.pixel_values[((py * 3 + px) * 256 + dy * 16 + dx) * 3 + ch];
            ASSERT_EQ(got, static_cast<float>(b) / 255.0f);
            differ += got != static_cast<float>(b) * static_cast<float>(1.0 / 255.0);
          }
  EXPECT_GT(differ, 0);
}

TEST(VideoProcessor, PromptTextLaysOutTimestampedFrames) {
  VideoProcessorConfig c;
  const ProcessedVideo v = process_video_file(clip_path("h264_1fps_32x24.mp4"), c);
  const std::string text = v.prompt_text("<|image>", "<|video|>", "<image|>");
  std::string expected;
  const auto stamps = goldens()["h264_1fps_32x24.mp4"]["default"]["timestamps"];
  for (size_t f = 0; f < stamps.size(); ++f) {
    if (f) expected += ' ';
    expected += stamps[f].get<std::string>() + " <|image>";
    for (int k = 0; k < v.num_soft_tokens_per_frame; ++k) expected += "<|video|>";
    expected += "<image|>";
  }
  EXPECT_EQ(text, expected);
  EXPECT_EQ(v.total_soft_tokens(), 32 * 63);
  EXPECT_LE(v.total_soft_tokens() + 32 * 2, max_video_prompt_tokens(c));
}

TEST(VideoProcessor, ConfigReadsTheVideoProcessorAndRefusesWhatItLacks) {
  const VideoProcessorConfig d;
  EXPECT_EQ(d.num_frames, 32);
  EXPECT_EQ(d.frame.max_soft_tokens, 70);
  EXPECT_TRUE(d.frame.do_normalize);
  EXPECT_EQ(d.frame.max_patches(), 630);
  const auto j = nlohmann::json::parse(
      R"({"image_processor": {"max_soft_tokens": 280},
          "video_processor": {"max_soft_tokens": 140, "num_frames": 8, "fps": null,
                              "do_sample_frames": true, "size": null}})");
  const VideoProcessorConfig c = VideoProcessorConfig::from_json(j, "processor_config.json");
  EXPECT_EQ(c.frame.max_soft_tokens, 140);
  EXPECT_EQ(c.num_frames, 8);
  EXPECT_TRUE(c.frame.do_normalize);
  auto err = [](const char* text) {
    return error_of([&] { VideoProcessorConfig::from_json(nlohmann::json::parse(text), "cfg"); });
  };
  EXPECT_NE(err(R"({"fps": 2})").find("fps"), std::string::npos);
  EXPECT_NE(err(R"({"do_sample_frames": false})").find("do_sample_frames"), std::string::npos);
  EXPECT_NE(err(R"({"max_soft_tokens": 100})").find("max_soft_tokens"), std::string::npos);
  EXPECT_NE(err(R"({"num_frames": 0})").find("num_frames"), std::string::npos);
  EXPECT_NE(err(R"({"num_frames": "8"})").find("num_frames"), std::string::npos);
  // A model directory without video settings takes the defaults.
  const VideoProcessorConfig tiny = load_video_processor_config(testing::fixture("model"));
  EXPECT_EQ(tiny.frame.max_soft_tokens, 70);
  EXPECT_EQ(tiny.num_frames, 32);
}

}  // namespace
}  // namespace gemstage
