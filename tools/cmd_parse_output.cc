// gemstage parse-output: the Gemma 4 output parser on its own, for people debugging tool calls.
#include <iostream>

#include "io/mapped_file.h"
#include "tokenizer/chat_output.h"
#include "tools/commands.h"

namespace gemstage::cli {

void add_parse_output_command(CLI::App& app, Registry& reg) {
  struct Args {
    std::string model, text_file, prefix;
  };
  auto& a = reg.args<Args>();
  auto* sub = app.add_subcommand(
      "parse-output",
      "parse raw model output (special tokens as text) into the assistant message JSON: "
      "content, reasoning_content, tool_calls");
  sub->add_option("--model", a.model, "model directory (accepted for symmetry; Gemma 4 syntax)");
  sub->add_option("--text-file", a.text_file, "file holding the generated text")->required();
  sub->add_option("--generation-prefix", a.prefix,
                  "text the prompt already ended with inside the model turn, e.g. "
                  "'<|channel>thought\\n' after a tool result with thinking on");
  reg.add(sub, [&a] {
    const std::string text = a.prefix + read_text_file(a.text_file);
    std::cout << parsed_output_json(parse_model_output(text)).dump(2) << "\n";
    return 0;
  });
}

}  // namespace gemstage::cli
