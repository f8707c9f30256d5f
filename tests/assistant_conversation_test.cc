// Assistant::prepare_conversation with images and audio: the tool path's prompt ids are the chat
// template's text (the public chat-template fixtures) with each placeholder expanded as the
// processor expands it (docs/gemma4-chat-format.md 3.5), and its soft tokens are the
// plain chat path's.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "audio/audio_decode.h"
#include "core/thread_pool.h"
#include "image/image_decode.h"
#include "runtime/assistant.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;
using nlohmann::ordered_json;

namespace {

ordered_json template_case(const std::string& file) {
  std::ifstream in(std::string(GEMSTAGE_FIXTURES) + "/chat-template/" + file);
  return ordered_json::parse(in);
}

// The processor's replacement of one placeholder: open marker, n placeholders, close marker.
std::string expand(std::string text, const std::string& placeholder, const std::string& open,
                   const std::string& close, int n) {
  std::string run = open;
  for (int i = 0; i < n; ++i) run += placeholder;
  run += close;
  const size_t at = text.find(placeholder);
  EXPECT_NE(at, std::string::npos) << text;
  if (at != std::string::npos) text.replace(at, placeholder.size(), run);
  return text;
}

// The fixture image yields 56 soft tokens at the tiny model's budget (gemma4-tiny/multimodal/
// manifest.json inputs.num_soft_tokens, from the independent reference).
constexpr int kFixtureImageSoftTokens = 56;
// gemma4-tiny-audio/audio/manifest.json n_soft_tokens for audio.wav.
constexpr int kFixtureAudioSoftTokens = 40;

struct TinyAssistant : ::testing::Test {
  static void SetUpTestSuite() {
    assistant = Assistant::open(fixture("model")).release();
    image = new RgbImage(decode_image_file(fixture("multimodal/image.png")));
  }
  static void TearDownTestSuite() {
    delete assistant;
    delete image;
  }
  static Assistant* assistant;
  static RgbImage* image;
  ThreadPool pool{2};
};
Assistant* TinyAssistant::assistant = nullptr;
RgbImage* TinyAssistant::image = nullptr;

TEST_F(TinyAssistant, ImageThenTextIsTheTemplateCaseExpanded) {
  const ordered_json c = template_case("10-image_then_text.json");
  const ChatInputPart media[] = {{"", *image}};
  const PreparedPrompt p =
      assistant->prepare_conversation(c["messages"], c["tools"], {}, media, &pool);
  const std::string expected = expand(c["expected"].get<std::string>(), "<|image|>", "<|image>",
                                      "<image|>", kFixtureImageSoftTokens);
  EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true));
  EXPECT_EQ(p.images, 1);
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), 2040), kFixtureImageSoftTokens);
  ASSERT_EQ(p.soft_tokens.dim(0), kFixtureImageSoftTokens);

  // The plain chat path renders the same conversation to the same ids and soft tokens.
  const std::vector<ChatInput> chat = {{"user", {{"", *image}, {" What is shown? ", {}}}}};
  const PreparedPrompt plain = assistant->prepare_chat(pool, chat, {true, false});
  EXPECT_EQ(p.ids, plain.ids);
  EXPECT_EQ(p.soft_tokens.shape, plain.soft_tokens.shape);
  EXPECT_EQ(p.soft_tokens.data, plain.soft_tokens.data);
}

TEST_F(TinyAssistant, ImageWithToolsIsTheToolCaseWithTheImageInTheUserTurn) {
  // The tool cases' conversations with an image before the user's text: the template writes the
  // image's bare placeholder where the part is (chat-format doc 3.5, revision B). Case 15 has a
  // system turn and thinking on.
  for (const char* file : {"12-tools_single.json", "15-tools_system_thinking_two_tools.json"}) {
    ordered_json c = template_case(file);
    ordered_json& user = c["messages"][c["messages"].size() - 1];
    ASSERT_EQ(user["role"], "user");
    const std::string question = user["content"].get<std::string>();
    user["content"] =
        ordered_json::array({{{"type", "image"}}, {{"type", "text"}, {"text", question}}});
    ConversationOptions options;
    options.enable_thinking = c.value("enable_thinking", false);
    const ChatInputPart media[] = {{"", *image}};
    const PreparedPrompt p =
        assistant->prepare_conversation(c["messages"], c["tools"], options, media, &pool);
    std::string text = c["expected"].get<std::string>();
    const size_t at = text.find("<|turn>user\n" + question);
    ASSERT_NE(at, std::string::npos) << file;
    text.insert(at + std::string("<|turn>user\n").size(), "<|image|>");
    const std::string expected =
        expand(text, "<|image|>", "<|image>", "<image|>", kFixtureImageSoftTokens);
    EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true)) << file;
    EXPECT_EQ(p.soft_tokens.dim(0), kFixtureImageSoftTokens);
  }
}

