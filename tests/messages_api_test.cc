// The Anthropic Messages side of `serve` (server/messages_api.h) on plain JSON and canned model
// output: a Messages conversation renders exactly as the same conversation sent to chat
// completions, bad requests name the Messages field, and a reply with reasoning, text and tool
// calls becomes thinking / text / tool_use blocks, whole or as the event stream.
#include "server/messages_api.h"

#include <gtest/gtest.h>

#include "tokenizer/chat_format.h"

using namespace gemstage;
using namespace gemstage::server;
using nlohmann::json;

namespace {

std::function<std::string()> counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n] { return "toolu_" + std::to_string((*n)++); };
}

std::string error_param(const json& body) {
  try {
    messages::to_chat_body(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "(accepted)";
}

// The events of a framed stream, as (name, data) pairs, checking the framing on the way.
std::vector<std::pair<std::string, json>> parse_events(const std::string& text) {
  std::vector<std::pair<std::string, json>> out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t end = text.find("\n\n", at);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    const std::string ev = text.substr(at, end - at);
    EXPECT_EQ(ev.rfind("event: ", 0), 0u) << ev;
    const size_t nl = ev.find("\ndata: ");
    const std::string name = ev.substr(7, nl - 7);
    const json data = json::parse(ev.substr(nl + 7));
    EXPECT_EQ(data["type"], name) << "the event name is the data's type";
    out.emplace_back(name, data);
    at = end + 2;
  }
  return out;
}

}  // namespace

TEST(MessagesApi, ToolRoundTripRendersLikeChatCompletions) {
  const json body = json::parse(R"({"model":"m","max_tokens":64,"system":"Be brief.",
    "messages":[{"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":[{"type":"thinking","thinking":"Need it.","signature":"s"},
        {"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Paris"}}]},
      {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1",
        "content":[{"type":"text","text":"15C sunny"}]}]}],
    "tools":[{"name":"get_weather","description":"Get the weather.",
      "input_schema":{"type":"object","properties":{"city":{"type":"string"}}}}],
    "tool_choice":{"type":"any","disable_parallel_tool_use":true},
    "stop_sequences":["END"],"thinking":{"type":"enabled","budget_tokens":2048}})");
  const messages::Request r = messages::to_chat_body(body);
  EXPECT_FALSE(r.has_media);
  const json& c = r.chat_body;
  EXPECT_EQ(c["max_tokens"], 64);
  EXPECT_EQ(c["stop"], json::array({"END"}));
  EXPECT_EQ(c["tool_choice"], "required");
  EXPECT_EQ(c["parallel_tool_calls"], false);
  const ToolRequest tr = parse_tool_request(c);
  EXPECT_EQ(tr.enable_thinking, std::optional<bool>(true));

  const json openai = json::parse(R"({"messages":[{"role":"system","content":"Be brief."},
      {"role":"user","content":"Weather in Paris?"},
      {"role":"assistant","content":null,"reasoning_content":"Need it.","tool_calls":[
        {"id":"toolu_1","type":"function","function":{"name":"get_weather",
         "arguments":"{\"city\":\"Paris\"}"}}]},
      {"role":"tool","tool_call_id":"toolu_1","content":"15C sunny"}],
    "tools":[{"type":"function","function":{"name":"get_weather","description":"Get the weather.",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]})");
  const ToolRequest want = parse_tool_request(openai);
  ConversationOptions opt;
  opt.enable_thinking = true;
  const std::string prompt = render_conversation(tr.messages, tr.tools, opt);
  EXPECT_EQ(prompt, render_conversation(want.messages, want.tools, opt));
  EXPECT_NE(prompt.find("<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
                        "<|tool_response>response:get_weather{value:<|\"|>15C sunny<|\"|>}"),
            std::string::npos)
      << prompt;
}

TEST(MessagesApi, ImagesBecomeDataUrls) {
  const json body = json::parse(R"({"max_tokens":8,"messages":[{"role":"user","content":[
      {"type":"image","source":{"type":"base64","media_type":"image/png","data":"AAAA"}},
      {"type":"text","text":"What is this?"}]}]})");
  const messages::Request r = messages::to_chat_body(body);
  EXPECT_TRUE(r.has_media);
  EXPECT_EQ(r.chat_body["messages"][0]["content"][0]["image_url"]["url"],
            "data:image/png;base64,AAAA");
  // With tools too: the chat body keeps both, and the tool path decodes the image.
  json with_tools = body;
  with_tools["tools"] = json::parse(R"([{"name":"f","input_schema":{"type":"object"}}])");
  const messages::Request t = messages::to_chat_body(with_tools);
  EXPECT_EQ(t.chat_body["tools"][0]["function"]["name"], "f");
  EXPECT_EQ(t.chat_body["messages"][0]["content"][0]["image_url"]["url"],
            "data:image/png;base64,AAAA");
  // A url source becomes the image_url part that the chat parser fetches (--allow-remote-media)
  // or refuses.
  const messages::Request u = messages::to_chat_body(json::parse(R"({"max_tokens": 8,
      "messages": [{"role": "user", "content": [{"type": "image",
      "source": {"type": "url", "url": "https://example.com/x.png"}}]}]})"));
  EXPECT_EQ(u.chat_body["messages"][0]["content"][0]["image_url"]["url"],
            "https://example.com/x.png");
}

