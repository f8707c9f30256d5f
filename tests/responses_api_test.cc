// The OpenAI Responses side of `serve` (server/responses_api.h) on plain JSON and canned model
// output: input items render exactly as the same conversation sent to chat completions, bad
// requests name the Responses field, and a reply with reasoning, text and function calls becomes
// output items, whole or as numbered stream events that add up to the same items.
#include "server/responses_api.h"

#include <gtest/gtest.h>

#include "tokenizer/chat_format.h"
#include "tokenizer/tokenizer.h"

using namespace gemstage;
using namespace gemstage::server;
using nlohmann::json;

namespace {

responses::NewId counter_ids() {
  auto n = std::make_shared<int>(0);
  return [n](const char* prefix) { return prefix + std::to_string((*n)++); };
}

std::string error_param(const json& body) {
  try {
    responses::to_chat_body(body);
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status(), 400);
    return e.param();
  }
  return "(accepted)";
}

const std::string kRaw =
    "<|channel>thought\nHm.<channel|>Let me check. <|tool_call>call:get_weather{city:<|\"|>"
    "Paris<|\"|>}<tool_call|>";

}  // namespace

TEST(ResponsesApi, InputItemsRenderLikeChatCompletions) {
  const json body = json::parse(R"({"model":"m","instructions":"Be brief.","max_output_tokens":32,
    "input":[{"role":"user","content":[{"type":"input_text","text":"Weather in Paris?"}]},
      {"type":"reasoning","summary":[],"content":[{"type":"reasoning_text","text":"Need it."}]},
      {"type":"function_call","call_id":"call_1","name":"get_weather","arguments":"{\"city\":\"Paris\"}"},
      {"type":"function_call","call_id":"call_2","name":"get_weather","arguments":"{\"city\":\"Oslo\"}"},
      {"type":"function_call_output","call_id":"call_1","output":"15C sunny"},
      {"type":"function_call_output","call_id":"call_2","output":[{"type":"input_text","text":"2C"}]}],
    "tools":[{"type":"function","name":"get_weather","description":"Get the weather.",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}],
    "tool_choice":"required","reasoning":{"effort":"high"}})");
  const responses::Request r = responses::to_chat_body(body);
  EXPECT_FALSE(r.has_media);
  EXPECT_EQ(r.chat_body["max_tokens"], 32);
  EXPECT_EQ(r.chat_body["tool_choice"], "required");
  EXPECT_EQ(r.echo["instructions"], "Be brief.");
  EXPECT_EQ(r.echo["reasoning"]["effort"], "high");
  const ToolRequest tr = parse_tool_request(r.chat_body);
  EXPECT_EQ(tr.enable_thinking, std::optional<bool>(true));

  const json openai = json::parse(R"({"messages":[{"role":"system","content":"Be brief."},
      {"role":"user","content":[{"type":"text","text":"Weather in Paris?"}]},
      {"role":"assistant","content":null,"reasoning_content":"Need it.","tool_calls":[
        {"id":"call_1","type":"function","function":{"name":"get_weather",
         "arguments":"{\"city\":\"Paris\"}"}},
        {"id":"call_2","type":"function","function":{"name":"get_weather",
         "arguments":"{\"city\":\"Oslo\"}"}}]},
      {"role":"tool","tool_call_id":"call_1","content":"15C sunny"},
      {"role":"tool","tool_call_id":"call_2","content":"2C"}],
    "tools":[{"type":"function","function":{"name":"get_weather","description":"Get the weather.",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}]})");
  const ToolRequest want = parse_tool_request(openai);
  ConversationOptions opt;
  opt.enable_thinking = true;
  const std::string prompt = render_conversation(tr.messages, tr.tools, opt);
  EXPECT_EQ(prompt, render_conversation(want.messages, want.tools, opt));
  EXPECT_NE(prompt.find("call:get_weather{city:<|\"|>Oslo<|\"|>}"), std::string::npos) << prompt;
}

