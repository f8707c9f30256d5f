// The public chat-template cases (tests/fixtures/chat-template, index.json says how they were
// made): each conversation rendered by the built-in renderer must equal the reference template's
// output byte for byte, or raise its error message.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "stage/bundle.h"
#include "tokenizer/chat_format.h"

using namespace gemstage;
using nlohmann::ordered_json;

namespace {

const std::string kDir = std::string(GEMSTAGE_FIXTURES) + "/chat-template";

ordered_json read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ordered_json::parse(ss.str());
}

std::vector<std::string> case_files() {
  std::vector<std::string> out;
  const ordered_json index = read(kDir + "/index.json");
  for (const auto& c : index["cases"]) out.push_back(c["file"]);
  return out;
}

class ChatTemplateCase : public testing::TestWithParam<std::string> {};

}  // namespace

TEST(ChatTemplateCases, AllTwentySevenListed) {
  EXPECT_EQ(case_files().size(), 27u);
}

TEST_P(ChatTemplateCase, BuiltInRendererMatchesGolden) {
  const ordered_json c = read(kDir + "/" + GetParam());
  ConversationOptions o;
  o.add_generation_prompt = c.value("add_generation_prompt", false);
  o.enable_thinking = c.value("enable_thinking", false);
  o.preserve_thinking = c.value("preserve_thinking", false);
  const ordered_json& expected = c["expected"];
  if (expected.is_object()) {
    try {
      render_conversation(c["messages"], c["tools"], o);
      FAIL() << "expected the error: " << expected["error"];
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), expected["error"].get<std::string>());
    }
    return;
  }
  EXPECT_EQ(render_conversation(c["messages"], c["tools"], o), expected.get<std::string>());
}

// The same cases through the Jinja interpreter running Google's own chat_template.jinja, read
// from tests/fixtures/chat-template/chat_template.jinja and checked against the size and sha256
// index.json records. The template is Google's (gated on the Hub, under the Gemma terms), so the
// repository cannot ship it: where it is missing or another revision, CheckpointTemplateIsPresent
// skips with the way to get it and scripts/test.sh prints a banner saying the 27 cases did not
// run; with GEMSTAGE_REQUIRE_CHECKPOINT_TEMPLATE=1 (a machine that has the file) it fails instead.
namespace {

const std::string kTemplate = kDir + "/chat_template.jinja";

// Why the template cannot be used ("" when it can).
std::string template_problem() {
  const ordered_json want = read(kDir + "/index.json")["template"];
  const std::string get =
      "; put Google's E-series chat_template.jinja (google/gemma-4-E2B-it on the Hugging Face "
      "Hub, header \"Published: 2026-07-09\", " +
      std::to_string(want["bytes"].get<uint64_t>()) + " bytes, sha256 " +
      want["sha256"].get<std::string>() + ") there (docs/gemma4-tools.md names a public copy)";
  if (!std::filesystem::exists(kTemplate)) return kTemplate + " is missing" + get;
  const uint64_t bytes = std::filesystem::file_size(kTemplate);
  const std::string sha = sha256_file(kTemplate);
  if (bytes != want["bytes"].get<uint64_t>() || sha != want["sha256"].get<std::string>())
    return kTemplate + " is another revision (" + std::to_string(bytes) + " bytes, sha256 " + sha +
           ")" + get;
  return "";
}

}  // namespace

TEST(ChatTemplateCases, CheckpointTemplateIsPresent) {
  const std::string problem = template_problem();
  const char* require = std::getenv("GEMSTAGE_REQUIRE_CHECKPOINT_TEMPLATE");
  if (!problem.empty() && !(require && std::string(require) == "1"))
    GTEST_SKIP() << "the 27 checkpoint-template cases cannot run: " << problem;
  EXPECT_EQ(problem, "") << "the 27 checkpoint-template cases cannot run: " << problem;
}

TEST_P(ChatTemplateCase, CheckpointTemplateThroughJinjaMatchesGolden) {
  if (const std::string problem = template_problem(); !problem.empty())
    GTEST_SKIP() << "not run: ChatTemplateCases.CheckpointTemplateIsPresent fails: " << problem;
  std::ifstream f(kTemplate, std::ios::binary);
  std::stringstream src;
  src << f.rdbuf();
  const ConversationRenderer r = ConversationRenderer::from_template_source(src.str(), kTemplate);
  const ordered_json c = read(kDir + "/" + GetParam());
  ConversationOptions o;
  o.add_generation_prompt = c.value("add_generation_prompt", false);
  o.enable_thinking = c.value("enable_thinking", false);
  o.preserve_thinking = c.value("preserve_thinking", false);
  const ordered_json& expected = c["expected"];
  if (expected.is_object()) {
    try {
      r.render(c["messages"], c["tools"], o);
      FAIL() << "expected the error: " << expected["error"];
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), expected["error"].get<std::string>());
    }
    return;
  }
  EXPECT_EQ(r.render(c["messages"], c["tools"], o), expected.get<std::string>());
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ChatTemplateCase, testing::ValuesIn(case_files()),
                         [](const testing::TestParamInfo<std::string>& param_info) {
                           std::string n = param_info.param.substr(0, param_info.param.find('.'));
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });
