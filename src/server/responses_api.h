// OpenAI's Responses API (`POST /v1/responses`), the dialect of Codex and the newer OpenAI SDK
// helpers, mapped onto the chat-completions machinery of api.h the way messages_api.h maps
// Anthropic's: input items (messages, function_call, function_call_output, reasoning) and
// `instructions` become a chat-completions body, and the parsed model output becomes output items
// (reasoning, message, function_call), whole or as the typed, numbered stream events.
//
// The server keeps no conversations: `previous_response_id` is refused (send the whole input),
// and `store` is accepted but nothing is stored.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/api.h"
#include "tokenizer/chat_output.h"

namespace gemstage::server::responses {

struct Request {
  nlohmann::json chat_body;  // the same request as a /v1/chat/completions body
  bool has_media = false;    // input_image / input_audio parts
  bool stream = false;
  // Echoed in the response object, as OpenAI's is.
  nlohmann::json echo;  // instructions, max_output_tokens, temperature, top_p, tools, ...
};

// Throws ApiError 400 naming the Responses field (e.g. "input[1].content[0].image_url").
Request to_chat_body(const nlohmann::json& body);

// Fresh ids for the output items: "rs_", "msg_", "fc_" items and "call_" call ids.
using NewId = std::function<std::string(const char* prefix)>;

// The response object; status "completed", or "incomplete" with incomplete_details when the
// tool path's finish is "length". text_logprobs: the output_text part's "logprobs" (entries as
// logprobs_json's content, of the reply text's tokens: ReplyTextTokens).
nlohmann::json response_json(const ResponseMeta& m, const nlohmann::json& echo,
                             const ParsedOutput& parsed, const std::string& tool_finish_reason,
                             int64_t input_tokens, int64_t output_tokens, const NewId& new_id,
                             const nlohmann::json& text_logprobs = nlohmann::json::array(),
                             int64_t cached_tokens = 0);

// A streamed reply: response.created / in_progress, then per output item output_item.added,
// its part and text (or arguments) deltas and their done events, output_item.done, and last
// response.completed (or response.incomplete) carrying the whole response. Every event has a
// sequence_number.
class EventStream {
 public:
  EventStream(ResponseMeta meta, nlohmann::json echo, NewId new_id)
      : meta_(std::move(meta)), echo_(std::move(echo)), new_id_(std::move(new_id)) {}
  std::string begin();
  // text_logprobs: the logprobs of the reply-text tokens behind d.content (output_text.delta's
  // "logprobs"; they also add up to the output_text part's).
  std::string delta(const OutputDelta& d,
                    const nlohmann::json& text_logprobs = nlohmann::json::array());
  // cached_tokens: prompt tokens reused from a slot's caches (input_tokens_details).
  std::string end(const std::string& tool_finish_reason, int64_t input_tokens,
                  int64_t output_tokens, int64_t cached_tokens = 0);
  std::string error(const ApiError& e);

 private:
  std::string message_status_ = "completed";  // the status close() gives a message item
  enum class Item { kNone, kReasoning, kMessage };
  std::string event(const std::string& type, nlohmann::json data);
  std::string open(Item kind);
  std::string close();
  ResponseMeta meta_;
  nlohmann::json echo_;
  NewId new_id_;
  std::vector<nlohmann::json> output_;  // items finished so far, in order
  Item open_ = Item::kNone;
  std::string open_text_;                                   // the open item's text so far
  nlohmann::json open_logprobs_ = nlohmann::json::array();  // and its text's logprobs
  int64_t sequence_ = 0;
};

}  // namespace gemstage::server::responses
