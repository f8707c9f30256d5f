// generate / chat end to end on the tiny fixture model and its matching small tokenizer.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/npy.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;

namespace {

int run(const std::string& args, const std::string& out, const std::string& err) {
  const std::string cmd =
      std::string(GEMSTAGE_CLI) + " " + args + " > " + out + " 2> " + err + " < /dev/null";
  return std::system(cmd.c_str());
}
std::string slurp(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
nlohmann::json generate_json(const std::string& dir, const std::string& args) {
  EXPECT_EQ(
      run("generate -m " + fixture("model") + " --json -t 2 " + args, dir + "/out", dir + "/err"),
      0)
      << slurp(dir + "/err");
  return nlohmann::json::parse(slurp(dir + "/out"));
}

TEST(Generate, GreedyEqualsDumpGreedyDecode) {
  const std::string dir = temp_dir("gen_greedy");
  const auto j = generate_json(dir, "-p \"Hello there, how are you?\" --temp 0 -n 12");
  const std::vector<int64_t> prompt = j["prompt_ids"].get<std::vector<int64_t>>();
  const std::vector<int64_t> tokens = j["tokens"].get<std::vector<int64_t>>();
  ASSERT_FALSE(tokens.empty());
  EXPECT_EQ(j["prompt_tokens"], prompt.size());
  EXPECT_EQ(j["completion_tokens"], tokens.size());
  // The chat format: <bos><|turn>user\n ... <turn|>\n<|turn>model\n
  EXPECT_EQ(prompt.front(), 2);
  EXPECT_EQ(prompt[1], 105);
  save_npy_i64(dir + "/p.npy", {static_cast<int64_t>(prompt.size())}, prompt);
  ASSERT_EQ(run("dump -m " + fixture("model") + " --ids " + dir +
                    "/p.npy --decode 12 --taps decode_ids --out " + dir + "/d",
                dir + "/o2", dir + "/e2"),
            0)
      << slurp(dir + "/e2");
  const std::vector<int64_t> want = load_npy(dir + "/d/decode_ids.npy").to_i64();
  for (size_t i = 0; i < tokens.size(); ++i) EXPECT_EQ(tokens[i], want[i]) << i;
  if (j["finish_reason"] == "stop") {
    EXPECT_TRUE(want[tokens.size()] == 1 || want[tokens.size()] == 106);
  }
}

TEST(Generate, SeedMakesSamplingReproducible) {
  const std::string dir = temp_dir("gen_seed");
  const auto a = generate_json(dir, "-p \"Tell me a story\" --seed 11 --temp 1.2 -n 16");
  const auto b = generate_json(dir, "-p \"Tell me a story\" --seed 11 --temp 1.2 -n 16");
  const auto c = generate_json(dir, "-p \"Tell me a story\" --seed 12 --temp 1.2 -n 16");
  EXPECT_EQ(a["tokens"], b["tokens"]);
  EXPECT_NE(a["tokens"], c["tokens"]);
}

TEST(Generate, StopStringCutsTheText) {
  const std::string dir = temp_dir("gen_stop");
  const auto full = generate_json(dir, "-p \"Count with me\" --temp 0 -n 24");
  const std::string text = full["text"];
  ASSERT_GE(text.size(), 6u) << text;
  // An ASCII letter, digit, tab or space inside the reply (random weights: the rest may be any
  // bytes).
  auto usable = [](unsigned char ch) { return std::isalnum(ch) || ch == '\t' || ch == ' '; };
  size_t at = 1;
  while (at < text.size() && !usable(static_cast<unsigned char>(text[at]))) ++at;
  if (at == text.size()) at = 0;
  ASSERT_TRUE(usable(static_cast<unsigned char>(text[at]))) << "no usable ASCII byte in " << text;
  const std::string stop = text.substr(at, 1);
  const auto cut = generate_json(dir, "-p \"Count with me\" --temp 0 -n 24 --stop '" + stop + "'");
  EXPECT_EQ(cut["text"], text.substr(0, text.find(stop)));
  EXPECT_EQ(cut["finish_reason"], "stop");
}

TEST(Generate, ContextLimitIsReportedAndOverlongPromptsRefused) {
  const std::string dir = temp_dir("gen_ctx");
  const auto j =
      generate_json(dir, "-p \"Hello there, how are you?\" --temp 0 -n 200 -c 40 --ignore-eos");
  EXPECT_EQ(j["finish_reason"], "context");
  EXPECT_NE(slurp(dir + "/err").find("context limit was reached"), std::string::npos)
      << slurp(dir + "/err");
  EXPECT_NE(run("generate -m " + fixture("model") + " -p \"" + std::string(300, 'x') + "\" -c 32",
                dir + "/o", dir + "/e"),
            0);
  EXPECT_NE(slurp(dir + "/e").find("shorten the prompt or raise --ctx-size"), std::string::npos)
      << slurp(dir + "/e");
}

TEST(Generate, BundleAndImagePrompts) {
  const std::string dir = temp_dir("gen_bundle");
  ASSERT_EQ(run("export -m " + fixture("model") + " --out " + dir +
                    "/b --stages 0:2,2:6 --weights f32 --max-context 512",
                dir + "/o", dir + "/e"),
            0)
      << slurp(dir + "/e");
  const auto a = generate_json(dir, "-p \"Hello\" --temp 0 -n 8");
  ASSERT_EQ(
      run("generate -m " + dir + "/b --json -p \"Hello\" --temp 0 -n 8", dir + "/ob", dir + "/eb"),
      0)
      << slurp(dir + "/eb");
  EXPECT_EQ(nlohmann::json::parse(slurp(dir + "/ob"))["tokens"], a["tokens"]);
  const auto img = generate_json(
      dir, "-p \"What is this?\" --image " + fixture("multimodal/image.png") + " --temp 0 -n 4");
  int placeholders = 0;
  for (int64_t id : img["prompt_ids"].get<std::vector<int64_t>>()) placeholders += id == 2040;
  EXPECT_EQ(placeholders,
            56);  // the fixture image yields 56 soft tokens at the tiny model's budget
}

// A drafter on a prompt with an image: the prompt is prefilled with its soft tokens in chunks
// that keep the image whole, decoding drafts as usual, and the greedy ids are plain decoding's.
TEST(Generate, DrafterOnAnImagePromptKeepsTheGreedyOutput) {
  const std::string dir = temp_dir("gen_draft_image");
  const std::string args = "-p \"What is this?\" --image " + fixture("multimodal/image.png") +
                           " --temp 0 -n 24 --chunk 16";
  const auto plain = generate_json(dir, args);
  const auto spec = generate_json(dir, args + " -md " + std::string(GEMSTAGE_FIXTURES) +
                                           "/gemma4-tiny-assistant/assistant_e --draft-max 3");
  EXPECT_EQ(spec["prompt_ids"], plain["prompt_ids"]);
  EXPECT_EQ(spec["tokens"], plain["tokens"]);
  ASSERT_TRUE(spec.contains("draft_rounds")) << spec;
  EXPECT_GT(spec["draft_rounds"].get<int64_t>(), 0) << spec;
}

TEST(Chat, MultiTurnReusesTheCache) {
  const std::string dir = temp_dir("chat");
  {
    std::ofstream in(dir + "/in");
    in << "Hello\nAnd again\n/exit\n";
  }
  const std::string cmd = std::string(GEMSTAGE_CLI) + " chat -m " + fixture("model") +
                          " --temp 0 -n 6 --ignore-eos < " + dir + "/in > " + dir + "/out 2> " +
                          dir + "/err";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/err");
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("reused from the cache"), std::string::npos) << err;
  size_t turns = 0;
  for (size_t p = err.find("generated 6 tokens"); p != std::string::npos;
       p = err.find("generated 6 tokens", p + 1))
    ++turns;
  EXPECT_EQ(turns, 2u) << err;
}

}  // namespace
