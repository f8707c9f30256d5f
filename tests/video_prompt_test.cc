// Video in a prompt on the tiny fixture model: the ids are the text Gemma4Processor makes of one
// <|video|> (timestamps, image markers, video placeholders; docs/video.md) tokenized, on the
// chat path and the chat-template path alike; video rows are placeholders with the PAD identity;
// the frames' soft tokens are the vision tower's on the same frames through the image path; and
// generate, dump and chat take --video / /video.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/thread_pool.h"
#include "gemma4/multimodal.h"
#include "gemma4/placeholder_policy.h"
#include "io/npy.h"
#include "runtime/assistant.h"
#include "test_util.h"
#include "video/video_decode.h"
#include "video/video_processor.h"

using namespace gemstage;
using namespace gemstage::testing;
using nlohmann::ordered_json;

namespace {

// 96x64: at the default budget its frames are 480x288, 30 patches wide, inside the tiny tower's
// 32 position slots.
const std::string kClip = "h264_25fps_96x64.mp4";

std::string clip_path(const std::string& name) {
  return std::string(GEMSTAGE_FIXTURES) + "/video/" + name;
}

nlohmann::json clip_golden(const std::string& name) {
  std::ifstream in(clip_path("goldens.json"));
  return nlohmann::json::parse(in)[name];
}

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

int run(const std::string& args, const std::string& out, const std::string& err,
        const std::string& in = "/dev/null") {
  const std::string cmd =
      std::string(GEMSTAGE_CLI) + " " + args + " > " + out + " 2> " + err + " < " + in;
  return std::system(cmd.c_str());
}

// What Gemma4Processor.replace_video_token writes for the clip at the default settings, from the
// reference's timestamps and per-frame soft-token count.
std::string processor_text(const nlohmann::json& g) {
  std::string text;
  const auto stamps = g["timestamps"].get<std::vector<std::string>>();
  for (size_t f = 0; f < stamps.size(); ++f) {
    if (f) text += ' ';
    text += stamps[f] + " <|image>";
    for (int k = 0; k < g["soft_tokens_per_frame"].get<int>(); ++k) text += "<|video|>";
    text += "<image|>";
  }
  return text;
}

struct TinyVideo : ::testing::Test {
  static void SetUpTestSuite() { assistant = Assistant::open(fixture("model")).release(); }
  static void TearDownTestSuite() { delete assistant; }
  static ChatInputPart video_part() {
    ChatInputPart p;
    p.video_source = VideoSource{clip_path(kClip), nullptr, kClip, 0, 0};
    return p;
  }
  static Assistant* assistant;
  ThreadPool pool{2};
};
Assistant* TinyVideo::assistant = nullptr;

TEST_F(TinyVideo, ChatIdsAreTheProcessorsTextTokenized) {
  const nlohmann::json g = clip_golden(kClip)["default"];
  const std::vector<ChatInput> chat = {{"user", {video_part(), {"Describe the clip.", {}}}}};
  const PreparedPrompt p = assistant->prepare_chat(pool, chat, {true, false});
  const std::string expected =
      "<bos><|turn>user\n" + processor_text(g) + "Describe the clip.<turn|>\n<|turn>model\n";
  EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true));
  EXPECT_EQ(p.videos, 1);
  EXPECT_EQ(p.images, 0);
  const int k = g["soft_tokens_per_frame"].get<int>();
  const int video_id = assistant->model().config().video_token_id;
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), video_id), 32 * k);
  ASSERT_EQ(p.soft_tokens.dim(0), 32 * k);

  // The chat-template path (the server's tool path) writes one <|video|> and expands it the same.
  const ordered_json messages = ordered_json::array(
      {{{"role", "user"},
        {"content", ordered_json::array({{{"type", "video"}},
                                         {{"type", "text"}, {"text", "Describe the clip."}}})}}});
  const ChatInputPart media[] = {video_part()};
  const PreparedPrompt q = assistant->prepare_conversation(messages, nullptr, {}, media, &pool);
  EXPECT_EQ(q.ids, p.ids);
  EXPECT_EQ(q.soft_tokens.data, p.soft_tokens.data);
  EXPECT_EQ(q.videos, 1);
}

TEST_F(TinyVideo, TextBeforeTheVideoJoinsTheFirstTimestamp) {
  // The processor replaces the placeholder inside the rendered text, so text right before a video
  // tokenizes together with "00:00 ".
  const nlohmann::json g = clip_golden(kClip)["default"];
  const std::vector<ChatInput> chat = {{"user", {{"Watch:", {}}, video_part()}}};
  const PreparedPrompt p = assistant->prepare_chat(pool, chat, {true, false});
  const std::string expected =
      "<bos><|turn>user\nWatch:" + processor_text(g) + "<turn|>\n<|turn>model\n";
  EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true));
}

