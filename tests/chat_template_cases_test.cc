// The public chat-template cases (tests/fixtures/chat-template, copied from the shared golden
// set): each conversation rendered by the built-in renderer must equal the reference template's
// output byte for byte, or raise its error message.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
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

// The same cases through the Jinja interpreter running Google's own chat_template.jinja. The
// template is Google's file and is not copied into this repository: point
// GEMSTAGE_GEMMA4_CHAT_TEMPLATE at a copy (the E-series file of google/gemma-4-E2B-it, header
// "Published: 2026-07-09"; docs/gemma4-tools.md names a public copy) to run it.
TEST_P(ChatTemplateCase, CheckpointTemplateThroughJinjaMatchesGolden) {
  const char* path = std::getenv("GEMSTAGE_GEMMA4_CHAT_TEMPLATE");
  if (!path || !*path) GTEST_SKIP() << "GEMSTAGE_GEMMA4_CHAT_TEMPLATE is not set";
  std::ifstream f(path);
  std::stringstream src;
  src << f.rdbuf();
  const ConversationRenderer r = ConversationRenderer::from_template_source(src.str(), path);
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
