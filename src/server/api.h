// The OpenAI-compatible wire format of `gemstage serve`: request bodies parsed and validated into
// typed requests, errors in OpenAI's shape, and the response / stream-chunk objects. Nothing here
// touches sockets or models, so every rule can be unit-tested on plain JSON.
//
// Validation is strict where silence would mislead a client (an unknown role, n != 1, a remote
// image URL we will not fetch, tools we cannot call) and lenient where OpenAI clients routinely
// send extras (unknown keys, null for "use the default").
#pragma once

#include <cstdint>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "runtime/assistant.h"
#include "runtime/generation.h"
#include "server/remote_media.h"
#include "tokenizer/chat_output.h"

namespace gemstage::server {

// A request the server will not serve, with everything OpenAI's error object carries. It is a
// gemstage::Error so code that only knows that type still reports it sensibly.
class ApiError : public Error {
 public:
  ApiError(int status, const std::string& message, std::string type = "invalid_request_error",
           std::string param = {}, std::string code = {})
      : Error(message),
        status_(status),
        type_(std::move(type)),
        param_(std::move(param)),
        code_(std::move(code)) {}

  int status() const { return status_; }
  const std::string& type() const { return type_; }
  const std::string& param() const { return param_; }  // empty: null on the wire
  const std::string& code() const { return code_; }    // empty: null on the wire

 private:
  int status_;
  std::string type_, param_, code_;
};

// 400 invalid_request_error naming the offending field.
[[noreturn]] void bad_request(const std::string& param, const std::string& code,
                              const std::string& message);

// Field helpers the request parsers share. member(): the member, or null when it is absent or
// JSON null (OpenAI clients send null for "use the default"). wrong_type(): a 400 "'param' must be
// WANT, not <the JSON type it was>".
const nlohmann::json* member(const nlohmann::json& obj, const char* key);
const char* type_name(const nlohmann::json& v);
[[noreturn]] void wrong_type(const std::string& param, const char* want, const nlohmann::json& got);
// The member, or a 400 "'param' is required".
const nlohmann::json& required_member(const nlohmann::json& obj, const char* key,
                                      const std::string& param);
std::string required_string(const nlohmann::json& obj, const char* key, const std::string& param);

// {"error": {"message", "type", "param", "code"}}
nlohmann::json error_json(const ApiError& e);

struct RequestLimits {
  // Decoded images larger than this are refused before any pixel buffer is allocated (a
  // decompression bomb in a data URL must not reach the image processor); a request's images
  // together may have four times this many.
  int64_t max_image_pixels = ImageLimits{}.max_pixels;
  // video_url parts may name files (file:///...) under this directory; empty: none (vLLM's
  // --allowed-local-media-path). Data URLs are always accepted.
  std::string allowed_local_media_path;
  // The sampling of every request's videos (serve --video-frames / --video-budget; 0: the
  // model's video processor setting).
  int video_frames = 0, video_budget = 0;
  // http(s) image and audio URLs: fetched only when enabled (--allow-remote-media).
  RemoteMediaOptions remote_media;
};

// What a request may set on top of the server's defaults; unset fields keep the default.
struct SamplingOverrides {
  std::optional<int> max_tokens;
  std::optional<float> temperature, top_p, min_p;
  std::optional<int> top_k;
  std::optional<uint64_t> seed;
  std::optional<std::vector<std::string>> stop;
  // response_format json_object / json_schema: the output is one such JSON value.
  std::shared_ptr<const JsonGrammar> json_grammar;
  // logprobs: true, with top_logprobs alternatives (0-20) per token.
  std::optional<int> top_logprobs;
  // llama.cpp's per-request speculative fields "speculative.n_max" (drafts per round at most; 0:
  // no drafting for this request) and "speculative.n_min" (rounds that would draft fewer run a
  // plain step), 0-kMaxDraftsPerRound; unset: the server's --draft-max / --draft-min.
  std::optional<int> draft_max, draft_min;
  // llama.cpp's "ignore_eos": true generates max_tokens even past the model's stop ids, false
  // stops on them; unset: the server's --ignore-eos.
  std::optional<bool> ignore_eos;
  // OpenAI's frequency_penalty / presence_penalty (-2 to 2) and logit_bias ({"id": bias}, bias
  // -100 to 100; llama.cpp's [[id, bias], ...] form too), applied by the sampler.
  std::optional<float> frequency_penalty, presence_penalty;
  // llama.cpp's repeat_penalty (1: off) and repeat_last_n (-1: all the history, 0: none).
  std::optional<float> repeat_penalty;
  std::optional<int> repeat_last_n;
  std::vector<std::pair<int32_t, float>> logit_bias;
};

// The most drafts one round may verify (the target's sliding rings keep room for this many rows
// to roll back: gemma4/assistant_model.cc).
constexpr int kMaxDraftsPerRound = 64;

// The most choices (`n`) one request may ask for before the server compares it with its slots.
constexpr int kMaxChoices = 1024;

// The fields chat and text completions share.
struct GenerationRequest {
  std::string model;  // as sent; the server serves its one model whatever is asked for
  SamplingOverrides sampling;
  bool stream = false, include_usage = false;
  // OpenAI's `n`: choices generated from the one prompt, each on its own slot (the server checks
  // it against its slot count).
  int n = 1;
};

struct ChatRequest : GenerationRequest {
  std::vector<ChatInput> messages;
};

struct CompletionRequest : GenerationRequest {
  std::string prompt;
  // A prompt sent as token ids: used as given (no <bos>, no tokenization); `prompt` is then empty.
  std::optional<std::vector<int32_t>> prompt_ids;
};

// What a token-id prompt is checked against, from the loaded model: every id in
// [0, vocab_size), and fewer ids than max_context (room for one generated token, as for a text
// prompt), checked before the ids are copied.
struct PromptIdLimits {
  int64_t vocab_size = std::numeric_limits<int32_t>::max();
  int64_t max_context = std::numeric_limits<int64_t>::max();
};

// The body as JSON; a 400 (code "invalid_json") when it does not parse or is not an object.
nlohmann::json parse_json_body(std::string_view body);

// POST /v1/chat/completions and POST /v1/completions. Images in data URLs are decoded here, so a
// bad image is refused before the request waits for a slot. Throws ApiError.
ChatRequest parse_chat_request(const nlohmann::json& body, const RequestLimits& limits = {});
CompletionRequest parse_completion_request(const nlohmann::json& body,
                                           const PromptIdLimits& id_limits = {});

// Strict RFC 4648 base64 (standard alphabet; padding optional, whitespace not allowed).
// nullopt on any other character or an impossible length.
std::optional<std::vector<uint8_t>> decode_base64(std::string_view text);
std::string encode_base64(const uint8_t* data, size_t size);

// The server's defaults with a request's overrides applied. fallback_seed seeds the sampler when
// neither the request nor the server fixes one.
GenerationOptions apply_overrides(const GenerationOptions& defaults, const SamplingOverrides& o,
                                  uint64_t fallback_seed);

// GenerationResult::finish_reason as OpenAI names it: the context limit is a "length" stop too.
std::string openai_finish_reason(const std::string& finish_reason);

// Response objects. `created` is Unix seconds.
struct ResponseMeta {
  std::string id, model;
  int64_t created = 0;
};
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens);
nlohmann::json chat_completion_json(const ResponseMeta& m, const std::string& text,
                                    const std::string& finish_reason, int64_t prompt_tokens,
                                    int64_t completion_tokens);
