// Anthropic's Messages API (`POST /v1/messages`), the dialect Claude Code and the Anthropic SDKs
// speak, mapped onto the chat-completions machinery of api.h: a Messages body is checked with
// errors naming its own fields, then rewritten as the equivalent chat-completions body (system
// turn, tool_use as tool_calls, tool_result as tool messages, thinking as reasoning_content), so
// the chat template, images and the output parser are the ones every other route uses. Replies go
// the other way: the parsed model output becomes content blocks (thinking, text, tool_use) and a
// stream becomes Anthropic's named server-sent events.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "server/api.h"
#include "tokenizer/chat_output.h"

namespace gemstage::server::messages {

struct Request {
  nlohmann::json chat_body;  // the same request as a /v1/chat/completions body
  bool has_media = false;    // image blocks
  bool stream = false;
};

// Throws ApiError 400 naming the Messages field (e.g. "messages[2].content[0].source").
Request to_chat_body(const nlohmann::json& body);

// finish as the tool path reports it (stop / tool_calls / length) in Anthropic's words; a "stop"
// on one of the request's stop_sequences is "stop_sequence".
std::string stop_reason(const std::string& tool_finish_reason,
                        const std::string& stop_sequence = {});

// {"type": "error", "error": {"type", "message"}}, the Messages error shape; the HTTP status
// stays the ApiError's.
nlohmann::json error_json(const ApiError& e);

// A whole reply: {"id", "type": "message", "role", "model", "content": [blocks], "stop_reason",
// "stop_sequence" (the matched string when stop_reason is "stop_sequence", else null), "usage"}.
nlohmann::json message_json(const ResponseMeta& m, const ParsedOutput& parsed,
                            const std::string& stop_reason, int64_t input_tokens,
                            int64_t output_tokens,
                            const std::function<std::string()>& new_tool_use_id,
                            const std::string& stop_sequence = {}, int64_t cached_tokens = 0);

// A streamed reply: message_start, then content_block_start / _delta / _stop per block (a block
// opens when its kind of output first arrives and closes when another kind begins), message_delta
// with the stop reason and message_stop. Each call returns the framed events to write.
class EventStream {
 public:
  EventStream(ResponseMeta meta, std::function<std::string()> new_tool_use_id)
      : meta_(std::move(meta)), new_tool_use_id_(std::move(new_tool_use_id)) {}
  // input_tokens: the whole prompt; cached_tokens of it were reused (usage's
  // cache_read_input_tokens).
  std::string begin(int64_t input_tokens, int64_t cached_tokens = 0);
  std::string delta(const OutputDelta& d);
  std::string end(const std::string& stop_reason, int64_t output_tokens,
                  const std::string& stop_sequence = {});
  static std::string error(const ApiError& e);

 private:
  enum class Block { kNone, kThinking, kText };
  std::string open(Block kind);
  std::string close();
  ResponseMeta meta_;
  std::function<std::string()> new_tool_use_id_;
  Block open_ = Block::kNone;
  int index_ = -1;
};

}  // namespace gemstage::server::messages
