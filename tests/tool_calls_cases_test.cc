// The public tool-call parsing cases (tests/fixtures/tool-calls, copied from the shared golden
// set): raw model output -> content, reasoning_content, tool_calls, finish_reason; and the
// streamed parser, fed the same output in pieces, must add up to the same message.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include "tokenizer/chat_output.h"

using namespace gemstage;
using nlohmann::ordered_json;

namespace {

const std::string kDir = std::string(GEMSTAGE_FIXTURES) + "/tool-calls";

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

ordered_json opt(const std::optional<std::string>& s) {
  return s ? ordered_json(*s) : ordered_json(nullptr);
}

// JSON objects compare as unordered maps (the expected files and the model may order keys
// differently).
nlohmann::json calls_json(const std::vector<ParsedToolCall>& calls) {
  ordered_json out = ordered_json::array();
  for (const auto& c : calls) out.push_back({{"name", c.name}, {"arguments", c.arguments}});
  return nlohmann::json::parse(out.dump());
}

nlohmann::json unordered(const ordered_json& j) {
  return nlohmann::json::parse(j.dump());
}

class ToolCallCase : public testing::TestWithParam<std::string> {};

}  // namespace

TEST(ToolCallCases, AllTwentyOneListed) {
  EXPECT_EQ(case_files().size(), 21u);
}

TEST_P(ToolCallCase, ParsesAsGolden) {
  const ordered_json c = read(kDir + "/" + GetParam());
  const std::string text =
      c.value("generation_prefix", std::string()) + c["output"].get<std::string>();
  const ordered_json& want = c["expected"];
  const ParsedOutput p = parse_model_output(text);
  EXPECT_EQ(opt(p.content), want["content"]);
  EXPECT_EQ(opt(p.reasoning), want["reasoning_content"]);
  EXPECT_EQ(calls_json(p.tool_calls), unordered(want["tool_calls"]));
  EXPECT_EQ(tool_finish_reason(p, text, !c["stop"].is_null()), want["finish_reason"]);
}

TEST_P(ToolCallCase, StreamedDeltasAddUpToTheParsedMessage) {
  const ordered_json c = read(kDir + "/" + GetParam());
  const std::string prefix = c.value("generation_prefix", std::string());
  const std::string output = c["output"].get<std::string>();
  const ordered_json& want = c["expected"];
  for (size_t step : {size_t{1}, size_t{2}, size_t{5}, size_t{13}, output.size()}) {
    OutputStreamParser sp(prefix);
    std::string content, reasoning;
    std::vector<ParsedToolCall> calls;
    auto take = [&](const OutputDelta& d) {
      content += d.content;
      reasoning += d.reasoning;
      EXPECT_EQ(d.first_call_index, calls.size());
      calls.insert(calls.end(), d.tool_calls.begin(), d.tool_calls.end());
    };
    for (size_t k = 0; k < output.size(); k += step) take(sp.feed(output.substr(k, step)));
    take(sp.finish());
    EXPECT_EQ(content.empty() ? ordered_json(nullptr) : ordered_json(content), want["content"])
        << "step " << step;
    EXPECT_EQ(reasoning.empty() ? ordered_json(nullptr) : ordered_json(reasoning),
              want["reasoning_content"])
        << "step " << step;
    EXPECT_EQ(calls_json(calls), unordered(want["tool_calls"])) << "step " << step;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, ToolCallCase, testing::ValuesIn(case_files()),
                         [](const testing::TestParamInfo<std::string>& param_info) {
                           std::string n = param_info.param.substr(0, param_info.param.find('.'));
                           for (char& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(ToolCallParsing, HostileOutputNeverThrows) {
  // Unbalanced nesting far past the depth bound, markers in every order, cut strings.
  std::string deep = "<|tool_call>call:f{a:" + std::string(10000, '[') + "<tool_call|>";
  EXPECT_NO_THROW(parse_model_output(deep));
  EXPECT_EQ(parse_model_output(deep).content, deep);
  for (std::string s : {"<|tool_call>", "<|channel>", "<channel|><channel|>",
                        "<|tool_call>call:", "<|tool_call>call:f{a:<|\"|>", "<|tool_call>call:f{}",
                        "<tool_call|>", "<|tool_call>call:f{a:1e999}<tool_call|>"}) {
    EXPECT_NO_THROW(parse_model_output(s)) << s;
    OutputStreamParser sp;
    EXPECT_NO_THROW(sp.feed(s));
    EXPECT_NO_THROW(sp.finish());
  }
}