TEST(MessagesApi, BadRequestsNameTheMessagesField) {
  const json user = json::parse(R"([{"role":"user","content":"x"}])");
  EXPECT_EQ(error_param({{"messages", user}}), "max_tokens");
  EXPECT_EQ(error_param({{"max_tokens", "8"}, {"messages", user}}), "max_tokens");
  EXPECT_EQ(error_param({{"max_tokens", 8}, {"messages", json::array()}}), "messages");
  EXPECT_EQ(error_param({{"max_tokens", 8},
                         {"messages", json::parse(R"([{"role":"system","content":"x"}])")}}),
            "messages[0].role");
  EXPECT_EQ(error_param({{"max_tokens", 8},
                         {"messages", json::parse(R"([{"role":"user","content":[{"type":"text",
                           "text":"a"},{"type":"image","source":{"type":"file",
                           "file_id":"f1"}}]}])")}}),
            "messages[0].content[1].source.type");
  EXPECT_EQ(
      error_param({{"max_tokens", 8}, {"messages", json::parse(R"([{"role":"assistant","content":[
                           {"type":"tool_result","tool_use_id":"t","content":"x"}]}])")}}),
      "messages[0].content[0].type");
  EXPECT_EQ(
      error_param(
          {{"max_tokens", 8}, {"messages", user}, {"tools", json::parse(R"([{"name":"f"}])")}}),
      "tools[0].input_schema");
  EXPECT_EQ(error_param({{"max_tokens", 8},
                         {"messages", user},
                         {"tools", json::parse(R"([{"type":"web_search_20250305","name":"s"}])")}}),
            "tools[0].type");
  EXPECT_EQ(error_param({{"max_tokens", 8}, {"messages", user}, {"tool_choice", {{"type", "x"}}}}),
            "tool_choice.type");
  EXPECT_EQ(error_param({{"max_tokens", 8}, {"messages", user}, {"thinking", {{"type", "x"}}}}),
            "thinking.type");
  // The error body carries the field in its message (the shape has no param).
  const json e = messages::error_json(
      ApiError(400, "'x' is required", "invalid_request_error", "messages[0].content"));
  EXPECT_EQ(e["type"], "error");
  EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  EXPECT_EQ(e["error"]["message"], "messages[0].content: 'x' is required");
  EXPECT_EQ(messages::error_json(ApiError(401, "no key"))["error"]["type"], "authentication_error");
  EXPECT_EQ(messages::error_json(ApiError(503, "busy", "server_error"))["error"]["type"],
            "overloaded_error");
}

TEST(MessagesApi, ReplyBecomesThinkingTextAndToolUseBlocks) {
  const std::string raw =
      "<|channel>thought\nHm.<channel|>Let me check. <|tool_call>call:get_weather{city:<|\"|>"
      "Paris<|\"|>}<tool_call|>";
  const ParsedOutput parsed = parse_model_output(raw);
  const std::string stop = messages::stop_reason(tool_finish_reason(parsed, raw, true));
  EXPECT_EQ(stop, "tool_use");
  const json m = messages::message_json({"msg_1", "tiny", 1}, parsed, stop, 10, 20, counter_ids());
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["stop_reason"], "tool_use");
  EXPECT_EQ(
      m["usage"],
      json::parse(
          R"({"input_tokens":10,"output_tokens":20,"cache_creation_input_tokens":0,"cache_read_input_tokens":0})"));
  ASSERT_EQ(m["content"].size(), 3u);
  EXPECT_EQ(m["content"][0]["type"], "thinking");
  EXPECT_EQ(m["content"][0]["thinking"], "Hm.");
  EXPECT_EQ(m["content"][1], json::parse(R"({"type":"text","text":"Let me check."})"));
  EXPECT_EQ(m["content"][2], json::parse(R"({"type":"tool_use","id":"toolu_0",
      "name":"get_weather","input":{"city":"Paris"}})"));
  EXPECT_EQ(messages::stop_reason("length"), "max_tokens");
  EXPECT_EQ(messages::stop_reason("stop"), "end_turn");
}

