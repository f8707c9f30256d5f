// `gemstage template` / `parse-output` on the golden cases, and the checkpoint-template choice.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "test_util.h"
#include "tokenizer/chat_format.h"

using namespace gemstage;
using nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void write(const std::string& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

int run(const std::string& args, const std::string& out) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + out + " 2>&1";
  return std::system(cmd.c_str());
}

}  // namespace

TEST(TemplateCli, PrintsEveryGoldenPromptExactly) {
  const std::string dir = gemstage::testing::temp_dir("template_cli");
  const std::string cases = std::string(GEMSTAGE_FIXTURES) + "/chat-template";
  const ordered_json index = ordered_json::parse(slurp(cases + "/index.json"));
  int checked = 0;
  for (const auto& c : index["cases"]) {
    const std::string file = cases + "/" + c["file"].get<std::string>();
    const ordered_json golden = ordered_json::parse(slurp(file));
    const int rc = run("template --model " + std::string(GEMSTAGE_FIXTURES) +
                           "/gemma4-tiny/model --conversation " + file,
                       dir + "/out");
    const std::string out = slurp(dir + "/out");
    if (golden["expected"].is_object()) {
      EXPECT_NE(rc, 0) << file;
      EXPECT_NE(out.find(golden["expected"]["error"].get<std::string>()), std::string::npos) << out;
    } else {
      EXPECT_EQ(rc, 0) << file << ": " << out;
      EXPECT_EQ(out, golden["expected"].get<std::string>()) << file;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 27);
}

TEST(TemplateCli, ParseOutputPrintsTheMessage) {
  const std::string dir = gemstage::testing::temp_dir("parse_output_cli");
  write(dir + "/text",
        "<|channel>thought\nhm<channel|>Sure.<|tool_call>call:f{x:<|\"|>a<|\"|>}<tool_call|>");
  ASSERT_EQ(run("parse-output --text-file " + dir + "/text", dir + "/out"), 0)
      << slurp(dir + "/out");
  const auto j = nlohmann::json::parse(slurp(dir + "/out"));
  EXPECT_EQ(j["content"], "Sure.");
  EXPECT_EQ(j["reasoning_content"], "hm");
  EXPECT_EQ(j["tool_calls"], nlohmann::json::parse(R"([{"name":"f","arguments":{"x":"a"}}])"));
}

// The command line as the README documents it, --model included: CLI11 once wrote --model into
// storage the action had not kept alive, and every such call aborted.
TEST(TemplateCli, ParseOutputWithModelAsDocumented) {
  const std::string dir = gemstage::testing::temp_dir("parse_output_model_cli");
  write(dir + "/text", "Plain answer.");
  ASSERT_EQ(run("parse-output --model " + std::string(GEMSTAGE_FIXTURES) +
                    "/gemma4-tiny/model --text-file " + dir + "/text",
                dir + "/out"),
            0)
      << slurp(dir + "/out");
  const auto j = nlohmann::json::parse(slurp(dir + "/out"));
  EXPECT_EQ(j["content"], "Plain answer.");
}

// 12345678901234567890 fits uint64: Python's Jinja prints it as the integer and json.loads keeps
// it one, so the template, the built-in renderer and parse-output must too (never 1.23...e+19);
// `| trim` strips the Unicode whitespace Python's str.strip() strips.
TEST(TemplateCli, BigIntegersStayIntegersAndTrimStripsUnicodeSpace) {
  const std::string dir = gemstage::testing::temp_dir("template_cli_bigint");
  write(dir + "/text", "<|tool_call>call:f{n:12345678901234567890,m:-5}<tool_call|>");
  ASSERT_EQ(run("parse-output --text-file " + dir + "/text", dir + "/out"), 0)
      << slurp(dir + "/out");
  const std::string parsed = slurp(dir + "/out");
  EXPECT_EQ(parsed.find("e+19"), std::string::npos) << parsed;
  const auto j = nlohmann::json::parse(parsed);
  const auto& n = j["tool_calls"][0]["arguments"]["n"];
  EXPECT_TRUE(n.is_number_unsigned()) << parsed;
  EXPECT_EQ(n.get<uint64_t>(), 12345678901234567890ull);
  EXPECT_EQ(j["tool_calls"][0]["arguments"]["m"], -5);

  const std::string model = dir + "/model";
  fs::create_directories(model);
  write(model + "/chat_template.jinja",
        "{% for m in messages %}[{{ m.content | trim }}]"
        "{% for c in m.tool_calls or [] %}{{ c.function.arguments.n }} "
        "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}");
  write(dir + "/conversation.json", R"({"messages": [
    {"role": "user", "content": "\u00a0\u3000 hi \u2003\u2028"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
      "function": {"name": "f", "arguments": {"n": 12345678901234567890}}}]}]})");
  ASSERT_EQ(run("template --model " + model + " --conversation " + dir + "/conversation.json",
                dir + "/out"),
            0)
      << slurp(dir + "/out");
  EXPECT_EQ(slurp(dir + "/out"), "[hi][]12345678901234567890 {\"n\": 12345678901234567890}");
  ASSERT_EQ(run("template --builtin --conversation " + dir + "/conversation.json", dir + "/out"), 0)
      << slurp(dir + "/out");
  EXPECT_NE(slurp(dir + "/out").find("n:12345678901234567890}"), std::string::npos)
      << slurp(dir + "/out");
  EXPECT_NE(slurp(dir + "/out").find("<|turn>user\nhi<turn|>"), std::string::npos)
      << slurp(dir + "/out");
}

TEST(ConversationRendererChoice, CheckpointTemplateWinsAndItsRaiseIsAnError) {
  const std::string dir = gemstage::testing::temp_dir("renderer_choice");
  const ordered_json msgs = ordered_json::parse(R"([{"role":"user","content":" Hi "}])");
  // No template: the built-in renderer.
  EXPECT_EQ(ConversationRenderer::for_model_dir(dir).source(), "built-in");
  EXPECT_EQ(ConversationRenderer::for_model_dir(dir).render(msgs, nullptr, {}),
            "<bos><|turn>user\nHi<turn|>\n<|turn>model\n");
  // tokenizer_config.json's chat_template, with its bos_token.
  write(
      dir + "/tokenizer_config.json",
      R"({"bos_token": "<s>", "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"})");
  EXPECT_EQ(ConversationRenderer::for_model_dir(dir).render(msgs, nullptr, {}), "<s>[user]Hi>");
  // chat_template.jinja wins over the config.
  write(dir + "/chat_template.jinja",
        "{%- if tools %}{{ raise_exception('tools are not supported by this template') }}"
        "{%- endif %}\n{% for m in messages %}\n  {{- m.content }}\n{% endfor %}\n");
  const ConversationRenderer r = ConversationRenderer::for_model_dir(dir);
  EXPECT_EQ(r.source(), dir + "/chat_template.jinja");
  EXPECT_EQ(r.render(msgs, nullptr, {}), " Hi \n");  // the newline after }} is kept
  try {
    r.render(msgs, ordered_json::parse(R"([{"type":"function","function":{"name":"f"}}])"), {});
    FAIL() << "expected the template's exception";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "tools are not supported by this template");
  }
  // A template that does not parse is refused when the checkpoint is opened, naming the file.
  write(dir + "/chat_template.jinja", "{% if x %}never closed");
  try {
    ConversationRenderer::for_model_dir(dir);
    FAIL() << "expected a parse error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chat_template.jinja:1:"), std::string::npos) << e.what();
  }
}
