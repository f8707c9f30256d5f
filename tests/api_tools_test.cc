// The tool-calling side of /v1/chat/completions on canned model output: request validation,
// the reply message, and the streamed chunks (a random-weight model rarely writes a call, so the
// mapping is tested on the fixture outputs instead).
#include <gtest/gtest.h>

#include "server/api.h"
#include "tokenizer/chat_format.h"

using namespace gemstage;
using namespace gemstage::server;
using nlohmann::json;

namespace {

const json kWeatherTool = json::parse(R"({"type":"function","function":{"name":"get_weather",
  "description":"Get the current weather for a city.","parameters":{"type":"object",
  "properties":{"city":{"type":"string","description":"City name, e.g. Paris"}},"required":["city"]}}})");

std::function<std::string()> counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n] { return "call_" + std::to_string((*n)++); };
}

std::string error_param(const json& body) {
  try {
    parse_tool_request(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "(accepted)";
}

}  // namespace

TEST(ApiTools, RequestRoundTripRendersLikeTheTemplate) {
  // An OpenAI client's second request of a tool round trip: arguments as a JSON string.
  const json body = {{"messages", json::parse(R"([{"role":"user","content":"Weather in Paris?"},
         {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
           "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
         {"role":"tool","tool_call_id":"call_1","content":"15C sunny"}])")},
                     {"tools", json::array({kWeatherTool})},
                     {"tool_choice", "auto"}};
  const ToolRequest r = parse_tool_request(body);
  EXPECT_EQ(r.tool_choice, "auto");
  EXPECT_TRUE(r.parallel_tool_calls);
  const std::string prompt = render_conversation(r.messages, r.tools, {});
  EXPECT_EQ(prompt.substr(prompt.find("<|turn>model\n")),
            "<|turn>model\n<|tool_call>call:get_weather{city:<|\"|>Paris<|\"|>}<tool_call|>"
            "<|tool_response>response:get_weather{value:<|\"|>15C sunny<|\"|>}<tool_response|>");
}

TEST(ApiTools, BadToolRequestsNameThePart) {
  const json user = json::array({{{"role", "user"}, {"content", "x"}}});
  EXPECT_EQ(error_param({{"messages", user}, {"tools", json::array({{{"type", "retrieval"}}})}}),
            "tools[0].type");
  EXPECT_EQ(
      error_param({{"messages", user},
                   {"tools", json::array({kWeatherTool})},
                   {"tool_choice", {{"type", "function"}, {"function", {{"name", "nope"}}}}}}),
      "tool_choice.function.name");
  EXPECT_EQ(error_param({{"messages", user}, {"tool_choice", "required"}}), "tool_choice");
  EXPECT_EQ(error_param({{"messages", user}, {"tool_choice", "sometimes"}}), "tool_choice");
  const json bad_args = json::parse(R"([{"role":"assistant","content":null,"tool_calls":[
      {"id":"c","type":"function","function":{"name":"f","arguments":"{not json"}}]}])");
  EXPECT_EQ(error_param({{"messages", bad_args}}), "messages[0].tool_calls[0].function.arguments");
  const json list_args = json::parse(R"([{"role":"assistant","content":null,"tool_calls":[
      {"id":"c","type":"function","function":{"name":"f","arguments":"[1]"}}]}])");
  EXPECT_EQ(error_param({{"messages", list_args}}), "messages[0].tool_calls[0].function.arguments");
  EXPECT_EQ(error_param({{"messages", json::parse(R"([{"role":"robot","content":"x"}])")}}),
            "messages[0].role");
  const ToolRequest named = parse_tool_request(
      {{"messages", user},
       {"tools", json::array({kWeatherTool})},
       {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}},
       {"parallel_tool_calls", false}});
  EXPECT_EQ(named.tool_choice, "function");
  EXPECT_EQ(named.tool_choice_name, "get_weather");
  EXPECT_FALSE(named.parallel_tool_calls);
}

TEST(ApiTools, ReplyCarriesToolCallsReasoningAndFinishReason) {
  const ResponseMeta meta{"chatcmpl-x", "tiny", 1};
  const json j = chat_tool_completion_json(
      meta,
      "<|channel>thought\nNeed weather.<channel|><|tool_call>call:get_weather{city:<|\"|>Paris"
      "<|\"|>}<tool_call|><|tool_call>call:get_weather{city:<|\"|>Oslo<|\"|>}<tool_call|>",
      true, 10, 20, counter_ids());
  const json& choice = j["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  EXPECT_EQ(choice["message"]["content"], nullptr);
  EXPECT_EQ(choice["message"]["reasoning_content"], "Need weather.");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u);
  EXPECT_EQ(choice["message"]["tool_calls"][1]["id"], "call_1");
  EXPECT_EQ(choice["message"]["tool_calls"][1]["function"]["name"], "get_weather");
  EXPECT_EQ(
      json::parse(choice["message"]["tool_calls"][1]["function"]["arguments"].get<std::string>()),
      json::parse(R"({"city":"Oslo"})"));
  // A malformed call is content, never an error; a cut-off call is content with "length".
  const json bad = chat_tool_completion_json(meta, "<|tool_call>call:f{a:True}<tool_call|>", true,
                                             1, 1, counter_ids());
  EXPECT_EQ(bad["choices"][0]["message"]["content"], "<|tool_call>call:f{a:True}<tool_call|>");
  EXPECT_EQ(bad["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(bad["choices"][0]["message"].contains("tool_calls"));
  const json cut = chat_tool_completion_json(meta, "Checking <|tool_call>call:f{a:<|\"|>x", false,
                                             1, 1, counter_ids());
  EXPECT_EQ(cut["choices"][0]["finish_reason"], "length");
}

TEST(ApiTools, StreamedChunksAddUpToTheReply) {
  const ResponseMeta meta{"chatcmpl-x", "tiny", 1};
  const std::string out =
      "<|channel>thought\nHm.<channel|>Let me check. <|tool_call>call:get_weather{city:<|\"|>"
      "Paris<|\"|>}<tool_call|>";
  OutputStreamParser sp;
  std::vector<json> chunks;
  auto ids = counter_ids();
  for (size_t k = 0; k < out.size(); k += 3) {
    auto c = chat_delta_chunks(meta, sp.feed(out.substr(k, 3)), ids);
    chunks.insert(chunks.end(), c.begin(), c.end());
  }
  auto c = chat_delta_chunks(meta, sp.finish(), ids);
  chunks.insert(chunks.end(), c.begin(), c.end());
  std::string content, reasoning;
  json calls = json::array();
  for (const json& ch : chunks) {
    const json& d = ch["choices"][0]["delta"];
    EXPECT_EQ(ch["object"], "chat.completion.chunk");
    if (d.contains("content")) content += d["content"].get<std::string>();
    if (d.contains("reasoning_content")) reasoning += d["reasoning_content"].get<std::string>();
    if (d.contains("tool_calls")) calls.push_back(d["tool_calls"][0]);
  }
  EXPECT_EQ(content, "Let me check.");
  EXPECT_EQ(reasoning, "Hm.");
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["function"]["arguments"], "{\"city\":\"Paris\"}");
}
