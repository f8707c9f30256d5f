// gemstage template: the chat template on its own, for people debugging prompts.
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "io/mapped_file.h"
#include "tokenizer/chat_format.h"
#include "tools/commands.h"

namespace gemstage::cli {
namespace {

using nlohmann::ordered_json;

ordered_json read_conversation(const std::string& path) {
  ordered_json j;
  try {
    j = ordered_json::parse(read_text_file(path));
  } catch (const ordered_json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
  if (!j.is_object()) fail(path, ": expected a JSON object with \"messages\"");
  if (!j.contains("messages") || !j["messages"].is_array())
    fail(path, ": \"messages\" must be a list");
  return j;
}

bool flag(const ordered_json& j, const char* key, bool def, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return def;
  if (!j[key].is_boolean()) fail(path, ": \"", key, "\" must be true or false");
  return j[key].get<bool>();
}

}  // namespace

void add_template_command(CLI::App& app, Registry& reg) {
  auto* sub = app.add_subcommand(
      "template",
      "print the prompt a conversation renders to, exactly (the checkpoint's chat template, or "
      "the built-in Gemma 4 renderer when it ships none)");
  struct Args {
    std::string model, conversation;
    bool builtin = false;
  };
  auto& a = reg.args<Args>();
  sub->add_option("--model", a.model,
                  "model directory (chat_template.jinja / tokenizer_config.json)");
  sub->add_option("--conversation", a.conversation,
                  "JSON file: {messages, tools, add_generation_prompt, enable_thinking, "
                  "preserve_thinking}")
      ->required();
  sub->add_flag("--builtin", a.builtin,
                "use the built-in renderer even if the model has a template");
  reg.add(sub, [&a] {
    const ordered_json conv = read_conversation(a.conversation);
    ConversationOptions o;
    o.add_generation_prompt = flag(conv, "add_generation_prompt", true, a.conversation);
    o.enable_thinking = flag(conv, "enable_thinking", false, a.conversation);
    o.preserve_thinking = flag(conv, "preserve_thinking", false, a.conversation);
    const ConversationRenderer r = a.builtin || a.model.empty()
                                       ? ConversationRenderer()
                                       : ConversationRenderer::for_model_dir(a.model);
    std::cout << r.render(conv["messages"], conv.value("tools", ordered_json()), o);
    std::cout.flush();
    return 0;
  });
}

}  // namespace gemstage::cli
