#include "server/messages_api.h"

#include <limits>
#include <string_view>

#include "runtime/json_constraint.h"

namespace gemstage::server::messages {

using nlohmann::json;
constexpr auto named_event = sse_named_event;

namespace {

std::string at(const std::string& param, size_t i) {
  return param + "[" + std::to_string(i) + "]";
}

// A block list or a plain string, as Messages accepts for content, system and tool results.
std::vector<json> blocks_of(const json& content, const std::string& param) {
  if (content.is_string()) return {json{{"type", "text"}, {"text", content}}};
  if (!content.is_array()) wrong_type(param, "a string or an array of content blocks", content);
  std::vector<json> out;
  for (size_t i = 0; i < content.size(); ++i) {
    const json& b = content[i];
    if (!b.is_object()) wrong_type(at(param, i), "an object", b);
    required_string(b, "type", at(param, i) + ".type");
    out.push_back(b);
  }
  return out;
}

// Text blocks joined; any other block is refused with the reason.
std::string text_only(const json& content, const std::string& param, const char* what) {
  std::string text;
  const std::vector<json> blocks = blocks_of(content, param);
  for (size_t i = 0; i < blocks.size(); ++i) {
    const std::string type = blocks[i]["type"].get<std::string>();
    if (type != "text")
      bad_request(at(param, i) + ".type", "unsupported_value",
                  std::string(what) + " may hold only text blocks here, not '" + type + "'");
    if (!text.empty()) text += "\n";
    text += required_string(blocks[i], "text", at(param, i) + ".text");
  }
  return text;
}

// An image block as the data URL the chat-completions parser decodes (and bounds).
json image_part(const json& block, const std::string& param) {
  const json& source = required_member(block, "source", param + ".source");
  if (!source.is_object()) wrong_type(param + ".source", "an object", source);
  const std::string type = required_string(source, "type", param + ".source.type");
  // A URL source becomes an image_url part: the chat parser fetches it (--allow-remote-media) or
  // says why it does not.
  if (type == "url")
    return {{"type", "image_url"},
            {"image_url", {{"url", required_string(source, "url", param + ".source.url")}}}};
  if (type != "base64")
    bad_request(param + ".source.type", "unsupported_value",
                "image source '" + type +
                    "' is not supported; send {\"type\": \"base64\", \"media_type\": "
                    "\"image/png\", \"data\": ...} or {\"type\": \"url\", \"url\": ...}");
  const std::string media = required_string(source, "media_type", param + ".source.media_type");
  const std::string data = required_string(source, "data", param + ".source.data");
  return {{"type", "image_url"}, {"image_url", {{"url", "data:" + media + ";base64," + data}}}};
}

json function_tool(const json& tool, const std::string& param) {
  if (!tool.is_object()) wrong_type(param, "an object", tool);
  if (const json* type = member(tool, "type"); type && *type != "custom")
    bad_request(param + ".type", "unsupported_value",
                "server tools ('" + type->dump() +
                    "') are not available here; declare client tools with name, description and "
                    "input_schema");
  const std::string name = required_string(tool, "name", param + ".name");
  if (name.empty()) bad_request(param + ".name", "invalid_value", "a tool needs a non-empty name");
  json fn = {{"name", name}};
  if (const json* d = member(tool, "description")) {
    if (!d->is_string()) wrong_type(param + ".description", "a string", *d);
    fn["description"] = *d;
  }
  const json& schema = required_member(tool, "input_schema", param + ".input_schema");
  if (!schema.is_object()) wrong_type(param + ".input_schema", "an object (a JSON schema)", schema);
  fn["parameters"] = schema;
  return {{"type", "function"}, {"function", std::move(fn)}};
}

// One Messages turn as chat-completions messages: a user turn's tool_result blocks become tool
// messages (ahead of its other content, which answers them), an assistant turn's tool_use blocks
// its tool_calls and its thinking blocks its reasoning_content.
void convert_message(const json& m, const std::string& p, json& out, bool& has_media) {
  if (!m.is_object()) wrong_type(p, "an object", m);
  const std::string role = required_string(m, "role", p + ".role");
  if (role != "user" && role != "assistant")
    bad_request(p + ".role", "invalid_value",
                "role '" + role +
                    "' is not a Messages role; use user or assistant (the system "
                    "prompt is the top-level 'system')");
  const std::vector<json> blocks =
      blocks_of(required_member(m, "content", p + ".content"), p + ".content");
  json parts = json::array(), calls = json::array();
  std::string reasoning;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const json& b = blocks[i];
    const std::string bp = at(p + ".content", i);
    const std::string type = b["type"].get<std::string>();
    auto only = [&](const char* r) {
      if (role != r)
        bad_request(
            bp + ".type", "invalid_value",
            "'" + type + "' blocks belong in " + r + " messages, not " + role + " messages");
    };
    if (type == "text") {
      parts.push_back({{"type", "text"}, {"text", required_string(b, "text", bp + ".text")}});
    } else if (type == "image") {
      only("user");
      parts.push_back(image_part(b, bp));
      has_media = true;
    } else if (type == "tool_use") {
      only("assistant");
      const json& input = required_member(b, "input", bp + ".input");
      if (!input.is_object()) wrong_type(bp + ".input", "an object", input);
      calls.push_back(
          {{"id", required_string(b, "id", bp + ".id")},
           {"type", "function"},
           {"function",
            {{"name", required_string(b, "name", bp + ".name")}, {"arguments", input.dump()}}}});
    } else if (type == "tool_result") {
      only("user");
      if (const json* e = member(b, "is_error"); e && !e->is_boolean())
        wrong_type(bp + ".is_error", "a boolean", *e);
      const std::string error_prefix = b.value("is_error", false) ? "Error: " : "";
      // Text, or text and image blocks (a screenshot, an image file read by a tool): the
      // template writes the text as the result and an image placeholder after it per image.
      json content = error_prefix;
      if (const json* c = member(b, "content")) {
        const std::vector<json> result = blocks_of(*c, bp + ".content");
        const bool images = std::any_of(result.begin(), result.end(),
                                        [](const json& r) { return r["type"] == "image"; });
        if (!images) {
          content = error_prefix + text_only(*c, bp + ".content", "a tool_result");
        } else {
          content = json::array();
          if (!error_prefix.empty()) content.push_back({{"type", "text"}, {"text", error_prefix}});
          for (size_t k = 0; k < result.size(); ++k) {
            const std::string rp = at(bp + ".content", k);
            const std::string rt = result[k]["type"].get<std::string>();
            if (rt == "text") {
              content.push_back(
                  {{"type", "text"}, {"text", required_string(result[k], "text", rp + ".text")}});
            } else if (rt == "image") {
              content.push_back(image_part(result[k], rp));
              has_media = true;
            } else {
              bad_request(rp + ".type", "unsupported_value",
                          "a tool_result may hold only text and image blocks, not '" + rt + "'");
            }
          }
        }
      }
      out.push_back({{"role", "tool"},
                     {"tool_call_id", required_string(b, "tool_use_id", bp + ".tool_use_id")},
                     {"content", std::move(content)}});
    } else if (type == "thinking") {
      only("assistant");
      if (!reasoning.empty()) reasoning += "\n";
      reasoning += required_string(b, "thinking", bp + ".thinking");
    } else if (type == "redacted_thinking") {
      // Opaque by design; nothing of it can be rendered.
    } else {
      bad_request(bp + ".type", "unsupported_value",
                  "content block type '" + type +
                      "' is not supported; use text, image, tool_use, tool_result or thinking");
    }
  }
  if (parts.empty() && calls.empty() && reasoning.empty()) return;  // tool results only
  json msg = {{"role", role}};
  if (parts.size() == 1 && parts[0]["type"] == "text")
    msg["content"] = parts[0]["text"];
  else
    msg["content"] = parts.empty() ? json("") : parts;
  if (!calls.empty()) msg["tool_calls"] = std::move(calls);
  if (!reasoning.empty()) msg["reasoning_content"] = std::move(reasoning);
  out.push_back(std::move(msg));
}

}  // namespace

