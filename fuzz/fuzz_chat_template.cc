// The Jinja interpreter (template/jinja.h) on arbitrary template source, rendered with a
// conversation shaped like a chat request (messages with tools and tool calls). A template ships
// with a checkpoint, so parsing and rendering must fail only with an Error (TemplateError or
// TemplateRaised) and stay within the render limits, never crash or run away.
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "template/jinja.h"

using namespace gemstage;
using namespace gemstage::jinja;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const nlohmann::ordered_json context = nlohmann::ordered_json::parse(R"({
    "bos_token": "<bos>", "add_generation_prompt": true, "enable_thinking": false,
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "d",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}}}],
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"},
                                   {"type": "image"}]},
      {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
        {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "name": "get_weather", "content": "{\"temp\": 21}"}]})");
  RenderLimits limits;
  limits.max_output_bytes = size_t{1} << 20;
  limits.max_loop_iterations = 100'000;
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  fuzz::expect_error_or_success([&] {
    const Template t(source, "fuzzed template");
    (void)t.render(context, limits);
  });
  return 0;
}
