// gemstage parse-output: the Gemma 4 output parser on its own, for people debugging tool calls.
#include <iostream>
#include <memory>

#include "io/mapped_file.h"
#include "tokenizer/chat_output.h"
#include "tools/commands.h"

namespace gemstage::cli {

void add_parse_output_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand(
      "parse-output",
      "parse raw model output (special tokens as text) into the assistant message JSON: "
      "content, reasoning_content, tool_calls");
  auto model = std::make_shared<std::string>();
  auto text_file = std::make_shared<std::string>();
  auto prefix = std::make_shared<std::string>();
  sub->add_option("--model", *model, "model directory (accepted for symmetry; Gemma 4 syntax)");
  sub->add_option("--text-file", *text_file, "file holding the generated text")->required();
  sub->add_option("--generation-prefix", *prefix,
                  "text the prompt already ended with inside the model turn, e.g. "
                  "'<|channel>thought\\n' after a tool result with thinking on");
  reg.add(sub, [=] {
    const std::string text = *prefix + read_text_file(*text_file);
    std::cout << parsed_output_json(parse_model_output(text)).dump(2) << "\n";
    return 0;
  });
}

}  // namespace gemstage::cli
