#include "tokenizer/chat_format.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "test_util.h"

using namespace gemstage;
namespace fs = std::filesystem;

namespace {

const std::string kModelDir = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/model";

const Tokenizer& tiny() {
  static const Tokenizer tok = Tokenizer::from_model_dir(kModelDir);
  return tok;
}

ChatMessage msg(std::string role, std::string text) {
  return {std::move(role), {ChatPart::Text(std::move(text))}};
}

std::string render(const std::vector<ChatMessage>& m, ChatOptions o = {}) {
  return render_chat_text(m, o);
}

std::string repeat(std::string_view s, int n) {
  std::string out;
  for (int i = 0; i < n; ++i) out += s;
  return out;
}

}  // namespace

// Expected strings are the literal outputs in docs/gemma4-chat-format.md, section 3
// (E2B/E4B template, revision B where revisions differ).

TEST(ChatFormat, SingleUserMessage) {  // doc 3.1
  EXPECT_EQ(render({msg("user", "Hi")}), "<bos><|turn>user\nHi<turn|>\n<|turn>model\n");
}

TEST(ChatFormat, SystemAndUserAreTrimmed) {  // doc 3.2
  EXPECT_EQ(render({msg("system", "  You are terse.\n"), msg("user", "\tHi  ")}),
            "<bos><|turn>system\nYou are terse.<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");
  EXPECT_EQ(render({msg("system", ""), msg("user", "Hi")}),
            "<bos><|turn>system\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");
  // A developer first message is the system turn.
  EXPECT_EQ(render({msg("developer", "D"), msg("user", "Hi")}),
            "<bos><|turn>system\nD<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");
}

TEST(ChatFormat, MultiTurnStripsThinkingFromModelHistory) {  // doc 3.3
  EXPECT_EQ(render({msg("user", "A"), msg("assistant", "B"), msg("user", "C")}),
            "<bos><|turn>user\nA<turn|>\n<|turn>model\nB<turn|>\n<|turn>user\nC<turn|>\n"
            "<|turn>model\n");
  EXPECT_EQ(render({msg("user", "Capital of France?"),
                    msg("model", "<|channel>thought\nIt is Paris.<channel|>Paris."),
                    msg("user", "Thanks")}),
            "<bos><|turn>user\nCapital of France?<turn|>\n<|turn>model\nParis.<turn|>\n"
            "<|turn>user\nThanks<turn|>\n<|turn>model\n");
  // A later system message is an ordinary turn.
  EXPECT_EQ(render({msg("user", "A"), msg("system", "S")}, {.add_generation_prompt = false}),
            "<bos><|turn>user\nA<turn|>\n<|turn>system\nS<turn|>\n");
}

TEST(ChatFormat, ConsecutiveAssistantMessagesShareOneTurn) {  // doc 3.3, revision B
  EXPECT_EQ(render({msg("user", "A"), msg("assistant", "B1 "), msg("assistant", " B2")}),
            "<bos><|turn>user\nA<turn|>\n<|turn>model\nB1B2<turn|>\n<|turn>model\n");
}

TEST(ChatFormat, StripThinking) {
  EXPECT_EQ(strip_thinking("<|channel>thought\n...<channel|>Paris."), "Paris.");
  EXPECT_EQ(strip_thinking("a<|channel>x<channel|>b<|channel>y<channel|>c"), "abc");
  EXPECT_EQ(strip_thinking("  answer <|channel>unclosed"), "answer");
  EXPECT_EQ(strip_thinking("no markers  "), "no markers");
}

TEST(ChatFormat, ThinkingOnAndOff) {  // doc 3.6
  EXPECT_EQ(render({msg("user", "Hi")}, {.enable_thinking = true}),
            "<bos><|turn>system\n<|think|>\n<turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n");
  EXPECT_EQ(render({msg("system", "Be brief."), msg("user", "Hi")}, {.enable_thinking = true}),
            "<bos><|turn>system\n<|think|>\nBe brief.<turn|>\n<|turn>user\nHi<turn|>\n"
            "<|turn>model\n");
  // E-series, thinking off: the generation prompt is only <|turn>model\n, no empty channel.
  const std::string off = render({msg("user", "Hi")});
  EXPECT_EQ(off.find("<|channel>"), std::string::npos);
  EXPECT_TRUE(off.ends_with("<turn|>\n<|turn>model\n"));
}

TEST(ChatFormat, NoGenerationPrompt) {  // doc 3.7
  EXPECT_EQ(render({msg("user", "Q"), msg("assistant", "A")}, {.add_generation_prompt = false}),
            "<bos><|turn>user\nQ<turn|>\n<|turn>model\nA<turn|>\n");
  EXPECT_EQ(render({}, {.add_generation_prompt = false}), "<bos>");
}

TEST(ChatFormat, ImagesAreExpandedInline) {  // doc 3.5, revision B + processor
  const ChatMessage m{"user", {ChatPart::Image(3), ChatPart::Text(" What is shown? ")}};
  EXPECT_EQ(render({m}),
            "<bos><|turn>user\n<|image><|image|><|image|><|image|><image|>"
            "What is shown?<turn|>\n<|turn>model\n");
  const ChatMessage two{
      "user", {ChatPart::Text("A "), ChatPart::Image(2), ChatPart::Text(" B"), ChatPart::Image(1)}};
  EXPECT_EQ(render({two}),
            "<bos><|turn>user\nA<|image><|image|><|image|><image|>B<|image>"
            "<|image|><image|><turn|>\n<|turn>model\n");
}