Request to_chat_body(const json& body) {
  Request r;
  json& c = r.chat_body;
  c = json::object();
  if (const json* model = member(body, "model")) {
    if (!model->is_string()) wrong_type("model", "a string", *model);
    c["model"] = *model;
  }
  // Required by the Messages API, so a client written against it always sends it.
  const json& max_tokens = required_member(body, "max_tokens", "max_tokens");
  if (!max_tokens.is_number_integer()) wrong_type("max_tokens", "an integer", max_tokens);
  c["max_tokens"] = max_tokens;
  // llama.cpp's speculative keys go through as sent: the chat parser checks them, naming the
  // field (a nested "speculative" object is passed on so that it is refused there too).
  for (const char* key :
       {"temperature", "top_p", "top_k", "speculative.n_max", "speculative.n_min", "speculative"})
    if (const json* v = member(body, key)) c[key] = *v;
  if (const json* stop = member(body, "stop_sequences")) {
    if (!stop->is_array()) wrong_type("stop_sequences", "an array of strings", *stop);
    if (!stop->empty()) c["stop"] = *stop;
  }
  if (const json* s = member(body, "stream")) {
    if (!s->is_boolean()) wrong_type("stream", "a boolean", *s);
    r.stream = s->get<bool>();
    c["stream"] = r.stream;
  }
  // Structured outputs: {"type": "json_schema", "schema": {...}}, enforced while sampling.
  if (const json* of = member(body, "output_format")) {
    if (!of->is_object()) wrong_type("output_format", "an object", *of);
    if (required_string(*of, "type", "output_format.type") != "json_schema")
      bad_request("output_format.type", "invalid_value",
                  "'output_format.type' must be json_schema");
    const json& schema = required_member(*of, "schema", "output_format.schema");
    try {
      JsonGrammar::from_schema(schema);
    } catch (const Error& e) {
      bad_request("output_format.schema", "unsupported_schema", e.what());
    }
    c["response_format"] = {{"type", "json_schema"},
                            {"json_schema", {{"name", "output"}, {"schema", schema}}}};
  }
  if (const json* t = member(body, "thinking")) {
    if (!t->is_object()) wrong_type("thinking", "an object", *t);
    const std::string type = required_string(*t, "type", "thinking.type");
    if (type != "enabled" && type != "disabled")
      bad_request("thinking.type", "invalid_value", "'thinking.type' must be enabled or disabled");
    c["chat_template_kwargs"] = {{"enable_thinking", type == "enabled"}};
  }

  json msgs = json::array();
  if (const json* sys = member(body, "system"))
    msgs.push_back({{"role", "system"}, {"content", text_only(*sys, "system", "'system'")}});
  const json& in = required_member(body, "messages", "messages");
  if (!in.is_array()) wrong_type("messages", "an array", in);
  if (in.empty())
    bad_request("messages", "empty_array", "'messages' must contain at least one message");
  for (size_t i = 0; i < in.size(); ++i)
    convert_message(in[i], at("messages", i), msgs, r.has_media);
  c["messages"] = std::move(msgs);

  json tools = json::array();
  if (const json* t = member(body, "tools")) {
    if (!t->is_array()) wrong_type("tools", "an array", *t);
    for (size_t i = 0; i < t->size(); ++i) tools.push_back(function_tool((*t)[i], at("tools", i)));
  }
  if (!tools.empty()) c["tools"] = tools;
  if (const json* tc = member(body, "tool_choice")) {
    if (!tc->is_object()) wrong_type("tool_choice", "an object", *tc);
    const std::string type = required_string(*tc, "type", "tool_choice.type");
    if (type == "auto" || type == "none")
      c["tool_choice"] = type;
    else if (type == "any")
      c["tool_choice"] = "required";
    else if (type == "tool")
      c["tool_choice"] = {
          {"type", "function"},
          {"function", {{"name", required_string(*tc, "name", "tool_choice.name")}}}};
    else
      bad_request("tool_choice.type", "invalid_value",
                  "'tool_choice.type' must be auto, any, tool or none");
    if (const json* d = member(*tc, "disable_parallel_tool_use")) {
      if (!d->is_boolean()) wrong_type("tool_choice.disable_parallel_tool_use", "a boolean", *d);
      c["parallel_tool_calls"] = !d->get<bool>();
    }
  }
  return r;
}