TEST(ResponsesApi, BadRequestsNameTheResponsesField) {
  EXPECT_EQ(error_param(json::object()), "input");
  EXPECT_EQ(error_param({{"input", json::array()}}), "input");
  EXPECT_EQ(error_param({{"input", "x"}, {"previous_response_id", "resp_1"}}),
            "previous_response_id");
  EXPECT_EQ(error_param({{"input", json::parse(R"([{"role":"tool","content":"x"}])")}}),
            "input[0].role");
  EXPECT_EQ(error_param({{"input", json::parse(R"([{"type":"item_reference","id":"x"}])")}}),
            "input[0].type");
  EXPECT_EQ(error_param({{"input", json::parse(R"([{"role":"user","content":[
              {"type":"input_image","file_id":"file_1"}]}])")}}),
            "input[0].content[0].file_id");
  EXPECT_EQ(error_param({{"input", json::parse(R"([{"role":"user","content":[
              {"type":"input_file","file_data":"x"}]}])")}}),
            "input[0].content[0].type");
  EXPECT_EQ(error_param({{"input", json::parse(R"([{"type":"function_call","name":"f"}])")}}),
            "input[0].call_id");
  EXPECT_EQ(error_param({{"input", "x"}, {"tools", json::parse(R"([{"type":"file_search"}])")}}),
            "tools[0].type");
  EXPECT_EQ(error_param({{"input", "x"}, {"text", {{"format", {{"type", "json_schema"}}}}}}),
            "text.format.schema");
  EXPECT_EQ(
      error_param(
          {{"input", "x"},
           {"text",
            {{"format",
              {{"type", "json_schema"}, {"schema", {{"type", "string"}, {"pattern", "a"}}}}}}}}),
      "text.format.schema");
  EXPECT_EQ(error_param({{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}),
            "text.format.type");
}

TEST(ResponsesApi, ReplyBecomesOutputItems) {
  const ParsedOutput parsed = parse_model_output(kRaw);
  const std::string finish = tool_finish_reason(parsed, kRaw, true);
  const json r = responses::response_json({"resp_1", "tiny", 7}, json::object(), parsed, finish, 10,
                                          20, counter_ids());
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["status"], "completed");
  EXPECT_EQ(r["incomplete_details"], nullptr);
  EXPECT_EQ(r["usage"]["total_tokens"], 30);
  ASSERT_EQ(r["output"].size(), 3u);
  EXPECT_EQ(r["output"][0]["type"], "reasoning");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Hm.");
  EXPECT_EQ(r["output"][1]["content"][0]["type"], "output_text");
  EXPECT_EQ(r["output"][1]["content"][0]["text"], "Let me check.");
  EXPECT_EQ(r["output"][2]["type"], "function_call");
  EXPECT_EQ(r["output"][2]["name"], "get_weather");
  EXPECT_EQ(json::parse(r["output"][2]["arguments"].get<std::string>()),
            json::parse(R"({"city":"Paris"})"));
  const json cut =
      responses::response_json({"resp_2", "tiny", 7}, json::object(), parse_model_output("Hel"),
                               "length", 1, 1, counter_ids());
  EXPECT_EQ(cut["status"], "incomplete");
  EXPECT_EQ(cut["incomplete_details"]["reason"], "max_output_tokens");
}