TEST(ChatFormat, RejectsUnknownRolesAndMisplacedImages) {
  EXPECT_THROW(render({msg("tool", "x")}), Error);
  EXPECT_THROW(render({msg("user", "a"), msg("developer", "x")}), Error);
  try {
    render({msg("narrator", "x")});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown role \"narrator\""), std::string::npos);
  }
  EXPECT_THROW(render({{"assistant", {ChatPart::Image(4)}}}), Error);
  EXPECT_THROW(render({{"user", {ChatPart::Image(0)}}}), Error);
  EXPECT_THROW(render({msg("user", std::string("\xC3"))}), Error);
}

TEST(ChatFormat, IdsUseTheTokenizerAndConfigIds) {
  const Tokenizer& t = tiny();
  const ChatTokenIds ids = resolve_chat_token_ids(t, kModelDir + "/config.json");
  EXPECT_EQ(ids.bos, 2);
  EXPECT_EQ(ids.turn_open, 105);
  EXPECT_EQ(ids.turn_close, 106);
  EXPECT_EQ(ids.image_open, 2000);
  EXPECT_EQ(ids.image_soft, 2040);
  EXPECT_EQ(ids.image_close, 2042);
  EXPECT_EQ(ids.think, std::nullopt);  // the tiny vocabulary has no <|think|>

  const std::vector<ChatMessage> m = {msg("user", "Hi the cat")};
  const ChatPrompt p = render_chat(t, ids, m, {});
  // Same as tokenizing the rendered text, which is what HF does after the template.
  EXPECT_EQ(p.ids, t.encode(render_chat_text(m, {})));
  std::vector<int32_t> expected = {2, 105};
  for (const int32_t i : t.encode("user\nHi the cat")) expected.push_back(i);
  expected.push_back(106);
  for (const int32_t i : t.encode("\n")) expected.push_back(i);
  expected.push_back(105);
  for (const int32_t i : t.encode("model\n")) expected.push_back(i);
  EXPECT_EQ(p.ids, expected);
  EXPECT_TRUE(p.images.empty());
}

TEST(ChatFormat, ImageSpansPointAtTheSoftTokens) {
  const Tokenizer& t = tiny();
  const ChatTokenIds ids = resolve_chat_token_ids(t, kModelDir + "/config.json");
  const std::vector<ChatMessage> m = {
      {"user", {ChatPart::Image(5), ChatPart::Text("the"), ChatPart::Image(2)}}};
  const ChatPrompt p = render_chat(t, ids, m, {});
  EXPECT_EQ(p.ids, t.encode(render_chat_text(m, {})));
  ASSERT_EQ(p.images.size(), 2u);
  EXPECT_EQ(p.images[0].count, 5);
  EXPECT_EQ(p.ids[p.images[0].first_soft_token - 1], 2000);
  for (int k = 0; k < 5; ++k) EXPECT_EQ(p.ids[p.images[0].first_soft_token + k], 2040);
  EXPECT_EQ(p.ids[p.images[0].first_soft_token + 5], 2042);
  EXPECT_EQ(p.images[1].count, 2);
  EXPECT_EQ(p.ids[p.images[1].first_soft_token + 2], 2042);
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), 2040), 7);
}

TEST(ChatFormat, ThinkingNeedsTheThinkToken) {
  const Tokenizer& t = tiny();
  const ChatTokenIds ids = resolve_chat_token_ids(t);
  const std::vector<ChatMessage> m = {msg("user", "Hi")};
  try {
    render_chat(t, ids, m, {.enable_thinking = true});
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("<|think|>"), std::string::npos);
  }
}

TEST(ChatFormat, ConfigIdsMustAgreeWithTheTokenizer) {
  const fs::path dir = gemstage::testing::temp_dir("chat_cfg");
  std::ofstream(dir / "config.json") << R"({"boi_token_id": 7, "image_token_id": 2040})";
  EXPECT_THROW(resolve_chat_token_ids(tiny(), (dir / "config.json").string()), Error);
}

TEST(ChatFormat, StopIds) {
  const Tokenizer& t = tiny();
  // The fixture has only config.json (eos_token_id 1 in text_config); <turn|> always stops.
  EXPECT_EQ(load_stop_token_ids(t, kModelDir), (std::vector<int32_t>{1, 106}));
  EXPECT_EQ(load_stop_token_ids(t, ""), (std::vector<int32_t>{1, 106}));
  const fs::path dir = gemstage::testing::temp_dir("chat_stop");
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [1, 106, 50]})";
  EXPECT_EQ(load_stop_token_ids(t, dir.string()), (std::vector<int32_t>{1, 50, 106}));
  std::ofstream(dir / "generation_config.json") << R"({"eos_token_id": [1, 999999]})";
  EXPECT_THROW(load_stop_token_ids(t, dir.string()), Error);
}

TEST(ChatFormat, LongImageRunRendersAsOneTokenPerSoftToken) {
  const Tokenizer& t = tiny();
  const ChatTokenIds ids = resolve_chat_token_ids(t, kModelDir + "/config.json");
  const std::vector<ChatMessage> m = {{"user", {ChatPart::Image(280), ChatPart::Text("x")}}};
  const ChatPrompt p = render_chat(t, ids, m, {});
  EXPECT_EQ(std::count(p.ids.begin(), p.ids.end(), 2040), 280);
  EXPECT_EQ(render_chat_text(m, {}), "<bos><|turn>user\n<|image>" + repeat("<|image|>", 280) +
                                         "<image|>x<turn|>\n<|turn>model\n");
}