// One chat.completion.chunk: `delta` as given, finish_reason null unless set.
nlohmann::json chat_chunk_json(const ResponseMeta& m, const nlohmann::json& delta,
                               const std::optional<std::string>& finish_reason);
nlohmann::json text_completion_json(const ResponseMeta& m, const std::string& text,
                                    const std::string& finish_reason, int64_t prompt_tokens,
                                    int64_t completion_tokens);
nlohmann::json text_completion_chunk_json(const ResponseMeta& m, const std::string& text,
                                          const std::optional<std::string>& finish_reason);
// The final chunk of a stream with include_usage: no choices, just usage.
nlohmann::json usage_chunk_json(const ResponseMeta& m, const std::string& object,
                                int64_t prompt_tokens, int64_t completion_tokens);
// multimodal: the model takes images or audio (llama-server's "multimodal" capability).
nlohmann::json models_json(const std::string& model, int64_t created, bool multimodal = false);

// ---------------------------------------------------------------------------------------------
// Tool calling on /v1/chat/completions (docs/gemma4-tools.md, "OpenAI mapping").
// Request side: the conversation as the chat template takes it; reply side: Gemma's raw output
// parsed (tokenizer/chat_output.h) into content, reasoning_content and tool_calls. tool_choice
// is validated and recorded here; the server enforces it while sampling (runtime/
// json_constraint.h: "required" and a named function force a call, "none" bans one).
struct ToolRequest {
  nlohmann::ordered_json messages;   // tool_calls[].function.arguments parsed into objects
  nlohmann::ordered_json tools;      // null, or the request's function tools as sent
  std::string tool_choice = "auto";  // auto | none | required | function
  std::string tool_choice_name;      // the function tool_choice names
  bool parallel_tool_calls = true;
  // chat_template_kwargs.enable_thinking (llama.cpp's convention; a Messages request's
  // `thinking`): this request's choice, else the server's --think.
  std::optional<bool> enable_thinking;
  // add_generation_prompt (default true) and continue_final_message (default false), as vLLM
  // and llama-server take them; both true is refused.
  bool add_generation_prompt = true, continue_final_message = false;
  // The images (image_url data URLs) and audio clips (input_audio) of user messages, decoded, and
  // their videos (video_url, decoded when the prompt is prepared), in message order; in
  // `messages` each such part is {"type": "image"} / {"type": "audio"} / {"type": "video"}, the
  // parts the chat template writes a placeholder for.
  std::vector<ChatInputPart> media;
};