TEST(MessagesApi, StreamedEventsAddUpToTheReply) {
  const std::string raw =
      "<|channel>thought\nHm.<channel|>Let me check. <|tool_call>call:get_weather{city:<|\"|>"
      "Paris<|\"|>}<tool_call|>";
  messages::EventStream es({"msg_1", "tiny", 1}, counter_ids());
  OutputStreamParser sp;
  std::string text = es.begin(10);
  for (size_t k = 0; k < raw.size(); k += 3) text += es.delta(sp.feed(raw.substr(k, 3)));
  text += es.delta(sp.finish());
  text += es.end("tool_use", 20);
  const auto events = parse_events(text);
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(events.front().first, "message_start");
  EXPECT_EQ(events.front().second["message"]["usage"]["input_tokens"], 10);
  EXPECT_EQ(events.back().first, "message_stop");
  // Rebuild the blocks the way a client does; every block opens, then closes, indices in order.
  json blocks = json::array();
  int open = -1;
  std::string stop;
  for (const auto& [name, d] : events) {
    if (name == "content_block_start") {
      EXPECT_EQ(open, -1) << "a block opened inside another";
      open = d["index"];
      EXPECT_EQ(open, static_cast<int>(blocks.size()));
      blocks.push_back(d["content_block"]);
    } else if (name == "content_block_delta") {
      EXPECT_EQ(d["index"], open);
      json& b = blocks[open];
      const json& delta = d["delta"];
      if (delta["type"] == "text_delta")
        b["text"] = b["text"].get<std::string>() + delta["text"].get<std::string>();
      if (delta["type"] == "thinking_delta")
        b["thinking"] = b["thinking"].get<std::string>() + delta["thinking"].get<std::string>();
      if (delta["type"] == "input_json_delta")
        b["input"] = json::parse(delta["partial_json"].get<std::string>());
    } else if (name == "content_block_stop") {
      EXPECT_EQ(d["index"], open);
      open = -1;
    } else if (name == "message_delta") {
      stop = d["delta"]["stop_reason"];
      EXPECT_EQ(d["usage"]["output_tokens"], 20);
    }
  }
  EXPECT_EQ(open, -1);
  EXPECT_EQ(stop, "tool_use");
  const json whole = messages::message_json({"msg_1", "tiny", 1}, parse_model_output(raw), stop, 10,
                                            20, counter_ids());
  for (json& b : blocks) b.erase("signature");
  json want = whole["content"];
  for (json& b : want) b.erase("signature");
  EXPECT_EQ(blocks, want);
  EXPECT_EQ(
      parse_events(messages::EventStream::error(ApiError(503, "shutting down", "server_error")))
          .front()
          .second["error"]["type"],
      "overloaded_error");
}

TEST(MessagesApi, AMatchedStopSequenceIsReportedWithItsString) {
  // The generation stopped on one of the request's stop_sequences (the text is cut before it).
  EXPECT_EQ(messages::stop_reason("stop", "END"), "stop_sequence");
  EXPECT_EQ(messages::stop_reason("stop", ""), "end_turn");
  // A call or the token limit says more than the string that happened to follow.
  EXPECT_EQ(messages::stop_reason("tool_calls", "END"), "tool_use");
  EXPECT_EQ(messages::stop_reason("length", "END"), "max_tokens");
  const ParsedOutput parsed = parse_model_output("Counting: 1, 2,");
  const json m = messages::message_json({"msg_1", "tiny", 1}, parsed, "stop_sequence", 3, 4,
                                        counter_ids(), "END");
  EXPECT_EQ(m["stop_reason"], "stop_sequence");
  EXPECT_EQ(m["stop_sequence"], "END");
  EXPECT_TRUE(messages::message_json({"msg_1", "tiny", 1}, parsed, "end_turn", 3, 4, counter_ids(),
                                     "")["stop_sequence"]
                  .is_null());
  messages::EventStream es({"msg_1", "tiny", 1}, counter_ids());
  const auto events = parse_events(es.begin(3) + es.end("stop_sequence", 4, "END"));
  ASSERT_GE(events.size(), 2u);
  const json& delta = events[events.size() - 2].second;
  EXPECT_EQ(delta["type"], "message_delta");
  EXPECT_EQ(delta["delta"],
            json::parse(R"({"stop_reason":"stop_sequence","stop_sequence":"END"})"));
}

TEST(MessagesApi, AToolResultMayHoldImages) {
  const json body = json::parse(R"({"max_tokens":8,"messages":[
      {"role":"user","content":"Take a screenshot."},
      {"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"shot","input":{}}]},
      {"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","is_error":false,
        "content":[{"type":"text","text":"Here it is."},
                   {"type":"image","source":{"type":"base64","media_type":"image/png",
                                             "data":"AAAA"}}]}]}]})");
  const messages::Request r = messages::to_chat_body(body);
  EXPECT_TRUE(r.has_media);
  const json& tool = r.chat_body["messages"][2];
  EXPECT_EQ(tool["role"], "tool");
  EXPECT_EQ(tool["tool_call_id"], "toolu_1");
  EXPECT_EQ(tool["content"], json::parse(R"([{"type":"text","text":"Here it is."},
      {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}])"));
  json bad = body;
  bad["messages"][2]["content"][0]["content"][1] = {{"type", "document"}};
  EXPECT_EQ(error_param(bad), "messages[2].content[0].content[1].type");
}
