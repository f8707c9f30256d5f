#include "server/responses_api.h"

#include "runtime/json_constraint.h"

namespace gemstage::server::responses {

using nlohmann::json;

namespace {

std::string at(const std::string& param, size_t i) {
  return param + "[" + std::to_string(i) + "]";
}

// A message item's content as chat-completions parts (text and image_url).
json content_parts(const json& content, const std::string& param, const std::string& role,
                   bool& has_media) {
  if (content.is_string()) return content;
  if (!content.is_array()) wrong_type(param, "a string or an array of content parts", content);
  json parts = json::array();
  for (size_t i = 0; i < content.size(); ++i) {
    const json& part = content[i];
    const std::string pp = at(param, i);
    if (!part.is_object()) wrong_type(pp, "an object", part);
    const std::string type = required_string(part, "type", pp + ".type");
    if (type == "input_text" || type == "output_text") {
      parts.push_back({{"type", "text"}, {"text", required_string(part, "text", pp + ".text")}});
    } else if (type == "refusal") {
      parts.push_back(
          {{"type", "text"}, {"text", required_string(part, "refusal", pp + ".refusal")}});
    } else if (type == "input_image") {
      if (role != "user")
        bad_request(pp + ".type", "invalid_value", "images are only accepted in user messages");
      if (member(part, "file_id"))
        bad_request(pp + ".file_id", "unsupported_value",
                    "file ids are not supported (this server stores no files); send the image "
                    "inline as image_url \"data:image/png;base64,...\"");
      parts.push_back(
          {{"type", "image_url"},
           {"image_url", {{"url", required_string(part, "image_url", pp + ".image_url")}}}});
      has_media = true;
    } else if (type == "input_audio") {  // as chat completions takes it: {data, format}
      if (role != "user")
        bad_request(pp + ".type", "invalid_value", "audio is only accepted in user messages");
      parts.push_back({{"type", "input_audio"},
                       {"input_audio", required_member(part, "input_audio", pp + ".input_audio")}});
      has_media = true;
    } else {
      bad_request(pp + ".type", "unsupported_value",
                  "content part type '" + type +
                      "' is not supported; use input_text, output_text, input_image or "
                      "input_audio");
    }
  }
  return parts;
}

// A function_call_output's output as a tool message's content: a string, input_text parts
// joined, or with input_image parts the chat-completions parts (text and image_url).
json output_content_of(const json& output, const std::string& param, bool& has_media) {
  if (output.is_string()) return output;
  if (!output.is_array())
    wrong_type(param, "a string or an array of input_text / input_image parts", output);
  std::string text;
  bool images = false;
  for (size_t i = 0; i < output.size(); ++i) {
    const json& part = output[i];
    const std::string type = part.is_object() ? part.value("type", "") : "";
    if (type == "input_image") {
      images = true;
    } else if (type == "input_text") {
      text += required_string(part, "text", at(param, i) + ".text");
    } else {
      bad_request(at(param, i), "unsupported_value",
                  "a function_call_output may hold only input_text and input_image parts here");
    }
  }
  if (!images) return text;
  return content_parts(output, param, "user", has_media);
}

std::string reasoning_text_of(const json& item, const std::string& param) {
  std::string text;
  for (const char* key : {"content", "summary"}) {
    const json* parts = member(item, key);
    if (!parts) continue;
    if (!parts->is_array()) wrong_type(param + "." + key, "an array", *parts);
    for (const json& p : *parts)
      if (p.is_object() && p.contains("text") && p["text"].is_string()) {
        if (!text.empty()) text += "\n";
        text += p["text"].get<std::string>();
      }
    if (!text.empty()) break;  // the full reasoning when given, else its summary
  }
  return text;
}

json function_tool(const json& tool, const std::string& param) {
  if (!tool.is_object()) wrong_type(param, "an object", tool);
  const std::string type = required_string(tool, "type", param + ".type");
  if (type != "function")
    bad_request(
        param + ".type", "unsupported_value",
        "tool type '" + type + "' is not available here (no hosted tools); declare function tools");
  const std::string name = required_string(tool, "name", param + ".name");
  json fn = {{"name", name}};
  if (const json* d = member(tool, "description")) fn["description"] = *d;
  if (const json* p = member(tool, "parameters")) fn["parameters"] = *p;
  return {{"type", "function"}, {"function", std::move(fn)}};
}

void convert_input(const json& input, json& msgs, bool& has_media) {
  if (input.is_string()) {
    msgs.push_back({{"role", "user"}, {"content", input}});
    return;
  }
  if (!input.is_array()) wrong_type("input", "a string or an array of input items", input);
  if (input.empty()) bad_request("input", "empty_array", "'input' must contain at least one item");
  std::string reasoning;  // a reasoning item belongs to the assistant turn after it
  // The items of one assistant turn (its text message and function calls) arrive one by one;
  // they join the turn before them unless that turn already has text and this is text too.
  auto assistant_turn = [&](bool for_content) -> json& {
    const bool join = !msgs.empty() && msgs.back()["role"] == "assistant" &&
                      (!for_content || msgs.back()["content"].is_null());
    if (!join) msgs.push_back({{"role", "assistant"}, {"content", nullptr}});
    json& m = msgs.back();
    if (!reasoning.empty()) {
      m["reasoning_content"] = reasoning;
      reasoning.clear();
    }
    return m;
  };
  for (size_t i = 0; i < input.size(); ++i) {
    const json& item = input[i];
    const std::string p = at("input", i);
    if (!item.is_object()) wrong_type(p, "an object", item);
    const json* type_member = member(item, "type");
    if (type_member && !type_member->is_string()) wrong_type(p + ".type", "a string", *type_member);
    const std::string type = type_member ? type_member->get<std::string>() : "message";
    if (type == "message") {
      const std::string role = required_string(item, "role", p + ".role");
      if (role != "user" && role != "assistant" && role != "system" && role != "developer")
        bad_request(
            p + ".role", "invalid_value",
            "role '" + role + "' is not supported; use user, assistant, system or developer");
      json content = content_parts(required_member(item, "content", p + ".content"), p + ".content",
                                   role, has_media);
      if (role == "assistant") {
        json& m = assistant_turn(true);
        m["content"] = std::move(content);
      } else {
        msgs.push_back({{"role", role == "developer" ? "system" : role}, {"content", content}});
      }
    } else if (type == "function_call") {
      const json* args = member(item, "arguments");
      if (args && !args->is_string()) wrong_type(p + ".arguments", "a string (JSON text)", *args);
      json& m = assistant_turn(false);
      if (!m.contains("tool_calls")) m["tool_calls"] = json::array();
      m["tool_calls"].push_back({{"id", required_string(item, "call_id", p + ".call_id")},
                                 {"type", "function"},
                                 {"function",
                                  {{"name", required_string(item, "name", p + ".name")},
                                   {"arguments", args ? *args : json("{}")}}}});
    } else if (type == "function_call_output") {
      msgs.push_back({{"role", "tool"},
                      {"tool_call_id", required_string(item, "call_id", p + ".call_id")},
                      {"content", output_content_of(required_member(item, "output", p + ".output"),
                                                    p + ".output", has_media)}});
    } else if (type == "reasoning") {
      reasoning = reasoning_text_of(item, p);
    } else {
      bad_request(p + ".type", "unsupported_value",
                  "input item type '" + type +
                      "' is not supported; use message, function_call, function_call_output or "
                      "reasoning");
    }
  }
}

}  // namespace

Request to_chat_body(const json& body) {
  Request r;
  json& c = r.chat_body;
  c = json::object();
  json& echo = r.echo;
  echo = json::object();
  for (const char* unsupported : {"previous_response_id", "conversation"})
    if (member(body, unsupported))
      bad_request(unsupported, "unsupported_value",
                  std::string("'") + unsupported +
                      "' is not supported: this server keeps no conversations; send the whole "
                      "conversation as 'input'");
  if (const json* model = member(body, "model")) {
    if (!model->is_string()) wrong_type("model", "a string", *model);
    c["model"] = *model;
  }
  if (const json* n = member(body, "max_output_tokens")) {
    if (!n->is_number_integer()) wrong_type("max_output_tokens", "an integer", *n);
    c["max_tokens"] = *n;
  }
  echo["max_output_tokens"] = body.value("max_output_tokens", json());
  // llama.cpp's speculative keys go through as sent: the chat parser checks them, naming the
  // field (a nested "speculative" object is passed on so that it is refused there too).
  for (const char* key : {"temperature", "top_p", "top_k", "seed", "parallel_tool_calls",
                          "speculative.n_max", "speculative.n_min", "speculative"})
    if (const json* v = member(body, key)) c[key] = *v;
  echo["temperature"] = body.value("temperature", json(1.0));
  echo["top_p"] = body.value("top_p", json(1.0));
  echo["parallel_tool_calls"] = body.value("parallel_tool_calls", json(true));
  // Logprobs of the output_text's tokens: include "message.output_text.logprobs", with
  // top_logprobs (0-20) alternatives each (top_logprobs alone asks for them too).
  bool want_logprobs = false;
  if (const json* inc = member(body, "include")) {
    if (!inc->is_array()) wrong_type("include", "an array of strings", *inc);
    for (size_t i = 0; i < inc->size(); ++i) {
      if (!(*inc)[i].is_string()) wrong_type(at("include", i), "a string", (*inc)[i]);
      // Other values name items this server never produces (file search results, encrypted
      // reasoning, ...): there is nothing to include.
      want_logprobs = want_logprobs || (*inc)[i] == "message.output_text.logprobs";
    }
  }
  if (const json* top = member(body, "top_logprobs")) {
    if (!top->is_number_integer() || top->get<int64_t>() < 0 || top->get<int64_t>() > 20)
      bad_request("top_logprobs", "invalid_value",
                  "'top_logprobs' must be an integer from 0 to 20");
    c["top_logprobs"] = *top;
    want_logprobs = true;
  }
  if (want_logprobs) c["logprobs"] = true;
  echo["top_logprobs"] = body.value("top_logprobs", json(0));
  if (const json* s = member(body, "stream")) {
    if (!s->is_boolean()) wrong_type("stream", "a boolean", *s);
    r.stream = s->get<bool>();
  }
  if (const json* t = member(body, "text")) {
    if (!t->is_object()) wrong_type("text", "an object", *t);
    if (const json* f = member(*t, "format")) {
      if (!f->is_object()) wrong_type("text.format", "an object", *f);
      const std::string type = required_string(*f, "type", "text.format.type");
      if (type == "json_object") {
        c["response_format"] = {{"type", "json_object"}};
      } else if (type == "json_schema") {
        const json& schema = required_member(*f, "schema", "text.format.schema");
        try {
          JsonGrammar::from_schema(schema);  // refused here, naming the Responses field
        } catch (const Error& e) {
          bad_request("text.format.schema", "unsupported_schema", e.what());
        }
        c["response_format"] = {
            {"type", "json_schema"},
            {"json_schema", {{"name", f->value("name", "output")}, {"schema", schema}}}};
      } else if (type != "text") {
        bad_request("text.format.type", "invalid_value",
                    "text.format.type must be text, json_object or json_schema");
      }
    }
  }
  echo["text"] = {{"format", {{"type", "text"}}}};
  if (c.contains("response_format")) echo["text"]["format"] = body["text"]["format"];
  echo["reasoning"] = {{"effort", nullptr}, {"summary", nullptr}};
  if (const json* reasoning = member(body, "reasoning")) {
    if (!reasoning->is_object()) wrong_type("reasoning", "an object", *reasoning);
    if (const json* effort = member(*reasoning, "effort")) {
      if (!effort->is_string()) wrong_type("reasoning.effort", "a string", *effort);
      // Gemma 4's thinking is on or off; any effort above minimal turns it on.
      const std::string e = effort->get<std::string>();
      c["chat_template_kwargs"] = {{"enable_thinking", e != "none" && e != "minimal"}};
      echo["reasoning"]["effort"] = e;
    }
  }

  json msgs = json::array();
  echo["instructions"] = nullptr;
  if (const json* ins = member(body, "instructions")) {
    if (!ins->is_string()) wrong_type("instructions", "a string", *ins);
    msgs.push_back({{"role", "system"}, {"content", *ins}});
    echo["instructions"] = *ins;
  }
  convert_input(required_member(body, "input", "input"), msgs, r.has_media);
  c["messages"] = std::move(msgs);

  json tools = json::array();
  if (const json* t = member(body, "tools")) {
    if (!t->is_array()) wrong_type("tools", "an array", *t);
    for (size_t i = 0; i < t->size(); ++i) tools.push_back(function_tool((*t)[i], at("tools", i)));
  }
  if (!tools.empty()) c["tools"] = tools;
  echo["tools"] = body.value("tools", json::array());
  echo["tool_choice"] = body.value("tool_choice", json("auto"));
  if (const json* tc = member(body, "tool_choice")) {
    if (tc->is_string()) {
      c["tool_choice"] = *tc;
    } else if (tc->is_object()) {
      const std::string type = required_string(*tc, "type", "tool_choice.type");
      if (type != "function")
        bad_request("tool_choice.type", "unsupported_value",
                    "tool_choice must be auto, none, required or {\"type\": \"function\", "
                    "\"name\": ...}");
      c["tool_choice"] = {
          {"type", "function"},
          {"function", {{"name", required_string(*tc, "name", "tool_choice.name")}}}};
    } else {
      wrong_type("tool_choice", "a string or an object", *tc);
    }
  }
  return r;
}

namespace {

json output_text_part(const std::string& text, const json& logprobs = json::array()) {
  return {{"type", "output_text"},
          {"text", text},
          {"annotations", json::array()},
          {"logprobs", logprobs}};
}

json reasoning_item(const std::string& id, const std::string& text) {
  json content = json::array();
  if (!text.empty()) content.push_back({{"type", "reasoning_text"}, {"text", text}});
  return {{"id", id}, {"type", "reasoning"}, {"summary", json::array()}, {"content", content}};
}

json message_item(const std::string& id, const std::string& status, json content) {
  return {{"id", id},
          {"type", "message"},
          {"status", status},
          {"role", "assistant"},
          {"content", std::move(content)}};
}

json function_call_item(const std::string& id, const std::string& call_id, const ParsedToolCall& c,
                        const std::string& status, bool with_arguments) {
  return {{"id", id},         {"type", "function_call"},
          {"status", status}, {"call_id", call_id},
          {"name", c.name},   {"arguments", with_arguments ? c.arguments.dump() : std::string()}};
}

json envelope(const ResponseMeta& m, const json& echo, const std::string& status, json output,
              const json& usage) {
  json r = echo;
  r["id"] = m.id;
  r["object"] = "response";
  r["created_at"] = m.created;
  r["model"] = m.model;
  r["status"] = status;
  r["error"] = nullptr;
  r["incomplete_details"] =
      status == "incomplete" ? json{{"reason", "max_output_tokens"}} : json(nullptr);
  r["output"] = std::move(output);
  r["usage"] = usage;
  r["store"] = false;
  r["metadata"] = json::object();
  return r;
}

json usage_json(int64_t input_tokens, int64_t output_tokens, int64_t cached_tokens) {
  if (input_tokens < 0) return nullptr;
  return {{"input_tokens", input_tokens},
          {"input_tokens_details", {{"cached_tokens", cached_tokens}}},
          {"output_tokens", output_tokens},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", input_tokens + output_tokens}};
}

std::string status_of(const std::string& tool_finish_reason) {
  return tool_finish_reason == "length" ? "incomplete" : "completed";
}

}  // namespace

json response_json(const ResponseMeta& m, const json& echo, const ParsedOutput& parsed,
                   const std::string& tool_finish_reason, int64_t input_tokens,
                   int64_t output_tokens, const NewId& new_id, const json& text_logprobs,
                   int64_t cached_tokens) {
  json output = json::array();
  if (parsed.reasoning) output.push_back(reasoning_item(new_id("rs_"), *parsed.reasoning));
  // A reply cut by max_output_tokens leaves its message incomplete, as the response is.
  if (parsed.content)
    output.push_back(message_item(new_id("msg_"), status_of(tool_finish_reason),
                                  json::array({output_text_part(*parsed.content, text_logprobs)})));
  for (const ParsedToolCall& c : parsed.tool_calls)
    output.push_back(function_call_item(new_id("fc_"), new_id("call_"), c, "completed", true));
  return envelope(m, echo, status_of(tool_finish_reason), std::move(output),
                  usage_json(input_tokens, output_tokens, cached_tokens));
}

std::string EventStream::event(const std::string& type, json data) {
  data["type"] = type;
  data["sequence_number"] = sequence_++;
  return sse_named_event(type, data);
}

std::string EventStream::begin() {
  const json r = envelope(meta_, echo_, "in_progress", json::array(), nullptr);
  // One statement per event: each takes the next sequence number, so their order is fixed.
  std::string out = event("response.created", {{"response", r}});
  out += event("response.in_progress", {{"response", r}});
  return out;
}

std::string EventStream::open(Item kind) {
  if (open_ == kind) return {};
  std::string out = close();
  open_ = kind;
  open_text_.clear();
  open_logprobs_ = json::array();
  const bool reasoning = kind == Item::kReasoning;
  const std::string id = new_id_(reasoning ? "rs_" : "msg_");
  const json item =
      reasoning ? reasoning_item(id, "") : message_item(id, "in_progress", json::array());
  // Held as the open item until it closes; output_ gets it then.
  output_.push_back(item);
  const size_t index = output_.size() - 1;
  out += event("response.output_item.added", {{"output_index", index}, {"item", item}});
  const json part =
      reasoning ? json{{"type", "reasoning_text"}, {"text", ""}} : output_text_part("");
  out += event("response.content_part.added",
               {{"item_id", id}, {"output_index", index}, {"content_index", 0}, {"part", part}});
  return out;
}

std::string EventStream::close() {
  if (open_ == Item::kNone) return {};
  const bool reasoning = open_ == Item::kReasoning;
  open_ = Item::kNone;
  const size_t index = output_.size() - 1;
  json& item = output_.back();
  const std::string id = item["id"];
  const json part = reasoning ? json{{"type", "reasoning_text"}, {"text", open_text_}}
                              : output_text_part(open_text_, open_logprobs_);
  const json where = {{"item_id", id}, {"output_index", index}, {"content_index", 0}};
  json text_done = where;
  text_done["text"] = open_text_;
  json part_done = where;
  part_done["part"] = part;
  std::string out =
      event(reasoning ? "response.reasoning_text.done" : "response.output_text.done", text_done);
  out += event("response.content_part.done", part_done);
  item = reasoning ? reasoning_item(id, open_text_)
                   : message_item(id, message_status_, json::array({part}));
  return out + event("response.output_item.done", {{"output_index", index}, {"item", item}});
}

std::string EventStream::delta(const OutputDelta& d, const json& text_logprobs) {
  std::string out;
  auto text_delta = [&](const char* type, const std::string& text) {
    open_text_ += text;
    json data = {{"item_id", output_.back()["id"]},
                 {"output_index", output_.size() - 1},
                 {"content_index", 0},
                 {"delta", text}};
    if (open_ == Item::kMessage) {
      data["logprobs"] = text_logprobs.is_array() ? text_logprobs : json::array();
      for (const json& e : data["logprobs"]) open_logprobs_.push_back(e);
    }
    out += event(type, std::move(data));
  };
  if (!d.reasoning.empty()) {
    out += open(Item::kReasoning);
    text_delta("response.reasoning_text.delta", d.reasoning);
  }
  if (!d.content.empty()) {
    out += open(Item::kMessage);
    text_delta("response.output_text.delta", d.content);
  } else if (open_ == Item::kMessage && !text_logprobs.empty()) {
    // Tokens whose text the parser dropped (whitespace trimmed at the end): their logprobs
    // still belong to the output_text, as they do in the whole response.
    text_delta("response.output_text.delta", "");
  }
  for (const ParsedToolCall& c : d.tool_calls) {
    out += close();
    const std::string id = new_id_("fc_"), call_id = new_id_("call_");
    output_.push_back(function_call_item(id, call_id, c, "in_progress", false));
    const size_t index = output_.size() - 1;
    const std::string args = c.arguments.dump();
    out += event("response.output_item.added", {{"output_index", index}, {"item", output_.back()}});
    out += event("response.function_call_arguments.delta",
                 {{"item_id", id}, {"output_index", index}, {"delta", args}});
    out += event("response.function_call_arguments.done",
                 {{"item_id", id}, {"output_index", index}, {"name", c.name}, {"arguments", args}});
    output_.back() = function_call_item(id, call_id, c, "completed", true);
    out += event("response.output_item.done", {{"output_index", index}, {"item", output_.back()}});
  }
  return out;
}

std::string EventStream::end(const std::string& tool_finish_reason, int64_t input_tokens,
                             int64_t output_tokens, int64_t cached_tokens) {
  const std::string status = status_of(tool_finish_reason);
  message_status_ = status;  // the message still open is the one the limit cut
  std::string out = close();
  json output = json::array();
  for (const json& item : output_) output.push_back(item);
  const json r = envelope(meta_, echo_, status, std::move(output),
                          usage_json(input_tokens, output_tokens, cached_tokens));
  return out + event(status == "completed" ? "response.completed" : "response.incomplete",
                     {{"response", r}});
}

std::string EventStream::error(const ApiError& e) {
  return event("error", {{"code", e.code().empty() ? json(nullptr) : json(e.code())},
                         {"message", e.what()},
                         {"param", e.param().empty() ? json(nullptr) : json(e.param())}});
}

}  // namespace gemstage::server::responses