// Validates tools, tool_choice, parallel_tool_calls and the messages (tool role, assistant
// tool_calls with JSON-string arguments, reasoning_content, content parts as
// parse_chat_request takes them). Throws ApiError 400 naming the part.
ToolRequest parse_tool_request(const nlohmann::json& body, const RequestLimits& limits = {});
// True when a chat request needs the tool path: tools, a tool_choice, a tool message, an
// assistant message with tool_calls or reasoning_content.
bool wants_tool_path(const nlohmann::json& body);
// The sampling / streaming fields every generation request shares (ApiError on bad values).
GenerationRequest parse_generation_fields(const nlohmann::json& body);

// The reply message: {"role", "content", ["reasoning_content"], ["tool_calls"]}; call ids come
// from new_call_id ("call_<unique>").
nlohmann::json chat_message_json(const ParsedOutput& parsed,
                                 const std::function<std::string()>& new_call_id);
// A whole chat.completion from raw generated text (special tokens kept as strings). finish_reason
// follows the tool rules: tool_calls / stop / length.
nlohmann::json chat_tool_completion_json(const ResponseMeta& m, const std::string& raw_text,
                                         bool stopped_on_stop_token, int64_t prompt_tokens,
                                         int64_t completion_tokens,
                                         const std::function<std::string()>& new_call_id);
// The chunks one OutputDelta streams as: reasoning_content, content, then one chunk per completed
// call with delta.tool_calls = [{index, id, type, function: {name, arguments}}].
std::vector<nlohmann::json> chat_delta_chunks(const ResponseMeta& m, const OutputDelta& d,
                                              const std::function<std::string()>& new_call_id);

// JSON text for the wire. Invalid UTF-8 (which can reach an error message quoting a client's
// bytes) is replaced rather than thrown on, so building a reply can never fail.
std::string wire_json(const nlohmann::json& j);

// A choice's `logprobs`: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
// "refusal": null}, tokens as their text (special tokens by name) and raw bytes.
nlohmann::json logprobs_json(const Tokenizer& tokenizer, std::span<const TokenLogprob> tokens);

// Sorts generated tokens, in order, into reply text and the rest: a thought channel
// (<|channel>...<channel|>), a tool call (<|tool_call>...<tool_call|>) and every special token
// are not reply text. The Responses API gives only the output_text's tokens logprobs.
class ReplyTextTokens {
 public:
  // generation_prefix: what the prompt's model turn already began with (an open thought channel).
  ReplyTextTokens(const Tokenizer& tokenizer, std::string_view generation_prefix);
  // True when `id`, the next generated token, is reply text.
  bool take(int32_t id);
  // The reply-text tokens of `tokens` (taken in order) as logprobs_json's content entries.
  nlohmann::json take_logprobs(std::span<const TokenLogprob> tokens);

 private:
  enum class In { kText, kThought, kCall };
  const Tokenizer& tokenizer_;
  In in_ = In::kText;
  std::optional<int32_t> channel_open_, channel_close_, call_open_, call_close_;
};

// "data: <json>\n\n", the server-sent-events framing of one stream chunk.
std::string sse_event(const nlohmann::json& chunk);
// "event: <name>\ndata: <json>\n\n", the framing of the Messages and Responses streams.
std::string sse_named_event(const std::string& name, const nlohmann::json& data);

}  // namespace gemstage::server
