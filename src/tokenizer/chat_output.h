// Gemma 4 model output parsed into an assistant message (docs/gemma4-tools.md,
// "Parsing model output"): thought channels become reasoning,
// <|tool_call>call:NAME{...}<tool_call|> blocks become tool calls with JSON arguments, everything
// else is content. Malformed or unfinished calls stay in the content verbatim; parsing never throws
// on any input.
#pragma once

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace gemstage {

// The token that opens and closes a string inside a tool call's or declaration's arguments, in
// place of '"' (docs/gemma4-tools.md).
inline constexpr std::string_view kToolStringQuote = "<|\"|>";

struct ParsedToolCall {
  std::string name;
  nlohmann::ordered_json arguments;  // always a JSON object
};

struct ParsedOutput {
  std::optional<std::string> content;    // trimmed; nullopt when nothing is left
  std::optional<std::string> reasoning;  // non-empty thought blocks joined by "\n"
  std::vector<ParsedToolCall> tool_calls;
  // Offset just past the last parsed call's <tool_call|> (0 without calls).
  size_t end_of_last_call = 0;
};

// `text` is the generation prefix the prompt ended with (e.g. "<|channel>thought\n" after a tool
// result with thinking on) followed by the generated text, special tokens as their strings,
// without the stop token.
ParsedOutput parse_model_output(std::string_view text);

// OpenAI finish_reason: stopped on a stop token -> "tool_calls" when a call parsed, else "stop";
// at the token limit -> "length", unless a call parsed and only whitespace follows it.
std::string tool_finish_reason(const ParsedOutput& parsed, std::string_view text,
                               bool stopped_on_stop_token);

// {"content", "reasoning_content", "tool_calls": [{"name", "arguments"}]}, what
// `gemstage parse-output` prints.
nlohmann::ordered_json parsed_output_json(const ParsedOutput& parsed);

// The streamed form: feed() the generated text piece by piece; each call returns what became
// final since the last one. Concatenating every delta gives exactly parse_model_output of the
// whole text: content and reasoning are held back while they could still change (whitespace that
// may turn out trailing, a marker cut in half, a call not yet closed), and a call is only
// reported once it is complete.
struct OutputDelta {
  std::string content;
  std::string reasoning;
  std::vector<ParsedToolCall> tool_calls;  // completed calls, in order
  size_t first_call_index = 0;             // index of tool_calls[0] in the whole response
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
};

class OutputStreamParser {
 public:
  explicit OutputStreamParser(std::string generation_prefix = {})
      : text_(std::move(generation_prefix)) {}
  OutputDelta feed(std::string_view piece);
  OutputDelta finish();  // the end of generation: pending calls become content
  const std::string& text() const { return text_; }
  size_t calls_sent() const { return calls_sent_; }

 private:
  OutputDelta diff(const ParsedOutput& now);
  std::string text_;
  size_t content_sent_ = 0, reasoning_sent_ = 0, calls_sent_ = 0;
};

}  // namespace gemstage