TEST(ResponsesApi, StreamedEventsAreNumberedAndAddUpToTheItems) {
  responses::EventStream es({"resp_1", "tiny", 7}, json::object(), counter_ids());
  OutputStreamParser sp;
  std::string text = es.begin();
  for (size_t k = 0; k < kRaw.size(); k += 3) text += es.delta(sp.feed(kRaw.substr(k, 3)));
  text += es.delta(sp.finish());
  text += es.end("tool_calls", 10, 20);
  std::vector<json> events;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find("\n\n", at);
    ASSERT_NE(end, std::string::npos);
    const std::string ev = text.substr(at, end - at);
    const size_t nl = ev.find("\ndata: ");
    events.push_back(json::parse(ev.substr(nl + 7)));
    EXPECT_EQ(ev.substr(7, nl - 7), events.back()["type"]);
    at = end + 2;
  }
  // Rebuild the output the way a client does, checking numbering and nesting on the way.
  json output = json::array();
  for (size_t i = 0; i < events.size(); ++i) {
    const json& e = events[i];
    EXPECT_EQ(e["sequence_number"], i);
    const std::string type = e["type"];
    if (type == "response.output_item.added") {
      EXPECT_EQ(e["output_index"], output.size());
      output.push_back(e["item"]);
    } else if (type == "response.content_part.added") {
      json& item = output[e["output_index"].get<size_t>()];
      if (item["type"] == "message") item["content"].push_back(e["part"]);
    } else if (type == "response.output_text.delta") {
      json& part = output[e["output_index"].get<size_t>()]["content"][0];
      part["text"] = part["text"].get<std::string>() + e["delta"].get<std::string>();
    } else if (type == "response.function_call_arguments.delta") {
      json& item = output[e["output_index"].get<size_t>()];
      item["arguments"] = item["arguments"].get<std::string>() + e["delta"].get<std::string>();
    } else if (type == "response.output_item.done") {
      json& item = output[e["output_index"].get<size_t>()];
      if (item["type"] == "message") {
        EXPECT_EQ(item["content"][0]["text"], e["item"]["content"][0]["text"]);
      }
      if (item["type"] == "function_call") {
        EXPECT_EQ(item["arguments"], e["item"]["arguments"]);
      }
      item = e["item"];
    }
  }
  EXPECT_EQ(events.front()["type"], "response.created");
  EXPECT_EQ(events.back()["type"], "response.completed");
  EXPECT_EQ(events.back()["response"]["output"], output);
  const json whole =
      responses::response_json({"resp_1", "tiny", 7}, json::object(), parse_model_output(kRaw),
                               "tool_calls", 10, 20, counter_ids());
  ASSERT_EQ(output.size(), whole["output"].size());
  for (size_t i = 0; i < output.size(); ++i) {
    EXPECT_EQ(output[i]["type"], whole["output"][i]["type"]);
    EXPECT_EQ(output[i].value("arguments", json()), whole["output"][i].value("arguments", json()));
    EXPECT_EQ(output[i].value("content", json()), whole["output"][i].value("content", json()));
  }
  EXPECT_EQ(events.back()["response"]["usage"], whole["usage"]);
}

TEST(ResponsesApi, LogprobsAreAskedForWithIncludeOrTopLogprobs) {
  const json inc = {{"input", "x"}, {"include", {"message.output_text.logprobs"}}};
  json c = responses::to_chat_body(inc).chat_body;
  EXPECT_EQ(c["logprobs"], true);
  EXPECT_FALSE(c.contains("top_logprobs"));
  EXPECT_EQ(parse_generation_fields(c).sampling.top_logprobs, 0);
  json with_top = inc;
  with_top["top_logprobs"] = 3;
  const responses::Request r = responses::to_chat_body(with_top);
  EXPECT_EQ(parse_generation_fields(r.chat_body).sampling.top_logprobs, 3);
  EXPECT_EQ(r.echo["top_logprobs"], 3);
  // Other include values name items this server never makes: nothing is asked for.
  c = responses::to_chat_body({{"input", "x"}, {"include", {"reasoning.encrypted_content"}}})
          .chat_body;
  EXPECT_FALSE(c.contains("logprobs"));
  EXPECT_FALSE(parse_generation_fields(c).sampling.top_logprobs.has_value());
  EXPECT_EQ(error_param({{"input", "x"}, {"include", "message.output_text.logprobs"}}), "include");
  EXPECT_EQ(error_param({{"input", "x"}, {"include", {1}}}), "include[0]");
  EXPECT_EQ(error_param({{"input", "x"}, {"top_logprobs", 21}}), "top_logprobs");
  EXPECT_EQ(error_param({{"input", "x"}, {"top_logprobs", "2"}}), "top_logprobs");
}