TEST_F(TinyVideo, VideoRowsArePlaceholdersWithThePadIdentity) {
  const std::vector<ChatInput> chat = {{"user", {video_part(), {"What happens?", {}}}}};
  const PreparedPrompt p = assistant->prepare_chat(pool, chat, {true, false});
  const ModelConfig& c = assistant->model().config();
  const TokenIdentity t =
      resolve_token_identity(p.ids, c.placeholder_token_ids(), c.text.pad_token_id,
                             c.text.vocab_size, c.text.vocab_size_per_layer_input);
  int video_rows = 0;
  for (size_t i = 0; i < p.ids.size(); ++i) {
    if (p.ids[i] != c.video_token_id) continue;
    ++video_rows;
    EXPECT_EQ(t.ple_ids[i], c.text.pad_token_id) << i;
    EXPECT_EQ(t.embed_ids[i], c.text.pad_token_id) << i;
    EXPECT_EQ(t.is_placeholder[i], 1) << i;
  }
  EXPECT_EQ(video_rows, p.soft_tokens.dim(0));
  EXPECT_EQ(count_placeholders(c, p.ids), video_rows);
  // Each frame is its own vision block (a run of <|video|> rows).
  const std::vector<int32_t> groups = vision_groups(c, p.ids);
  EXPECT_EQ(*std::max_element(groups.begin(), groups.end()), 31);
}

TEST_F(TinyVideo, FrameSoftTokensAreTheImagePathsOnTheSameFrames) {
  const std::vector<ChatInput> chat = {{"user", {video_part(), {"Go.", {}}}}};
  const PreparedPrompt p = assistant->prepare_chat(pool, chat, {true, false});
  const nlohmann::json g = clip_golden(kClip)["default"];
  const auto indices = g["indices"].get<std::vector<int64_t>>();
  // The same frames through the image processor at the video's budget: it rescales with
  // x * (1/255) where the video processor divides by 255, a last-bit difference in a few pixels.
  ImageProcessorConfig image_cfg = load_processor_config(fixture("model"));
  image_cfg.max_soft_tokens = 70;
  std::vector<VisionInput> frames;
  auto d = VideoDecoder::open_file(clip_path(kClip));
  d->decode_frames(indices, [&](size_t, const RgbImage& rgb) {
    const ProcessedImage pi = preprocess_image(rgb, image_cfg);
    frames.push_back({pi.max_patches, pi.pixel_values, pi.position_ids});
  });
  const FloatTensor image_path = assistant->model().vision()->encode_all(pool, frames, nullptr);
  ASSERT_EQ(image_path.shape, p.soft_tokens.shape);
  EXPECT_LE(max_abs_diff(image_path.data, p.soft_tokens.data), 1e-4);
  EXPECT_GT(max_abs_diff(image_path.data, std::vector<float>(image_path.data.size(), 0.0f)), 0.1);
}

TEST_F(TinyVideo, AVideoThatCannotFitTheContextIsRefusedBeforeDecoding) {
  const auto small = Assistant::open(fixture("model"), 1024);
  VideoSource src{"/nonexistent/clip.mp4", nullptr, "clip.mp4", 0, 0};
  const std::string e = error_of([&] { small->load_video(src); });
  EXPECT_NE(e.find("the context holds 1024"), std::string::npos) << e;
  EXPECT_NE(e.find("--video-frames"), std::string::npos) << e;
  src.num_frames = 4;  // 4 x 80 fits; now the missing file is the error
  EXPECT_NE(error_of([&] { small->load_video(src); }).find("/nonexistent/clip.mp4"),
            std::string::npos);
  src.max_soft_tokens = 100;
  EXPECT_NE(error_of([&] { small->load_video(src); }).find("max_soft_tokens = 100"),
            std::string::npos);
}