TEST_F(TinyAssistant, AnImageInAToolResultFollowsTheResponse) {
  // 16-tool_call_then_response with the result as a text part and an image part: the template
  // writes the text as the value and the image's placeholder after <tool_response|>
  // (docs/gemma4-tools.md, "Tool results").
  ordered_json c = template_case("16-tool_call_then_response.json");
  ordered_json& result = c["messages"][2];
  ASSERT_EQ(result["role"], "tool");
  result["content"] = ordered_json::array(
      {{{"type", "text"}, {"text", result["content"].get<std::string>()}}, {{"type", "image"}}});
  const ChatInputPart media[] = {{"", *image}};
  const PreparedPrompt p =
      assistant->prepare_conversation(c["messages"], c["tools"], {}, media, &pool);
  const std::string text = c["expected"].get<std::string>();
  ASSERT_EQ(text.substr(text.size() - 16), "<tool_response|>");
  const std::string expected =
      expand(text + "<|image|>", "<|image|>", "<|image>", "<image|>", kFixtureImageSoftTokens);
  EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true));
  EXPECT_EQ(p.soft_tokens.dim(0), kFixtureImageSoftTokens);
}

TEST_F(TinyAssistant, PlaceholdersMustMatchTheMedia) {
  const ordered_json c = template_case("10-image_then_text.json");
  // An image part without its decoded image, and a decoded image without a part, are refused.
  EXPECT_THROW(assistant->prepare_conversation(c["messages"], c["tools"], {}), Error);
  const ChatInputPart two[] = {{"", *image}, {"", *image}};
  EXPECT_THROW(assistant->prepare_conversation(c["messages"], c["tools"], {}, two, &pool), Error);
  // A placeholder typed into a message's text counts (HF's processor would see it too).
  ordered_json typed = ordered_json::array(
      {{{"role", "user"},
        {"content", ordered_json::array(
                        {{{"type", "image"}}, {{"type", "text"}, {"text", "and <|image|>"}}})}}});
  const ChatInputPart one[] = {{"", *image}};
  EXPECT_THROW(assistant->prepare_conversation(typed, nullptr, {}, one, &pool), Error);
}

TEST(AssistantConversation, AudioExpandsAsTheProcessorDoes) {
  const std::string dir = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-audio/";
  const auto assistant = Assistant::open(dir + "model");
  const AudioClip clip = decode_audio_file(dir + "audio/audio.wav");
  ThreadPool pool(2);
  // 11-audio_and_image_url's conversation without its image (this model has no vision tower).
  ordered_json c = template_case("11-audio_and_image_url.json");
  c["messages"][0]["content"].erase(3);
  const ChatInputPart media[] = {{"", std::nullopt, clip}};
  const PreparedPrompt p =
      assistant->prepare_conversation(c["messages"], c["tools"], {}, media, &pool);
  std::string text = c["expected"].get<std::string>();
  text.erase(text.find("<|image|>"), 9);
  const std::string expected =
      expand(text, "<|audio|>", "<|audio>", "<audio|>", kFixtureAudioSoftTokens);
  EXPECT_EQ(p.ids, assistant->tokenizer().encode(expected, false, true));
  EXPECT_EQ(p.audios, 1);
  const std::vector<ChatInput> chat = {
      {"user", {{"Transcribe this:", {}}, {"", std::nullopt, clip}, {"and describe", {}}}}};
  const PreparedPrompt plain = assistant->prepare_chat(pool, chat, {true, false});
  EXPECT_EQ(p.ids, plain.ids);
  EXPECT_EQ(p.soft_tokens.data, plain.soft_tokens.data);
}

}  // namespace

namespace {

TEST(AssistantConversation, UnifiedModelImageAndAudioAsOnThePlainPath) {
  // gemma4_unified embeds patches and frames without towers; the tool path splices them at the
  // same rows. The fixture's image is 70 soft tokens and its clip 13 (manifest.json placeholders).
  const std::string dir = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-unified/";
  const auto assistant = Assistant::open(dir + "model");
  const RgbImage picture = decode_image_file(dir + "image/image.png");
  const AudioClip clip = decode_audio_file(dir + "audio/audio.wav");
  ThreadPool pool(2);
  const ordered_json messages = ordered_json::parse(R"([{"role": "user", "content": [
      {"type": "image"}, {"type": "text", "text": "and this:"}, {"type": "audio"}]}])");
  const ChatInputPart media[] = {{"", picture}, {"", std::nullopt, clip}};
  const PreparedPrompt p = assistant->prepare_conversation(messages, nullptr, {}, media, &pool);
  const std::vector<ChatInput> chat = {
      {"user", {{"", picture}, {"and this:", {}}, {"", std::nullopt, clip}}}};
  const PreparedPrompt plain = assistant->prepare_chat(pool, chat, {true, false});
  EXPECT_EQ(p.ids, plain.ids);
  EXPECT_EQ(p.images, 1);
  EXPECT_EQ(p.audios, 1);
  const Tokenizer& tok = assistant->tokenizer();
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), *tok.token_to_id("<|image|>")), 70);
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), *tok.token_to_id("<|audio|>")), 13);
  EXPECT_EQ(p.soft_tokens.shape, plain.soft_tokens.shape);
  EXPECT_EQ(p.soft_tokens.data, plain.soft_tokens.data);
}

}  // namespace
