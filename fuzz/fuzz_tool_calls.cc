// The model-output parser (tokenizer/chat_output.h): arbitrary generated text, whole and streamed
// in pieces whose length comes from the first byte. Neither form may throw, and for valid UTF-8
// the streamed deltas must add up to exactly the whole-text parse, as the server's streaming
// relies on.
#include "fuzz_util.h"
#include "tokenizer/chat_output.h"
#include "tokenizer/utf8.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const size_t step = 1 + data[0] % 17;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  // Generated text reaches the parser as whole UTF-8 characters (the stream decoder holds back a
  // partial one), so only valid text is held to the streamed == whole rule.
  if (utf8::find_invalid(text) != std::string_view::npos) {
    (void)parse_model_output(text);
    return 0;
  }
  const ParsedOutput whole = parse_model_output(text);
  OutputStreamParser stream;
  std::string content, reasoning;
  size_t calls = 0;
  auto take = [&](const OutputDelta& d) {
    content += d.content;
    reasoning += d.reasoning;
    calls += d.tool_calls.size();
  };
  for (size_t i = 0; i < text.size(); i += step) take(stream.feed(text.substr(i, step)));
  take(stream.finish());
  if (content != whole.content.value_or("") || reasoning != whole.reasoning.value_or("") ||
      calls != whole.tool_calls.size())
    __builtin_trap();  // the streamed reply would differ from the non-streamed one
  (void)parsed_output_json(whole).dump();
  return 0;
}