TEST(VideoCli, GenerateIsDeterministicAndDumpTapsTheVideo) {
  const std::string dir = temp_dir("video_cli");
  const std::string gen = "generate -m " + fixture("model") + " --json -t 2 --temp 0 -n 6 " +
                          "--video " + clip_path(kClip) + " -p \"What happens?\"";
  ASSERT_EQ(run(gen, dir + "/o1", dir + "/e1"), 0) << slurp(dir + "/e1");
  ASSERT_EQ(run(gen, dir + "/o2", dir + "/e2"), 0) << slurp(dir + "/e2");
  const auto a = nlohmann::json::parse(slurp(dir + "/o1"));
  const auto b = nlohmann::json::parse(slurp(dir + "/o2"));
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_FALSE(a["tokens"].empty());
  EXPECT_NE(slurp(dir + "/e1").find("32 of 50 frames"), std::string::npos) << slurp(dir + "/e1");

  // dump on generate's prompt ids: the video taps, and the greedy decode generate made.
  const std::vector<int64_t> ids = a["prompt_ids"].get<std::vector<int64_t>>();
  save_npy_i64(dir + "/ids.npy", {static_cast<int64_t>(ids.size())}, ids);
  ASSERT_EQ(
      run("dump -m " + fixture("model") + " --ids " + dir + "/ids.npy --video " + clip_path(kClip) +
              " --decode 6 --taps pixel_values_videos,video_position_ids,video_soft_tokens,"
              "decode_ids --out " +
              dir + "/d",
          dir + "/o3", dir + "/e3"),
      0)
      << slurp(dir + "/e3");
  const int k = clip_golden(kClip)["default"]["soft_tokens_per_frame"].get<int>();
  const int64_t hidden = load_npy(dir + "/d/video_soft_tokens.npy").shape.back();
  EXPECT_EQ(load_npy(dir + "/d/pixel_values_videos.npy").shape, (Shape{32, 630, 768}));
  EXPECT_EQ(load_npy(dir + "/d/video_position_ids.npy").shape, (Shape{32, 630, 2}));
  EXPECT_EQ(load_npy(dir + "/d/video_soft_tokens.npy").shape, (Shape{32, k, hidden}));
  const auto dumped = load_npy(dir + "/d/decode_ids.npy").to_i64();
  const auto tokens = a["tokens"].get<std::vector<int64_t>>();
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(tokens[i], dumped[i]) << i;

  // Fewer frames at a larger budget change the prompt accordingly.
  ASSERT_EQ(run("generate -m " + fixture("model") + " --json -t 2 --temp 0 -n 1 --video " +
                    clip_path(kClip) + " --video-frames 4 --video-budget 70 -p \"Hi\"",
                dir + "/o4", dir + "/e4"),
            0)
      << slurp(dir + "/e4");
  const auto few = nlohmann::json::parse(slurp(dir + "/o4"))["prompt_ids"];
  EXPECT_EQ(std::count(few.begin(), few.end(), 2044), 4 * k);
}

// A bundle's embeddings stage takes the frames as images (pixel_values): an f32 export gives the
// checkpoint's greedy reply on a video, and `check` probes a video span through its stages (the
// PAD identity and the splice mask at every video placeholder row).
TEST(VideoCli, ABundleRunsAVideoAsItsCheckpointDoes) {
  const std::string dir = temp_dir("video_bundle");
  ASSERT_EQ(run("export -m " + fixture("model") + " --out " + dir + "/b --weights f32", dir + "/o0",
                dir + "/e0"),
            0)
      << slurp(dir + "/e0");
  std::vector<nlohmann::json> replies;
  for (const std::string& m : {fixture("model"), dir + "/b"}) {
    ASSERT_EQ(run("generate -m " + m + " --json -t 2 --temp 0 -n 6 --video " + clip_path(kClip) +
                      " --video-frames 4 -p \"What happens?\"",
                  dir + "/o", dir + "/e"),
              0)
        << slurp(dir + "/e");
    replies.push_back(nlohmann::json::parse(slurp(dir + "/o")));
  }
  EXPECT_EQ(replies[0]["prompt_ids"], replies[1]["prompt_ids"]);
  EXPECT_EQ(replies[0]["tokens"], replies[1]["tokens"]);
  EXPECT_FALSE(replies[0]["tokens"].empty());
  ASSERT_EQ(run("check " + dir + "/b --reference " + fixture("model"), dir + "/o1", dir + "/e1"), 0)
      << slurp(dir + "/o1") << slurp(dir + "/e1");
  EXPECT_NE(slurp(dir + "/o1").find("a synthetic two-frame video through the vision tower"),
            std::string::npos)
      << slurp(dir + "/o1");
}

TEST(VideoCli, ChatAttachesAVideoAndBadVideosAreClearErrors) {
  const std::string dir = temp_dir("video_chat");
  {
    std::ofstream in(dir + "/in");
    in << "/video " << clip_path("gif_10fps_48x32.gif") << "\nWhat is this?\n";
  }
  ASSERT_EQ(run("chat -m " + fixture("model") + " -t 2 --temp 0 -n 3", dir + "/o", dir + "/e",
                dir + "/in"),
            0)
      << slurp(dir + "/e");
  EXPECT_NE(slurp(dir + "/e").find("10 of 10 frames"), std::string::npos) << slurp(dir + "/e");
  EXPECT_NE(slurp(dir + "/e").find("prompt"), std::string::npos) << slurp(dir + "/e");

  const std::string bad = fixture("model/config.json");
  EXPECT_NE(
      run("generate -m " + fixture("model") + " -p hi --video " + bad, dir + "/o2", dir + "/e2"),
      0);
  EXPECT_NE(slurp(dir + "/e2").find(bad), std::string::npos) << slurp(dir + "/e2");
  EXPECT_NE(run("generate -m " + fixture("model") + " -p hi --video-budget 100 --video " +
                    clip_path(kClip),
                dir + "/o3", dir + "/e3"),
            0);
  EXPECT_NE(slurp(dir + "/e3").find("--video-budget"), std::string::npos) << slurp(dir + "/e3");
  EXPECT_NE(run("generate -m " + fixture("model") + " -c 512 -p hi --video " + clip_path(kClip),
                dir + "/o4", dir + "/e4"),
            0);
  EXPECT_NE(slurp(dir + "/e4").find("context holds 512"), std::string::npos) << slurp(dir + "/e4");
}

}  // namespace