TEST(ResponsesApi, OnlyTheReplyTextsTokensGetLogprobs) {
  const Tokenizer tok =
      Tokenizer::from_model_dir(std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/tokenizer_full");
  auto reply_text = [&](const std::string& prefix, const std::string& generated) {
    ReplyTextTokens filter(tok, prefix);
    std::vector<TokenLogprob> tokens;
    for (int32_t id : tok.encode(generated, false, true)) tokens.push_back({id, -0.5f, {}});
    std::string text;
    for (const json& e : filter.take_logprobs(tokens)) {
      EXPECT_EQ(e["logprob"], -0.5);
      text += e["token"].get<std::string>();
    }
    return text;
  };
  EXPECT_EQ(reply_text("", kRaw), "Let me check. ");
  EXPECT_EQ(reply_text("", "Plain answer."), "Plain answer.");
  // The prompt opened the thought channel: the reply text starts after it closes.
  EXPECT_EQ(reply_text("<|channel>thought\n", "Hm.<channel|>Sunny."), "Sunny.");
}

TEST(ResponsesApi, LogprobsRideOnTheOutputTextWholeAndStreamed) {
  const json lp = json::parse(R"([{"token":"Let","logprob":-0.25,"bytes":[76,101,116],
      "top_logprobs":[]}])");
  const json r =
      responses::response_json({"resp_1", "tiny", 7}, json::object(), parse_model_output(kRaw),
                               "tool_calls", 10, 20, counter_ids(), lp);
  EXPECT_EQ(r["output"][1]["content"][0]["logprobs"], lp);

  responses::EventStream es({"resp_1", "tiny", 7}, json::object(), counter_ids());
  OutputDelta first, rest;
  first.content = "Let";
  rest.content = " me";
  const json lp2 = json::parse(R"([{"token":" me","logprob":-1.5,"bytes":[32,109,101],
      "top_logprobs":[]}])");
  // One statement per call: each event takes the next sequence number.
  std::string text = es.begin();
  text += es.delta(first, lp);
  text += es.delta(rest, lp2);
  // Logprobs of tokens whose text the parser dropped still arrive, on an empty delta.
  text += es.delta(OutputDelta{}, lp2);
  text += es.end("stop", 1, 3);
  json deltas = json::array(), done_part;
  for (size_t at = 0; at < text.size();) {
    const size_t end = text.find("\n\n", at);
    ASSERT_NE(end, std::string::npos);
    const size_t data = text.find("\ndata: ", at) + 7;
    const json e = json::parse(text.substr(data, end - data));
    if (e["type"] == "response.output_text.delta")
      for (const json& x : e["logprobs"]) deltas.push_back(x);
    if (e["type"] == "response.content_part.done") done_part = e["part"];
    at = end + 2;
  }
  const json want = {lp[0], lp2[0], lp2[0]};
  EXPECT_EQ(deltas, want);
  EXPECT_EQ(done_part["text"], "Let me");
  EXPECT_EQ(done_part["logprobs"], want);
}

TEST(ResponsesApi, AFunctionCallOutputMayHoldImages) {
  const json body = json::parse(R"({"input":[
      {"role":"user","content":"Take a screenshot."},
      {"type":"function_call","call_id":"call_1","name":"shot","arguments":"{}"},
      {"type":"function_call_output","call_id":"call_1","output":[
        {"type":"input_text","text":"Here it is."},
        {"type":"input_image","image_url":"data:image/png;base64,AAAA"}]}]})");
  const responses::Request r = responses::to_chat_body(body);
  EXPECT_TRUE(r.has_media);
  const json& tool = r.chat_body["messages"][2];
  EXPECT_EQ(tool["role"], "tool");
  EXPECT_EQ(tool["content"], json::parse(R"([{"type":"text","text":"Here it is."},
      {"type":"image_url","image_url":{"url":"data:image/png;base64,AAAA"}}])"));
  json bad = body;
  bad["input"][2]["output"][1] = {{"type", "input_file"}};
  EXPECT_EQ(error_param(bad), "input[2].output[1]");
}