std::string stop_reason(const std::string& tool_finish_reason, const std::string& stop_sequence) {
  if (tool_finish_reason == "tool_calls") return "tool_use";
  if (tool_finish_reason == "length") return "max_tokens";
  return stop_sequence.empty() ? "end_turn" : "stop_sequence";
}

json error_json(const ApiError& e) {
  std::string type = e.type();
  switch (e.status()) {
    case 401:
      type = "authentication_error";
      break;
    case 403:
      type = "permission_error";
      break;
    case 404:
      type = "not_found_error";
      break;
    case 413:
      type = "request_too_large";
      break;
    case 429:
      type = "rate_limit_error";
      break;
    case 503:
      type = "overloaded_error";
      break;
    default:
      if (e.status() >= 500) type = "api_error";
  }
  // The shape has no `param`; the field goes in front of the message, as Anthropic's own errors
  // name it ("messages.0.content: ...").
  std::string message = e.what();
  if (!e.param().empty() && message.find(e.param()) == std::string::npos)
    message = e.param() + ": " + message;
  return {{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

namespace {

json stop_sequence_json(const std::string& stop_reason, const std::string& stop_sequence) {
  return stop_reason == "stop_sequence" ? json(stop_sequence) : json(nullptr);
}

// Anthropic counts prompt tokens read from a cache apart from input_tokens: input_tokens +
// cache_read_input_tokens + cache_creation_input_tokens is the whole prompt. Prefix reuse here is
// automatic, so nothing is ever written to a cache on request (cache_creation_input_tokens 0).
json usage(int64_t input_tokens, int64_t output_tokens, int64_t cached_tokens) {
  return {{"input_tokens", input_tokens - cached_tokens},
          {"cache_creation_input_tokens", 0},
          {"cache_read_input_tokens", cached_tokens},
          {"output_tokens", output_tokens}};
}

json tool_use_block(const ParsedToolCall& c, const std::string& id, bool streamed) {
  // A streamed block starts with empty input and receives its JSON as input_json_delta.
  return {{"type", "tool_use"},
          {"id", id},
          {"name", c.name},
          {"input", streamed ? json::object() : json::parse(c.arguments.dump())}};
}

}  // namespace

json message_json(const ResponseMeta& m, const ParsedOutput& parsed, const std::string& stop_reason,
                  int64_t input_tokens, int64_t output_tokens,
                  const std::function<std::string()>& new_tool_use_id,
                  const std::string& stop_sequence, int64_t cached_tokens) {
  json content = json::array();
  if (parsed.reasoning)
    content.push_back({{"type", "thinking"}, {"thinking", *parsed.reasoning}, {"signature", ""}});
  if (parsed.content) content.push_back({{"type", "text"}, {"text", *parsed.content}});
  for (const ParsedToolCall& c : parsed.tool_calls)
    content.push_back(tool_use_block(c, new_tool_use_id(), false));
  return {{"id", m.id},
          {"type", "message"},
          {"role", "assistant"},
          {"model", m.model},
          {"content", std::move(content)},
          {"stop_reason", stop_reason},
          {"stop_sequence", stop_sequence_json(stop_reason, stop_sequence)},
          {"usage", usage(input_tokens, output_tokens, cached_tokens)}};
}

std::string EventStream::begin(int64_t input_tokens, int64_t cached_tokens) {
  const json message = {
      {"id", meta_.id},           {"type", "message"},
      {"role", "assistant"},      {"model", meta_.model},
      {"content", json::array()}, {"stop_reason", nullptr},
      {"stop_sequence", nullptr}, {"usage", usage(input_tokens, 0, cached_tokens)}};
  return named_event("message_start", {{"type", "message_start"}, {"message", message}}) +
         named_event("ping", {{"type", "ping"}});
}

std::string EventStream::close() {
  if (open_ == Block::kNone) return {};
  open_ = Block::kNone;
  return named_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
}

std::string EventStream::open(Block kind) {
  if (open_ == kind) return {};
  std::string out = close();
  open_ = kind;
  ++index_;
  const json block = kind == Block::kThinking
                         ? json{{"type", "thinking"}, {"thinking", ""}, {"signature", ""}}
                         : json{{"type", "text"}, {"text", ""}};
  return out + named_event(
                   "content_block_start",
                   {{"type", "content_block_start"}, {"index", index_}, {"content_block", block}});
}

std::string EventStream::delta(const OutputDelta& d) {
  std::string out;
  auto block_delta = [&](const json& delta) {
    out += named_event("content_block_delta",
                       {{"type", "content_block_delta"}, {"index", index_}, {"delta", delta}});
  };
  if (!d.reasoning.empty()) {
    out += open(Block::kThinking);
    block_delta({{"type", "thinking_delta"}, {"thinking", d.reasoning}});
  }
  if (!d.content.empty()) {
    out += open(Block::kText);
    block_delta({{"type", "text_delta"}, {"text", d.content}});
  }
  for (const ParsedToolCall& c : d.tool_calls) {
    out += close();
    ++index_;
    out += named_event("content_block_start",
                       {{"type", "content_block_start"},
                        {"index", index_},
                        {"content_block", tool_use_block(c, new_tool_use_id_(), true)}});
    block_delta({{"type", "input_json_delta"}, {"partial_json", c.arguments.dump()}});
    out += named_event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
  }
  return out;
}

std::string EventStream::end(const std::string& stop_reason, int64_t output_tokens,
                             const std::string& stop_sequence) {
  return close() +
         named_event("message_delta",
                     {{"type", "message_delta"},
                      {"delta",
                       {{"stop_reason", stop_reason},
                        {"stop_sequence", stop_sequence_json(stop_reason, stop_sequence)}}},
                      {"usage", {{"output_tokens", output_tokens}}}}) +
         named_event("message_stop", {{"type", "message_stop"}});
}

std::string EventStream::error(const ApiError& e) {
  return named_event("error", messages::error_json(e));
}

}  // namespace gemstage::server::messages
