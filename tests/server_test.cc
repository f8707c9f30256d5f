// `gemstage serve`: the request parser and error shapes (every refusal), then the server itself
// in-process on the tiny fixture model: health, models, chat and completions (streamed or not,
// greedy output equal to `generate`'s), every HTTP error with its status and OpenAI error shape,
// the API key, the body limit, clients that vanish or stall, the queue order and shutdown.
#include "server/server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <future>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "server/api.h"
#include "server_test_util.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::server;
using namespace gemstage::testing;
using json = nlohmann::json;

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string data_url(const std::string& path, const std::string& mime) {
  const std::string bytes = slurp(path);
  return "data:" + mime + ";base64," +
         encode_base64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
}
const std::string kPng = std::string(GEMSTAGE_FIXTURES) + "/image/decode/rgb_interlaced.png";
const std::string kJpeg = std::string(GEMSTAGE_FIXTURES) + "/image/decode/rgb420.jpg";

// The ApiError fn throws; fails the test when it throws nothing.
std::optional<ApiError> api_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ApiError& e) {
    return e;
  }
  return std::nullopt;
}

json user(const json& content) {
  return {{"role", "user"}, {"content", content}};
}
json chat_body(const json& extra = json::object()) {
  json b = {{"model", "m"}, {"messages", json::array({user("Hello")})}};
  b.update(extra);
  return b;
}

// ------------------------------------------------------------------------------------------
// The parser.

TEST(ServerApi, ParsesAMinimalChat) {
  const ChatRequest r = parse_chat_request(chat_body());
  EXPECT_EQ(r.model, "m");
  ASSERT_EQ(r.messages.size(), 1u);
  EXPECT_EQ(r.messages[0].role, "user");
  ASSERT_EQ(r.messages[0].parts.size(), 1u);
  EXPECT_EQ(r.messages[0].parts[0].text, "Hello");
  EXPECT_FALSE(r.messages[0].parts[0].image);
  EXPECT_FALSE(r.stream);
  EXPECT_FALSE(r.sampling.max_tokens);
  EXPECT_FALSE(r.sampling.temperature);
  EXPECT_FALSE(r.sampling.stop);
}

TEST(ServerApi, ParsesRolesPartsAndImages) {
  const json body = {
      {"messages",
       json::array(
           {{{"role", "developer"}, {"content", "Be brief."}},
            user(json::array(
                {{{"type", "text"}, {"text", "What is this?"}},
                 {{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}},
                 {{"type", "image_url"}, {"image_url", data_url(kJpeg, "image/jpeg")}}})),
            {{"role", "assistant"}, {"content", "A picture."}, {"name", "bot"}},
            {{"role", "system"}, {"content", json::array({{{"type", "text"}, {"text", "x"}}})}}})},
      {"user", "ignored"},
      {"some_future_field", {1, 2}}};
  const ChatRequest r = parse_chat_request(body);
  ASSERT_EQ(r.messages.size(), 4u);
  EXPECT_EQ(r.messages[0].role, "developer");
  ASSERT_EQ(r.messages[1].parts.size(), 3u);
  EXPECT_EQ(r.messages[1].parts[0].text, "What is this?");
  ASSERT_TRUE(r.messages[1].parts[1].image);
  EXPECT_EQ(r.messages[1].parts[1].image->width, 23);
  EXPECT_EQ(r.messages[1].parts[1].image->height, 17);
  ASSERT_TRUE(r.messages[1].parts[2].image);  // the bare-string image_url form
  EXPECT_EQ(r.messages[1].parts[2].image->rgb.size(), 23u * 17u * 3u);
  EXPECT_EQ(r.messages[2].role, "assistant");
  EXPECT_EQ(r.messages[3].parts[0].text, "x");
}

TEST(ServerApi, ParsesVideoUrlParts) {
  const std::string clip = std::string(GEMSTAGE_FIXTURES) + "/video/vp9_30fps_80x80.webm";
  const auto video = [](const std::string& url) {
    return json{{"type", "video_url"}, {"video_url", {{"url", url}}}};
  };
  RequestLimits limits;
  limits.video_frames = 8;
  const ChatRequest r = parse_chat_request(
      {{"messages",
        {user({video(data_url(clip, "video/webm")), {{"type", "text"}, {"text", "?"}}})}}},
      limits);
  ASSERT_EQ(r.messages[0].parts.size(), 2u);
  const ChatInputPart& part = r.messages[0].parts[0];
  ASSERT_TRUE(part.video_source);
  ASSERT_TRUE(part.video_source->bytes);
  EXPECT_EQ(part.video_source->bytes->size(), slurp(clip).size());
  EXPECT_EQ(part.video_source->num_frames, 8);
  EXPECT_NE(part.video_source->what.find("messages[0].content[0].video_url.url"),
            std::string::npos);

  auto refused = [&](const json& v, const RequestLimits& l) {
    const auto e = api_error_of([&] {
      parse_chat_request({{"messages", {user(json::array({v}))}}}, l);
    });
    EXPECT_TRUE(e) << v.dump().substr(0, 200);
    return e ? std::string(e->what()) + " [" + e->code() + "]" : std::string();
  };
  EXPECT_NE(refused(video("https://example.com/a.mp4"), {}).find("not fetched"), std::string::npos);
  EXPECT_NE(refused(video("data:text/plain;base64,AAAA"), {}).find("media type"),
            std::string::npos);
  EXPECT_NE(refused(video("data:video/mp4;base64,***"), {}).find("invalid_base64"),
            std::string::npos);
  EXPECT_NE(refused(video("file://" + clip), {}).find("--allowed-local-media-path"),
            std::string::npos);
  // file:// URLs under the allowed directory only, symlinks and ".." resolved first.
  RequestLimits local;
  local.allowed_local_media_path = std::string(GEMSTAGE_FIXTURES) + "/video";
  const ChatRequest f =
      parse_chat_request({{"messages", {user(json::array({video("file://" + clip)}))}}}, local);
  ASSERT_TRUE(f.messages[0].parts[0].video_source);
  EXPECT_EQ(f.messages[0].parts[0].video_source->path, clip);
  EXPECT_NE(
      refused(video("file://" + std::string(GEMSTAGE_FIXTURES) + "/video/../image/x.png"), local)
          .find("not a file under"),
      std::string::npos);
  EXPECT_NE(refused(video("file://" + std::string(GEMSTAGE_FIXTURES) + "/video/none.mp4"), local)
                .find("not a readable file"),
            std::string::npos);
}

TEST(ServerApi, ParsesSamplingAndStreamingFields) {
  ChatRequest r = parse_chat_request(chat_body({{"max_tokens", 7},
                                                {"max_completion_tokens", 9},
                                                {"temperature", 0},
                                                {"top_p", 0.5},
                                                {"top_k", 3},
                                                {"min_p", 0.1},
                                                {"seed", -1},
                                                {"stop", "END"},
                                                {"n", 1},
                                                {"stream", true},
                                                {"stream_options", {{"include_usage", true}}},
                                                {"frequency_penalty", 0},
                                                {"presence_penalty", 0},
                                                {"logprobs", false},
                                                {"tools", json::array()},
                                                {"tool_choice", "none"},
                                                {"response_format", {{"type", "text"}}},
                                                {"repeat_penalty", 1.25},
                                                {"repeat_last_n", -1},
                                                // llama.cpp's web UI's defaults: samplers off
                                                {"mirostat", 0},
                                                {"typical_p", 1},
                                                {"dry_multiplier", 0},
                                                {"xtc_probability", 0},
                                                {"top_n_sigma", -1}}));
  EXPECT_FLOAT_EQ(*r.sampling.repeat_penalty, 1.25f);
  EXPECT_EQ(r.sampling.repeat_last_n, -1);
  EXPECT_EQ(r.sampling.max_tokens, 9);  // max_completion_tokens wins
  EXPECT_EQ(r.sampling.temperature, 0.0f);
  EXPECT_FLOAT_EQ(*r.sampling.top_p, 0.5f);
  EXPECT_EQ(r.sampling.top_k, 3);
  EXPECT_FLOAT_EQ(*r.sampling.min_p, 0.1f);
  EXPECT_EQ(r.sampling.seed, ~uint64_t{0});
  EXPECT_EQ(r.sampling.stop, std::vector<std::string>{"END"});
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);

  r = parse_chat_request(chat_body({{"max_tokens", 5},
                                    {"stop", {"a", "bc"}},
                                    {"seed", 18446744073709551615ull},
                                    {"temperature", nullptr},
                                    {"stream_options", nullptr}}));
  EXPECT_EQ(r.sampling.max_tokens, 5);
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(r.sampling.seed, ~uint64_t{0});
  EXPECT_FALSE(r.sampling.temperature);  // null: the server's default
  EXPECT_FALSE(r.include_usage);
}

struct BadCase {
  json body;
  std::string param, code, message_part;
};

void expect_refused(const std::function<void(const json&)>& parse, const BadCase& c) {
  SCOPED_TRACE(c.body.dump().substr(0, 300));
  const auto e = api_error_of([&] { parse(c.body); });
  ASSERT_TRUE(e) << "accepted";
  EXPECT_EQ(e->status(), 400);
  EXPECT_EQ(e->type(), "invalid_request_error");
  EXPECT_EQ(e->param(), c.param) << e->what();
  EXPECT_EQ(e->code(), c.code) << e->what();
  EXPECT_NE(std::string(e->what()).find(c.message_part), std::string::npos) << e->what();
}

TEST(ServerApi, RefusesEveryInvalidChatBody) {
  const json img = {{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}};
  auto image_part = [](const std::string& url) {
    return user(json::array({{{"type", "image_url"}, {"image_url", {{"url", url}}}}}));
  };
  const std::string junk =
      "data:image/png;base64," + encode_base64(reinterpret_cast<const uint8_t*>("junk!"), 5);
  json twenty = json::array();
  for (int i = 0; i < 17; ++i) twenty.push_back(std::string("s").append(std::to_string(i)));
  const std::vector<BadCase> cases = {
      {{{"model", "m"}}, "messages", "missing_required_parameter", "'messages' is required"},
      {{{"messages", "hi"}}, "messages", "invalid_type", "must be an array, not a string"},
      {{{"messages", json::array()}}, "messages", "empty_array", "at least one message"},
      {{{"messages", {1}}}, "messages[0]", "invalid_type", "must be an object"},
      {{{"messages", {{{"content", "x"}}}}},
       "messages[0].role",
       "missing_required_parameter",
       "'role' is required"},
      {{{"messages", {{{"role", 3}, {"content", "x"}}}}},
       "messages[0].role",
       "invalid_type",
       "must be a string, not an integer"},
      {{{"messages", {{{"role", "wizard"}, {"content", "x"}}}}},
       "messages[0].role",
       "invalid_value",
       "role 'wizard' is not supported"},
      {{{"messages", {{{"role", "tool"}, {"content", "x"}}}}},
       "messages[0].role",
       "invalid_value",
       "tool messages are not supported"},
      {{{"messages", {user("x"), {{"role", "developer"}, {"content", "x"}}}}},
       "messages[1].role",
       "invalid_value",
       "only accepted first"},
      {{{"messages", {{{"role", "user"}}}}},
       "messages[0].content",
       "missing_required_parameter",
       "'content' is required"},
      {{{"messages", {{{"role", "user"}, {"content", nullptr}}}}},
       "messages[0].content",
       "missing_required_parameter",
       "'content' is required"},
      {{{"messages", {user(42)}}},
       "messages[0].content",
       "invalid_type",
       "a string or an array of content parts"},
      {{{"messages", {user({"x"})}}},
       "messages[0].content[0]",
       "invalid_type",
       "must be an object"},
      {{{"messages", {user({{{"text", "x"}}})}}},
       "messages[0].content[0].type",
       "missing_required_parameter",
       "'type' is required"},
      {{{"messages", {user({{{"type", "input_audio"}}})}}},
       "messages[0].content[0].input_audio",
       "missing_required_parameter",
       "'input_audio' is required"},
      {{{"messages", {user({{{"type", "video_url"}}})}}},
       "messages[0].content[0].video_url",
       "missing_required_parameter",
       "'video_url' is required"},
      {{{"messages", {user({{{"type", "input_video"}}})}}},
       "messages[0].content[0].type",
       "invalid_value",
       "'input_video' is not supported"},
      {{{"messages", {user({{{"type", "text"}}})}}},
       "messages[0].content[0].text",
       "missing_required_parameter",
       "'text' is required"},
      {{{"messages", {user({{{"type", "text"}, {"text", 1}}})}}},
       "messages[0].content[0].text",
       "invalid_type",
       "must be a string"},
      {{{"messages", {{{"role", "assistant"}, {"content", {img}}}}}},
       "messages[0].content[0]",
       "invalid_value",
       "only accepted in user and tool messages"},
      {{{"messages", {user({{{"type", "image_url"}}})}}},
       "messages[0].content[0].image_url",
       "missing_required_parameter",
       "'image_url' is required"},
      {{{"messages", {user({{{"type", "image_url"}, {"image_url", {{"detail", "low"}}}}})}}},
       "messages[0].content[0].image_url.url",
       "missing_required_parameter",
       "is required"},
      {{{"messages", {user({{{"type", "image_url"}, {"image_url", {{"url", 5}}}}})}}},
       "messages[0].content[0].image_url.url",
       "invalid_type",
       "must be a string"},
      {{{"messages", {image_part("https://example.com/cat.png")}}},
       "messages[0].content[0].image_url.url",
       "unsupported_image_url",
       "remote image URLs are not fetched"},
      {{{"messages", {image_part("http://127.0.0.1/cat.png")}}},
       "messages[0].content[0].image_url.url",
       "unsupported_image_url",
       "remote image URLs are not fetched"},
      {{{"messages", {image_part("file:///etc/passwd")}}},
       "messages[0].content[0].image_url.url",
       "unsupported_image_url",
       "must be a data:image/png;base64"},
      {{{"messages", {image_part("data:image/gif;base64,R0lGOD")}}},
       "messages[0].content[0].image_url.url",
       "invalid_image_url",
       "'image/gif'"},
      {{{"messages", {image_part("data:image/png,rawbytes")}}},
       "messages[0].content[0].image_url.url",
       "invalid_image_url",
       "base64-encoded"},
      {{{"messages", {image_part("data:image/png;base64")}}},
       "messages[0].content[0].image_url.url",
       "invalid_image_url",
       "no ','"},
      {{{"messages", {image_part("data:image/png;base64,@@@@")}}},
       "messages[0].content[0].image_url.url",
       "invalid_base64",
       "not valid base64"},
      {{{"messages", {image_part("data:image/png;base64,")}}},
       "messages[0].content[0].image_url.url",
       "invalid_image",
       "no image bytes"},
      {{{"messages", {image_part(junk)}}},
       "messages[0].content[0].image_url.url",
       "invalid_image",
       "image 1"},
      {{{"messages", {image_part(data_url(kJpeg, "image/jpeg").substr(0, 23 + 400))}}},
       "messages[0].content[0].image_url.url",
       "invalid_image",
       ""},
      {chat_body({{"model", 5}}), "model", "invalid_type", "must be a string"},
      {chat_body({{"n", 0}}), "n", "invalid_value", "'n' must be between 1 and"},
      {chat_body({{"mirostat", 2}}), "mirostat", "unsupported_value", "not implemented"},
      {chat_body({{"dry_multiplier", 0.8}}), "dry_multiplier", "unsupported_value", "(off)"},
      {chat_body({{"typical_p", 0.5}}), "typical_p", "unsupported_value", "not implemented"},
      {chat_body({{"repeat_penalty", 0}}), "repeat_penalty", "invalid_value", ""},
      {chat_body({{"grammar", "root ::= \"a\""}}), "grammar", "unsupported_value", "GBNF"},
      {chat_body({{"response_format", {{"type", "text"}, {"schema", {{"type", "string"}}}}}}),
       "response_format.schema", "invalid_value", "json_object or json_schema"},
      {chat_body({{"n", "1"}}), "n", "invalid_type", "must be an integer"},
      {chat_body({{"max_tokens", 0}}), "max_tokens", "invalid_value", "between 1 and"},
      {chat_body({{"max_tokens", "10"}}), "max_tokens", "invalid_type", "an integer, not a string"},
      {chat_body({{"max_tokens", 1.5}}), "max_tokens", "invalid_type", "an integer, not a number"},
      {chat_body({{"max_tokens", 1e300}}), "max_tokens", "invalid_type", "an integer"},
      {chat_body({{"max_tokens", 18446744073709551615ull}}), "max_tokens", "invalid_value",
       "at most"},
      {chat_body({{"max_completion_tokens", -1}}), "max_completion_tokens", "invalid_value",
       "between 1 and"},
      {chat_body({{"temperature", "hot"}}), "temperature", "invalid_type", "must be a number"},
      {chat_body({{"temperature", 2.5}}), "temperature", "invalid_value", "<= 2"},
      {chat_body({{"temperature", -0.1}}), "temperature", "invalid_value", ">= 0"},
      {chat_body({{"top_p", 0}}), "top_p", "invalid_value", "> 0"},
      {chat_body({{"top_p", true}}), "top_p", "invalid_type", "not a boolean"},
      {chat_body({{"top_k", -1}}), "top_k", "invalid_value", "between 0"},
      {chat_body({{"min_p", 2}}), "min_p", "invalid_value", "<= 1"},
      {chat_body({{"seed", "x"}}), "seed", "invalid_type", "must be an integer"},
      {chat_body({{"seed", 1.5}}), "seed", "invalid_type", "must be an integer"},
      {chat_body({{"stop", 5}}), "stop", "invalid_type", "a string or an array of strings"},
      {chat_body({{"stop", ""}}), "stop", "invalid_value", "must not be empty"},
      {chat_body({{"stop", {"a", ""}}}), "stop[1]", "invalid_value", "must not be empty"},
      {chat_body({{"stop", {"a", 1}}}), "stop[1]", "invalid_type", "must be a string"},
      {chat_body({{"stop", twenty}}), "stop", "invalid_value", "at most 16"},
      {chat_body({{"stream", "yes"}}), "stream", "invalid_type", "must be a boolean"},
      {chat_body({{"stream_options", 1}}), "stream_options", "invalid_type", "must be an object"},
      {chat_body({{"stream_options", {{"include_usage", "y"}}}}), "stream_options.include_usage",
       "invalid_type", "must be a boolean"},
      {chat_body({{"frequency_penalty", 2.5}}), "frequency_penalty", "invalid_value", "2"},
      {chat_body({{"logit_bias", {{"12", 101}}}}), "logit_bias.12", "invalid_value", "-100 to 100"},
      {chat_body({{"logit_bias", {{"x", 1}}}}), "logit_bias.x", "invalid_value", "token ids"},
      {chat_body({{"logit_bias", 3}}), "logit_bias", "invalid_type", "must be an object"},
      {chat_body({{"presence_penalty", "x"}}), "presence_penalty", "invalid_type",
       "must be a number"},
      {chat_body({{"top_logprobs", 2}}), "top_logprobs", "invalid_value", "needs 'logprobs'"},
      {chat_body({{"logprobs", true}, {"top_logprobs", 21}}), "top_logprobs", "invalid_value",
       "between 0 and 20"},
      {chat_body({{"tools", {{{"type", "function"}}}}}), "tools", "unsupported_value",
       "tool calling"},
      {chat_body({{"tool_choice", "required"}}), "tool_choice", "unsupported_value",
       "tool calling"},
      {chat_body({{"response_format", {{"type", "yaml"}}}}), "response_format.type",
       "invalid_value", "must be text, json_object or json_schema"},
      {chat_body({{"response_format",
                   {{"type", "json_schema"},
                    {"json_schema",
                     {{"name", "x"}, {"schema", {{"type", "string"}, {"pattern", "a"}}}}}}}}),
       "response_format.json_schema.schema", "unsupported_schema", "#/pattern"},
      {chat_body({{"response_format", "json"}}), "response_format", "invalid_type",
       "must be an object"},
      {{{"messages", {{{"role", "assistant"}, {"content", "x"}, {"tool_calls", {{{"id", "1"}}}}}}}},
       "messages[0].tool_calls",
       "unsupported_value",
       "tool calls are not supported"},
  };
  for (const BadCase& c : cases) expect_refused([](const json& b) { parse_chat_request(b); }, c);
}

TEST(ServerApi, RefusesOversizedImages) {
  RequestLimits small;
  small.max_image_pixels = 300;  // the fixture is 23x17 = 391 pixels
  const json body = {
      {"messages",
       {user({{{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}}})}}};
  expect_refused(
      [&](const json& b) { parse_chat_request(b, small); },
      {body, "messages[0].content[0].image_url.url", "invalid_image", "over the limit of 300"});
  small.max_image_pixels = 391;
  EXPECT_NO_THROW(parse_chat_request(body, small));
  // Four of them fit the request's budget; the fifth does not.
  json parts = json::array();
  for (int i = 0; i < 5; ++i)
    parts.push_back({{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}});
  json five = {{"messages", {user(parts)}}};
  expect_refused([&](const json& b) { parse_chat_request(b, small); },
                 {five, "messages[0].content[4].image_url.url", "invalid_image",
                  "budget of 1564 pixels for all its images"});
  five["messages"][0]["content"].erase(4);
  EXPECT_NO_THROW(parse_chat_request(five, small));
}

TEST(ServerApi, RefusesEveryInvalidCompletionBody) {
  const std::vector<BadCase> cases = {
      {{{"model", "m"}}, "prompt", "missing_required_parameter", "'prompt' is required"},
      {{{"prompt", 5}}, "prompt", "invalid_type", "must be a string or an array of token ids"},
      {{{"prompt", "x"}, {"echo", true}}, "echo", "unsupported_value", "not supported"},
      {{{"prompt", "x"}, {"suffix", "y"}}, "suffix", "unsupported_value", "not supported"},
      {{{"prompt", "x"}, {"best_of", 3}}, "best_of", "unsupported_value", "must be 1"},
      {{{"prompt", "x"}, {"n", -3}}, "n", "invalid_value", "between 1 and"},
      {{{"prompt", "x"}, {"max_tokens", -5}}, "max_tokens", "invalid_value", "between 1"},
  };
  for (const BadCase& c : cases)
    expect_refused([](const json& b) { parse_completion_request(b); }, c);
  const CompletionRequest r =
      parse_completion_request({{"prompt", {"once"}}, {"stream", true}, {"echo", false}});
  EXPECT_EQ(r.prompt, "once");
  EXPECT_FALSE(r.prompt_ids);
  EXPECT_TRUE(r.stream);
  EXPECT_FALSE(r.sampling.ignore_eos);
}

TEST(ServerApi, CompletionPromptsAsTokenIds) {
  const PromptIdLimits limits{2048, 64};
  auto parse = [&](const json& prompt) {
    return parse_completion_request({{"prompt", prompt}}, limits);
  };
  // Token ids, alone or as OpenAI's batch form with one element, are taken as they are.
  const std::vector<int32_t> ids = {2, 0, 7, 2047};
  for (const json& p : {json(ids), json::array({ids})}) {
    SCOPED_TRACE(p.dump());
    const CompletionRequest r = parse(p);
    ASSERT_TRUE(r.prompt_ids);
    EXPECT_EQ(*r.prompt_ids, ids);
    EXPECT_EQ(r.prompt, "");
  }
  EXPECT_EQ(parse(json::array({"once"})).prompt, "once");
  EXPECT_FALSE(parse(json::array({"once"})).prompt_ids);
  // The context holds 64 rows, one of them for the first generated token.
  EXPECT_EQ(parse(std::vector<int32_t>(63, 5)).prompt_ids->size(), 63u);

  const std::vector<std::pair<json, BadCase>> cases = {
      {json::array({"a", "b"}), {{}, "prompt", "unsupported_value", "one prompt per request"}},
      {json::array({json::array({1}), json::array({2})}),
       {{}, "prompt", "unsupported_value", "holds 2 prompts"}},
      {json::array({1, "a"}), {{}, "prompt[1]", "invalid_value", "mixes token ids"}},
      {json::array({"a", 1}), {{}, "prompt[1]", "invalid_value", "mixes token ids"}},
      {json::array({1, 2.5}), {{}, "prompt[1]", "invalid_type", "must be an integer token id"}},
      {json::array({3, -1}), {{}, "prompt[1]", "invalid_value", "'prompt[1]' is -1"}},
      {json::array({2048}), {{}, "prompt[0]", "invalid_value", "is 2048, not a token id"}},
      {json::parse("[18446744073709551615]"),
       {{}, "prompt[0]", "invalid_value", "is 18446744073709551615"}},
      {json::array(), {{}, "prompt", "empty_array", "empty array"}},
      {json::array({json::array()}), {{}, "prompt[0]", "empty_array", "empty array"}},
      {json::array({json::array({1, "x"})}),
       {{}, "prompt[0][1]", "invalid_type", "must be an integer token id"}},
      {json::array({true}), {{}, "prompt[0]", "invalid_type", "a string or an array of token ids"}},
      {std::vector<int32_t>(64, 5), {{}, "prompt", "context_length_exceeded", "context holds 64"}},
      {json::array({json::array({1, 2}), "a"}),
       {{}, "prompt", "unsupported_value", "holds 2 prompts"}},
  };
  for (const auto& [prompt, c] : cases) {
    BadCase bc = c;
    bc.body = {{"prompt", prompt}};
    expect_refused([&](const json& b) { parse_completion_request(b, limits); }, bc);
  }

  // llama.cpp's ignore_eos: a boolean, unset unless sent.
  EXPECT_EQ(parse_completion_request({{"prompt", "x"}, {"ignore_eos", true}}).sampling.ignore_eos,
            true);
  EXPECT_EQ(parse_completion_request({{"prompt", "x"}, {"ignore_eos", false}}).sampling.ignore_eos,
            false);
  expect_refused([](const json& b) { parse_completion_request(b); },
                 {{{"prompt", "x"}, {"ignore_eos", 1}}, "ignore_eos", "invalid_type", "a boolean"});
}

TEST(ServerApi, MalformedJsonIsA400) {
  const std::string deep(200000, '[');  // deeper than any recursive parser's stack
  for (const std::string& body :
       {std::string(), std::string("{"), std::string("{\"a\":}"), std::string("[]"),
        std::string("null"), std::string("\"x\""), std::string("{\"messages\": [\"\xff\xfe\"]}"),
        std::string("{} trailing"), deep}) {
    SCOPED_TRACE(body.substr(0, 40));
    const auto e = api_error_of([&] { parse_json_body(body); });
    ASSERT_TRUE(e);
    EXPECT_EQ(e->status(), 400);
    EXPECT_EQ(e->code(), "invalid_json");
    EXPECT_EQ(e->param(), "");
    // The message may quote the client's bytes, invalid UTF-8 included; the reply still builds.
    EXPECT_NO_THROW(wire_json(error_json(*e)));
  }
  EXPECT_TRUE(parse_json_body(" {\"a\": 1} ").is_object());
}

TEST(ServerApi, Base64IsStrict) {
  std::mt19937 rng(5);
  for (size_t n = 0; n < 40; ++n) {
    std::vector<uint8_t> bytes(n);
    for (auto& b : bytes) b = static_cast<uint8_t>(rng());
    const std::string enc = encode_base64(bytes.data(), bytes.size());
    EXPECT_EQ(decode_base64(enc), bytes) << enc;
    // Unpadded input decodes the same.
    std::string bare = enc;
    while (!bare.empty() && bare.back() == '=') bare.pop_back();
    EXPECT_EQ(decode_base64(bare), bytes) << bare;
  }
  EXPECT_EQ(decode_base64("TWFu"), (std::vector<uint8_t>{'M', 'a', 'n'}));
  for (const char* bad :
       {"TWF", "T===", "TW=u", "TWFu\n", "TW Fu", "TWFu====", "TWF=", "-_-_", "A"})
    EXPECT_FALSE(decode_base64(bad)) << bad;
}

TEST(ServerApi, ErrorsHaveTheOpenAIShape) {
  const json a = error_json(ApiError(400, "bad thing", "invalid_request_error", "messages", "x"));
  EXPECT_EQ(a, json::parse(R"({"error":{"message":"bad thing","type":"invalid_request_error",
                                         "param":"messages","code":"x"}})"));
  const json b = error_json(ApiError(503, "later", "server_error"));
  EXPECT_TRUE(b["error"]["param"].is_null());
  EXPECT_TRUE(b["error"]["code"].is_null());
  EXPECT_EQ(b["error"]["type"], "server_error");
}

TEST(ServerApi, OverridesApplyOnTopOfDefaults) {
  GenerationOptions d;
  d.max_tokens = 100;
  d.sampling.temperature = 0.7f;
  d.sampling.top_k = 64;
  d.stop_strings = {"X"};
  d.stop_ids = {1, 106};
  GenerationOptions g = apply_overrides(d, {}, 42);
  EXPECT_EQ(g.max_tokens, 100);
  EXPECT_EQ(g.sampling.temperature, 0.7f);
  EXPECT_EQ(g.sampling.seed, 42u);
  EXPECT_EQ(g.stop_strings, std::vector<std::string>{"X"});
  EXPECT_EQ(g.stop_ids, (std::vector<int32_t>{1, 106}));
  SamplingOverrides o;
  o.max_tokens = 3;
  o.temperature = 0;
  o.top_k = 0;
  o.seed = 9;
  o.stop = std::vector<std::string>{};
  g = apply_overrides(d, o, 42);
  EXPECT_EQ(g.max_tokens, 3);
  EXPECT_EQ(g.sampling.temperature, 0.0f);
  EXPECT_EQ(g.sampling.top_k, 0);
  EXPECT_EQ(g.sampling.seed, 9u);
  EXPECT_TRUE(g.stop_strings.empty());
  EXPECT_EQ(openai_finish_reason("context"), "length");
  EXPECT_EQ(openai_finish_reason("stop"), "stop");
}

TEST(ServerApi, ResponseObjects) {
  const ResponseMeta m{"chatcmpl-1", "tiny", 1700000000};
  const json c = chat_completion_json(m, "hi", "stop", 5, 2);
  EXPECT_EQ(c["object"], "chat.completion");
  EXPECT_EQ(c["choices"][0]["message"], json({{"role", "assistant"}, {"content", "hi"}}));
  EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(c["usage"],
            json({{"prompt_tokens", 5}, {"completion_tokens", 2}, {"total_tokens", 7}}));
  const json k = chat_chunk_json(m, {{"content", "h"}}, std::nullopt);
  EXPECT_EQ(k["object"], "chat.completion.chunk");
  EXPECT_TRUE(k["choices"][0]["finish_reason"].is_null());
  const json u = usage_chunk_json(m, "chat.completion.chunk", 5, 2);
  EXPECT_TRUE(u["choices"].empty());
  EXPECT_EQ(u["usage"]["total_tokens"], 7);
  const json t = text_completion_json(m, "x", "length", 1, 1);
  EXPECT_EQ(t["object"], "text_completion");
  EXPECT_EQ(t["choices"][0]["text"], "x");
  const json models = models_json("tiny", 1);
  EXPECT_EQ(models["data"][0]["id"], "tiny");
  EXPECT_EQ(models["data"][0]["object"], "model");
  EXPECT_EQ(models["models"][0]["capabilities"], json::array({"completion"}));
  EXPECT_EQ(models_json("tiny", 1, true)["models"][0]["capabilities"],
            json::array({"completion", "multimodal"}));
  // One event per chunk, even when the text has newlines; invalid UTF-8 never throws.
  const std::string ev = sse_event(text_completion_chunk_json(m, "a\n\nb\xff", std::nullopt));
  EXPECT_EQ(ev.rfind("data: {", 0), 0u);
  EXPECT_EQ(ev.find('\n'), ev.size() - 2);
}

// ------------------------------------------------------------------------------------------
// The server, in-process.

ServerOptions tiny_options() {
  return tiny_server_options();
}
std::unique_ptr<Server> start(ServerOptions o) {
  return start_server(std::move(o));
}
httplib::Client client(const Server& s) {
  return server_client(s);
}
httplib::Result post(const Server& s, const std::string& path, const json& body,
                     const httplib::Headers& headers = {}) {
  return post_json(s, path, body, headers);
}

// The "data:" payloads of a server-sent-events body, in order.
std::vector<std::string> sse_data(const std::string& body) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(at, end - at);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    out.push_back(ev.substr(6));
    at = end + 2;
  }
  return out;
}

// Status and OpenAI error shape of a reply.
void expect_error_reply(const httplib::Result& r, int status, const std::string& code,
                        const std::string& param = {}) {
  ASSERT_TRUE(r) << "no reply";
  EXPECT_EQ(r->status, status) << r->body;
  EXPECT_EQ(r->get_header_value("Content-Type"), "application/json");
  json j;
  ASSERT_NO_THROW(j = json::parse(r->body)) << r->body;
  ASSERT_TRUE(j.contains("error")) << r->body;
  const json& e = j["error"];
  EXPECT_TRUE(e["message"].is_string() && !e["message"].get<std::string>().empty()) << r->body;
  EXPECT_TRUE(e["type"].is_string()) << r->body;
  EXPECT_TRUE(e.contains("param") && e.contains("code")) << r->body;
  if (code.empty())
    EXPECT_TRUE(e["code"].is_null()) << r->body;
  else
    EXPECT_EQ(e["code"], code) << r->body;
  if (param.empty())
    EXPECT_TRUE(e["param"].is_null()) << r->body;
  else
    EXPECT_EQ(e["param"], param) << r->body;
}

// `gemstage generate --json` for the same request, the reference the server must match.
json generate_json(const std::string& args) {
  const std::string dir = temp_dir("server_gen");
  const std::string cmd = std::string(GEMSTAGE_CLI) + " generate -m " + fixture("model") +
                          " --json -t 1 " + args + " > " + dir + "/out 2> " + dir + "/err";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << slurp(dir + "/err");
  return json::parse(slurp(dir + "/out"));
}

// A bare TCP client, for what an HTTP library will not do: vanish mid-reply, or never read.
class RawClient {
 public:
  RawClient(int port, int rcvbuf = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    if (rcvbuf > 0) setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  }
  ~RawClient() { close(); }
  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  void post(const std::string& path, const json& body) {
    const std::string b = body.dump();
    const std::string req = "POST " + path +
                            " HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                            "Content-Length: " +
                            std::to_string(b.size()) + "\r\n\r\n" + b;
    ASSERT_EQ(send(fd_, req.data(), req.size(), MSG_NOSIGNAL), static_cast<ssize_t>(req.size()));
  }
  void post_raw(const std::string& bytes) {
    // The server may close on us part-way; that is an answer too.
    (void)send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  }
  // Reads until `needle` arrived (true) or the timeout / end of stream (false).
  bool read_until(const std::string& needle, double timeout_s) {
    const auto t0 = Clock::now();
    while (received.find(needle) == std::string::npos) {
      const double left = timeout_s - seconds_since(t0);
      if (left <= 0) return false;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, static_cast<int>(left * 1000) + 1) <= 0) continue;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) return received.find(needle) != std::string::npos;
      received.append(buf, static_cast<size_t>(n));
    }
    return true;
  }
  std::string received;

 private:
  int fd_ = -1;
};

// Polls until pred() or the timeout; true if pred() held.
bool eventually(const std::function<bool()>& pred, double timeout_s) {
  const auto t0 = Clock::now();
  while (!pred()) {
    if (seconds_since(t0) > timeout_s) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

const char* kPrompt = "Hello there, how are you?";

TEST(ServerHttp, HealthModelsAndPage) {
  auto s = start(tiny_options());
  auto c = client(*s);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  const json hj = json::parse(h->body);
  EXPECT_EQ(hj["status"], "ok");
  EXPECT_EQ(hj["slots"], 2);
  auto m = c.Get("/v1/models");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  const json mj = json::parse(m->body);
  EXPECT_EQ(mj["object"], "list");
  EXPECT_EQ(mj["data"][0]["id"], "model");
  auto page = c.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  for (const char* id : {"id=\"messages\"", "id=\"input\"", "id=\"send\"", "id=\"file\""})
    EXPECT_NE(page->body.find(id), std::string::npos) << id;
  // Self-contained: nothing fetched from elsewhere. The bundled libraries name XML namespaces
  // ("http://www.w3.org/2000/svg") and their licences name web sites, so the check is on what a
  // browser would fetch: no element source, no linked or imported stylesheet, and every url() in
  // the styles an inline data: URL (the math fonts). The Chromium tests (tests/js/
  // serve_chat_page*.mjs) also fail on any request to another origin.
  for (const char* fetch : {"src=\"http", "src='http", "src=\"//", "src=\"/", "<link", "@import"})
    EXPECT_EQ(page->body.find(fetch), std::string::npos) << fetch;
  const size_t style = page->body.find("<style>");
  const size_t style_end = page->body.find("</style>");
  ASSERT_NE(style, std::string::npos);
  ASSERT_NE(style_end, std::string::npos);
  const std::string css = page->body.substr(style, style_end - style);
  int urls = 0;
  for (size_t at = css.find("url("); at != std::string::npos; at = css.find("url(", at + 1), ++urls)
    EXPECT_EQ(css.compare(at, 9, "url(data:"), 0) << css.substr(at, 60);
  EXPECT_GT(urls, 0);  // the math fonts are there, inlined
}

TEST(ServerHttp, LoadingStateAnswers503) {
  std::promise<void> gate;
  std::shared_future<void> open = gate.get_future().share();
  ServerOptions o = tiny_options();
  o.before_load = [open] { open.wait(); };
  Server s(o);
  s.start();
  auto c = client(s);
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_EQ(json::parse(h->body)["status"], "loading");
  expect_error_reply(c.Get("/v1/models"), 503, "model_loading");
  expect_error_reply(post(s, "/v1/chat/completions", chat_body()), 503, "model_loading");
  auto page = c.Get("/");  // the page itself can be served already
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  gate.set_value();
  ASSERT_TRUE(s.wait_loaded());
  h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
}

TEST(ServerHttp, LoadFailureIsReported) {
  ServerOptions o = tiny_options();
  o.model_path = temp_dir("server_no_model");
  Server s(o);
  s.start();
  EXPECT_FALSE(s.wait_loaded());
  EXPECT_FALSE(s.load_error().empty());
  EXPECT_EQ(s.load_state(), Server::LoadState::kFailed);
}

TEST(ServerHttp, GreedyChatEqualsGenerate) {
  auto s = start(tiny_options());
  const json want = generate_json(std::string("--temp 0 -n 12 -p \"") + kPrompt + "\"");
  const auto r = post(*s, "/v1/chat/completions",
                      {{"model", "whatever"},
                       {"messages", {user(kPrompt)}},
                       {"temperature", 0},
                       {"max_tokens", 12}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["model"], "model");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], want["text"]);
  EXPECT_EQ(j["choices"][0]["finish_reason"], want["finish_reason"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_tokens"]);
  EXPECT_EQ(j["usage"]["completion_tokens"], want["completion_tokens"]);
  EXPECT_EQ(j["usage"]["total_tokens"],
            want["prompt_tokens"].get<int>() + want["completion_tokens"].get<int>());
}

TEST(ServerHttp, StreamedChatIsTheSameReply) {
  auto s = start(tiny_options());
  const json req = {{"messages", {user(kPrompt)}}, {"temperature", 0}, {"max_tokens", 24}};
  const auto whole = post(*s, "/v1/chat/completions", req);
  ASSERT_TRUE(whole && whole->status == 200);
  const json w = json::parse(whole->body);
  for (bool usage : {true, false}) {
    SCOPED_TRACE(usage ? "with usage" : "without usage");
    json sreq = req;
    sreq["stream"] = true;
    if (usage) sreq["stream_options"] = {{"include_usage", true}};
    const auto r = post(*s, "/v1/chat/completions", sreq);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
    const auto data = sse_data(r->body);
    ASSERT_GE(data.size(), 3u);
    EXPECT_EQ(data.back(), "[DONE]");
    const json first = json::parse(data.front());
    EXPECT_EQ(first["object"], "chat.completion.chunk");
    EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
    std::string text;
    std::optional<json> finish, usage_chunk;
    for (size_t i = 1; i + 1 < data.size(); ++i) {
      const json c = json::parse(data[i]);
      EXPECT_EQ(c["id"], first["id"]);
      if (c["choices"].empty()) {
        usage_chunk = c;
        continue;
      }
      EXPECT_FALSE(finish) << "a chunk after the finish chunk";
      const json& ch = c["choices"][0];
      if (ch["delta"].contains("content")) text += ch["delta"]["content"].get<std::string>();
      if (!ch["finish_reason"].is_null()) finish = c;
    }
    EXPECT_EQ(text, w["choices"][0]["message"]["content"]);
    ASSERT_TRUE(finish);
    EXPECT_EQ((*finish)["choices"][0]["finish_reason"], w["choices"][0]["finish_reason"]);
    EXPECT_EQ(usage_chunk.has_value(), usage);
    if (usage_chunk) {
      // The same counts; this repeat of the prompt found all its rows but the last cached.
      json u = (*usage_chunk)["usage"], wu = w["usage"];
      EXPECT_EQ(u["prompt_tokens_details"]["cached_tokens"], u["prompt_tokens"].get<int>() - 1);
      u.erase("prompt_tokens_details");
      wu.erase("prompt_tokens_details");
      EXPECT_EQ(u, wu);
    }
  }
}

TEST(ServerHttp, CompletionsEqualGenerateRaw) {
  auto s = start(tiny_options());
  const json want = generate_json("--raw --temp 0 -n 10 -p \"Once upon a time\"");
  const json req = {{"prompt", "Once upon a time"}, {"temperature", 0}, {"max_tokens", 10}};
  const auto r = post(*s, "/v1/completions", req);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["choices"][0]["text"], want["text"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_tokens"]);
  EXPECT_EQ(j["usage"]["completion_tokens"], want["completion_tokens"]);

  json sreq = req;
  sreq["stream"] = true;
  const auto sr = post(*s, "/v1/completions", sreq);
  ASSERT_TRUE(sr && sr->status == 200);
  const auto data = sse_data(sr->body);
  ASSERT_GE(data.size(), 2u);
  EXPECT_EQ(data.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < data.size(); ++i) {
    const json c = json::parse(data[i]);
    EXPECT_EQ(c["object"], "text_completion");
    text += c["choices"][0]["text"].get<std::string>();
  }
  EXPECT_EQ(text, want["text"]);
  EXPECT_EQ(json::parse(data[data.size() - 2])["choices"][0]["finish_reason"],
            want["finish_reason"]);
}

TEST(ServerHttp, ImageMessage) {
  auto s = start(tiny_options());
  const auto text_only =
      post(*s, "/v1/chat/completions", {{"messages", {user("Describe it.")}}, {"max_tokens", 4}});
  ASSERT_TRUE(text_only && text_only->status == 200);
  const std::string mm = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/multimodal/image.png";
  const auto r =
      post(*s, "/v1/chat/completions",
           {{"messages",
             {user({{{"type", "image_url"}, {"image_url", {{"url", data_url(mm, "image/png")}}}},
                    {{"type", "text"}, {"text", "Describe it."}}})}},
            {"max_tokens", 4},
            {"temperature", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  // The image adds its markers and soft tokens to the prompt.
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(),
            json::parse(text_only->body)["usage"]["prompt_tokens"].get<int>() + 10);
  // Greedy with the same image is reproducible, and matches generate --image.
  const json want = generate_json("--temp 0 -n 4 --image " + mm + " -p \"Describe it.\"");
  EXPECT_EQ(j["choices"][0]["message"]["content"], want["text"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_tokens"]);
}

TEST(ServerHttp, VideoMessage) {
  const std::string clip = std::string(GEMSTAGE_FIXTURES) + "/video/h264_25fps_96x64.mp4";
  auto s = start(tiny_options());
  const json video = {{"type", "video_url"}, {"video_url", {{"url", data_url(clip, "video/mp4")}}}};
  const auto r = post(*s, "/v1/chat/completions",
                      {{"messages", {user({video, {{"type", "text"}, {"text", "What happens?"}}})}},
                       {"max_tokens", 4},
                       {"temperature", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  // Greedy on the same clip is generate --video's reply, on the same prompt.
  const json want = generate_json("--temp 0 -n 4 --video " + clip + " -p \"What happens?\"");
  EXPECT_EQ(j["choices"][0]["message"]["content"], want["text"]);
  EXPECT_EQ(j["usage"]["prompt_tokens"], want["prompt_tokens"]);
  // A video that does not decode, or whose frames could not fit the context: 400s naming it.
  const json junk = {
      {"type", "video_url"},
      {"video_url", {{"url", "data:video/mp4;base64,AAAAGGZ0eXBtcDQyAAAAAG1wNDI="}}}};
  const auto bad = post(*s, "/v1/chat/completions", {{"messages", {user(json::array({junk}))}}});
  expect_error_reply(bad, 400, "");
  EXPECT_NE(bad->body.find("video 1 (messages[0].content[0].video_url.url)"), std::string::npos)
      << bad->body;
  ServerOptions o = tiny_options();
  o.ctx = 256;
  auto small = start(o);
  const auto big =
      post(*small, "/v1/chat/completions", {{"messages", {user(json::array({video}))}}});
  expect_error_reply(big, 400, "");
  EXPECT_NE(big->body.find("context holds 256"), std::string::npos) << big->body;
}

TEST(ServerHttp, EveryErrorHasItsStatusAndShape) {
  auto s = start(tiny_options());
  auto c = client(*s);
  const std::string chat = "/v1/chat/completions";
  auto raw = [&](const std::string& body) {
    return c.Post(chat.c_str(), body, "application/json");
  };
  expect_error_reply(raw("{not json"), 400, "invalid_json");
  expect_error_reply(raw(""), 400, "invalid_json");
  expect_error_reply(raw("[1,2]"), 400, "invalid_json");
  expect_error_reply(post(*s, chat, chat_body({{"max_tokens", "many"}})), 400, "invalid_type",
                     "max_tokens");
  expect_error_reply(post(*s, chat, {{"messages", {{{"role", "narrator"}, {"content", "x"}}}}}),
                     400, "invalid_value", "messages[0].role");
  expect_error_reply(post(*s, chat, {{"messages", json::array()}}), 400, "empty_array", "messages");
  expect_error_reply(post(*s, chat, {{"model", "m"}}), 400, "missing_required_parameter",
                     "messages");
  const std::string url_param = "messages[0].content[0].image_url.url";
  auto image = [](const std::string& url) {
    return json{{"messages", {user({{{"type", "image_url"}, {"image_url", {{"url", url}}}}})}}};
  };
  expect_error_reply(post(*s, chat, image("data:image/png;base64,!!!!")), 400, "invalid_base64",
                     url_param);
  expect_error_reply(post(*s, chat, image("data:image/png;base64,aGVsbG8gd29ybGQ=")), 400,
                     "invalid_image", url_param);
  expect_error_reply(post(*s, chat, image("https://example.com/a.png")), 400,
                     "unsupported_image_url", url_param);
  expect_error_reply(post(*s, chat, chat_body({{"n", 9}})), 400, "invalid_value", "n");
  expect_error_reply(post(*s, chat, chat_body({{"stream", true}, {"temperature", 9}})), 400,
                     "invalid_value", "temperature");
  expect_error_reply(post(*s, "/v1/completions", {{"prompt", 12}}), 400, "invalid_type", "prompt");
  expect_error_reply(c.Get("/v1/nothing"), 404, "not_found");
  expect_error_reply(c.Get("/favicon.ico"), 404, "not_found");
  auto g = c.Get(chat.c_str());
  expect_error_reply(g, 405, "method_not_allowed");
  EXPECT_EQ(g->get_header_value("Allow"), "POST");
  expect_error_reply(c.Post("/v1/models", "{}", "application/json"), 405, "method_not_allowed");
  expect_error_reply(c.Delete("/v1/completions"), 405, "method_not_allowed");
  // After all of that, the server still serves.
  const auto ok = post(*s, chat, chat_body({{"max_tokens", 2}}));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
}

TEST(ServerHttp, ApiKeyBodyLimitImageLimitAndContext) {
  ServerOptions o = tiny_options();
  o.api_key = "sekrit-key";
  o.max_body = 4096;
  o.ctx = 64;
  o.limits.max_image_pixels = 300;
  auto s = start(o);
  auto c = client(*s);
  const httplib::Headers auth = {{"Authorization", "Bearer sekrit-key"}};
  const std::string chat = "/v1/chat/completions";
  auto missing = post(*s, chat, chat_body());
  expect_error_reply(missing, 401, "missing_api_key");
  EXPECT_EQ(missing->get_header_value("WWW-Authenticate"), "Bearer");
  expect_error_reply(post(*s, chat, chat_body(), {{"Authorization", "Bearer wrong"}}), 401,
                     "invalid_api_key");
  expect_error_reply(post(*s, chat, chat_body(), {{"Authorization", "sekrit-key"}}), 401,
                     "missing_api_key");
  expect_error_reply(post(*s, chat, chat_body(), {{"Authorization", "Bearer sekrit-ke"}}), 401,
                     "invalid_api_key");
  expect_error_reply(c.Get("/v1/models"), 401, "missing_api_key");
  auto ok = post(*s, chat, chat_body({{"max_tokens", 2}}), auth);
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  // Health and the page stay public (the page asks for the key itself).
  EXPECT_EQ(c.Get("/health")->status, 200);
  EXPECT_EQ(c.Get("/")->status, 200);

  expect_error_reply(post(*s, chat, chat_body({{"pad", std::string(5000, 'x')}}), auth), 413,
                     "request_too_large");
  expect_error_reply(post(*s, chat,
                          {{"messages",
                            {user({{{"type", "image_url"},
                                    {"image_url", {{"url", data_url(kPng, "image/png")}}}}})}}},
                          auth),
                     400, "invalid_image", "messages[0].content[0].image_url.url");

  std::string longer;
  for (int i = 0; i < 60; ++i) longer += "word" + std::to_string(i) + " ";
  for (bool stream : {false, true}) {
    const auto r = post(*s, chat, {{"messages", {user(longer)}}, {"stream", stream}}, auth);
    expect_error_reply(r, 400, "context_length_exceeded", "messages");
    EXPECT_NE(r->body.find("context holds 64"), std::string::npos) << r->body;
  }
  expect_error_reply(post(*s, "/v1/completions", {{"prompt", longer}}, auth), 400,
                     "context_length_exceeded", "prompt");
  // A prompt that fits but whose reply runs into the limit stops with "length".
  const auto near = post(*s, "/v1/completions",
                         {{"prompt", "word"}, {"max_tokens", 500}, {"temperature", 0}}, auth);
  ASSERT_TRUE(near && near->status == 200);
  const json nj = json::parse(near->body);
  if (nj["usage"]["completion_tokens"].get<int>() > 60) {
    EXPECT_EQ(nj["choices"][0]["finish_reason"], "length");
  }
}

ServerOptions endless_options() {
  ServerOptions o = tiny_options();
  o.parallel = 1;
  o.threads = 1;
  o.ignore_eos = true;  // random weights: without this a reply may end at any token
  return o;
}
const json kEndless = {{"prompt", "Go on"}, {"max_tokens", 100000000}, {"stream", true}};

TEST(ServerHttp, ClientThatLeavesMidStreamFreesItsSlot) {
  auto s = start(endless_options());
  {
    RawClient a(s->port());
    a.post("/v1/completions", kEndless);
    ASSERT_TRUE(a.read_until("\"text\":", 10.0 * kSlow)) << a.received;
    EXPECT_EQ(s->stats().busy, 1);
  }  // closed mid-stream
  EXPECT_TRUE(eventually([&] { return s->stats().busy == 0; }, 5.0 * kSlow))
      << "the generation kept running after its client left";
  EXPECT_EQ(s->stats().cancelled, 1);
  const auto t0 = Clock::now();
  const auto r = post(*s, "/v1/chat/completions", chat_body({{"max_tokens", 8}}));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_LT(seconds_since(t0), 5.0 * kSlow);
}

TEST(ServerHttp, ClientsThatLeaveWhileQueuedOrWaitingAreDropped) {
  auto s = start(endless_options());
  RawClient a(s->port());
  a.post("/v1/completions", kEndless);
  ASSERT_TRUE(a.read_until("\"text\":", 10.0 * kSlow));
  {
    RawClient queued(s->port());
    json b = kEndless;
    b["stream"] = false;
    queued.post("/v1/completions", b);
    ASSERT_TRUE(eventually([&] { return s->stats().queued == 1; }, 5.0 * kSlow));
  }
  a.close();
  ASSERT_TRUE(
      eventually([&] { return s->stats().busy == 0 && s->stats().queued == 0; }, 5.0 * kSlow));
  EXPECT_EQ(s->stats().cancelled, 2);
  EXPECT_EQ(s->stats().completed, 0);
  {
    // Waiting for a non-streamed reply: the socket is watched too.
    RawClient waiting(s->port());
    json b = kEndless;
    b["stream"] = false;
    waiting.post("/v1/completions", b);
    ASSERT_TRUE(eventually([&] { return s->stats().busy == 1; }, 5.0 * kSlow));
  }
  EXPECT_TRUE(eventually([&] { return s->stats().busy == 0; }, 5.0 * kSlow));
  EXPECT_EQ(s->stats().cancelled, 3);
}

TEST(ServerHttp, AClientThatNeverReadsDoesNotStallItsGeneration) {
  auto s = start(endless_options());
  // A tiny receive window and no reads: the reply backs up in the socket, but the worker only
  // appends to its job, so the generation runs to its end regardless.
  RawClient stalled(s->port(), 1024);
  json req = kEndless;
  // Enough output to back up past the socket buffers; sanitizer builds decode ~10x slower.
  req["max_tokens"] = kSlow > 1 ? 800 : 3000;
  stalled.post("/v1/completions", req);
  EXPECT_TRUE(eventually([&] { return s->stats().completed == 1; }, 30.0 * kSlow));
  const auto r = post(*s, "/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 4}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST(ServerHttp, QueueIsFirstInFirstOut) {
  auto s = start(endless_options());
  RawClient a(s->port());
  a.post("/v1/completions", kEndless);
  ASSERT_TRUE(a.read_until("\"text\":", 10.0 * kSlow));
  std::vector<std::unique_ptr<RawClient>> waiting;
  for (int i = 0; i < 3; ++i) {
    waiting.push_back(std::make_unique<RawClient>(s->port()));
    waiting.back()->post(
        "/v1/completions",
        {{"prompt", "Hi " + std::to_string(i)}, {"max_tokens", 200}, {"stream", false}});
    ASSERT_TRUE(eventually([&] { return s->stats().queued == i + 1; }, 5.0 * kSlow));
  }
  a.close();
  // Watch all three at once and note the order their replies complete in.
  std::vector<int> order;
  std::vector<bool> done(3, false);
  const auto t0 = Clock::now();
  while (order.size() < 3 && seconds_since(t0) < 30.0 * kSlow)
    for (int i = 0; i < 3; ++i)
      if (!done[static_cast<size_t>(i)] &&
          waiting[static_cast<size_t>(i)]->read_until("\"usage\"", 0.002)) {
        done[static_cast<size_t>(i)] = true;
        order.push_back(i);
      }
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  for (auto& w : waiting) EXPECT_NE(w->received.find("HTTP/1.1 200"), std::string::npos);
}

TEST(ServerHttp, ShutdownRefusesNewWorkAndEndsRunningStreams) {
  ServerOptions o = endless_options();
  o.shutdown_grace_seconds = 0.5;
  auto s = start(o);
  RawClient a(s->port());
  a.post("/v1/chat/completions",
         {{"messages", {user("Tell me everything")}}, {"max_tokens", 100000000}, {"stream", true}});
  ASSERT_TRUE(a.read_until("\"content\":", 10.0 * kSlow)) << a.received;
  const auto t0 = Clock::now();
  std::thread stopper([&] { s->shutdown(); });
  // Shutdown has begun once /health says so (the listener stays open through the grace period).
  EXPECT_TRUE(eventually(
      [&] {
        const auto h = client(*s).Get("/health");
        return h && h->status == 503 && h->body.find("shutting_down") != std::string::npos;
      },
      5.0 * kSlow));
  expect_error_reply(post(*s, "/v1/chat/completions", chat_body()), 503, "server_shutting_down");
  // The running stream is cut after the grace period, with an error event and no [DONE].
  EXPECT_TRUE(a.read_until("server_shutting_down", 10.0 * kSlow)) << a.received.substr(0, 500);
  stopper.join();
  EXPECT_LT(seconds_since(t0), 10.0 * kSlow);
  EXPECT_EQ(a.received.find("[DONE]"), std::string::npos);
  EXPECT_FALSE(client(*s).Get("/health"));  // the listener is closed
}

TEST(ServerHttp, ShutdownLetsShortRequestsFinish) {
  ServerOptions o = tiny_options();
  o.shutdown_grace_seconds = 30;
  auto s = start(o);
  RawClient a(s->port());
  a.post("/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 300}, {"stream", true}});
  ASSERT_TRUE(a.read_until("data:", 10.0 * kSlow));
  s->shutdown();
  EXPECT_TRUE(a.read_until("[DONE]", 10.0 * kSlow)) << a.received.substr(0, 500);
}

TEST(ServerHttp, ManyConcurrentClients) {
  auto s = start(tiny_options());
  std::vector<std::thread> threads;
  std::atomic<int> ok{0};
  for (int i = 0; i < 12; ++i)
    threads.emplace_back([&, i] {
      const json body = {{"messages", {user("Hi number " + std::to_string(i))}},
                         {"max_tokens", 20},
                         {"stream", i % 2 == 0},
                         {"seed", i}};
      const auto r = post(*s, "/v1/chat/completions", body);
      if (r && r->status == 200) ++ok;
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), 12);
  EXPECT_EQ(s->stats().completed, 12);
}

// The text of a streamed completion, from its SSE body.
std::string streamed_text(const std::string& body) {
  std::string text;
  for (const std::string& d : sse_data(body)) {
    if (d == "[DONE]") break;
    const json c = json::parse(d);
    if (c.contains("choices") && !c["choices"].empty() && c["choices"][0].contains("text"))
      text += c["choices"][0]["text"].get<std::string>();
  }
  return text;
}

// The value of one series in a /metrics body; -1 if it is missing.
double metric_value(const std::string& body, const std::string& series) {
  const size_t at = body.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body.substr(at + series.size() + 2));
}

TEST(ServerBatching, ConcurrentStreamsEachGetWhatTheyGetAlone) {
  ServerOptions o = tiny_options();
  o.parallel = 4;
  o.ignore_eos = true;  // every reply runs its full length, so the batch stays full
  const std::vector<std::string> prompts = {"One", "Two words here", "A somewhat longer prompt",
                                            "Hi"};
  auto body = [&](size_t i, bool stream) {
    // Different lengths, so sequences join and leave the batch at different steps.
    return json{{"prompt", prompts[i]},
                {"max_tokens", 10 + 6 * static_cast<int>(i)},
                {"temperature", 0},
                {"seed", 7},
                {"stream", stream}};
  };
  std::vector<std::string> alone;
  {
    auto s = start(o);
    for (size_t i = 0; i < prompts.size(); ++i) {
      const auto r = post(*s, "/v1/completions", body(i, false));
      ASSERT_TRUE(r && r->status == 200);
      alone.push_back(json::parse(r->body)["choices"][0]["text"].get<std::string>());
    }
  }
  auto s = start(o);
  std::vector<std::string> together(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      const auto r = post(*s, "/v1/completions", body(i, true));
      if (r && r->status == 200) together[i] = streamed_text(r->body);
    });
  for (auto& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_FALSE(alone[i].empty());
    EXPECT_EQ(together[i], alone[i]) << "prompt " << i;
  }
  const std::string m = client(*s).Get("/metrics")->body;
  // They were batched: fewer steps than tokens generated.
  EXPECT_LT(metric_value(m, "gemstage_step_seconds_count"),
            metric_value(m, "gemstage_generated_tokens_total"))
      << m;
}

TEST(ServerBatching, ImagesInTheBatch) {
  ServerOptions o = tiny_options();
  o.parallel = 3;
  const json img = {
      {"messages",
       {user({{{"type", "text"}, {"text", "What is this?"}},
              {{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}}})}},
      {"temperature", 0},
      {"max_tokens", 8}};
  std::string alone;
  {
    auto s = start(o);
    const auto r = post(*s, "/v1/chat/completions", img);
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
    alone = json::parse(r->body)["choices"][0]["message"]["content"];
  }
  auto s = start(o);
  std::vector<std::string> got(3);
  std::vector<std::thread> clients;
  for (size_t i = 0; i < 3; ++i)
    clients.emplace_back([&, i] {
      const json b =
          i == 1 ? json{{"messages", {user("Plain text in between")}}, {"max_tokens", 8}} : img;
      const auto r = post(*s, "/v1/chat/completions", b);
      if (r && r->status == 200) got[i] = json::parse(r->body)["choices"][0]["message"]["content"];
    });
  for (auto& t : clients) t.join();
  EXPECT_EQ(got[0], alone);
  EXPECT_EQ(got[2], alone);
}

// Prefix reuse stops at the first image row: the same placeholder ids with another picture
// behind them must not pick up the first picture's cached rows.
TEST(ServerBatching, PrefixReuseNeverReusesAnotherImagesRows) {
  ServerOptions o = tiny_options();
  o.parallel = 1;
  auto body = [](const std::string& image, const char* mime) {
    return json{
        {"messages",
         {user({{{"type", "text"}, {"text", "Describe"}},
                {{"type", "image_url"}, {"image_url", {{"url", data_url(image, mime)}}}}})}},
        {"temperature", 0},
        {"max_tokens", 12}};
  };
  auto reply = [](const httplib::Result& r) {
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
    return r ? json::parse(r->body)["choices"][0]["message"]["content"].get<std::string>() : "";
  };
  std::string jpeg_alone, png_alone;
  {
    auto s = start(o);
    jpeg_alone = reply(post(*s, "/v1/chat/completions", body(kJpeg, "image/jpeg")));
  }
  {
    auto s = start(o);
    png_alone = reply(post(*s, "/v1/chat/completions", body(kPng, "image/png")));
    // The same slot, the same ids up to the image, another image.
    EXPECT_EQ(reply(post(*s, "/v1/chat/completions", body(kJpeg, "image/jpeg"))), jpeg_alone);
    EXPECT_EQ(reply(post(*s, "/v1/chat/completions", body(kPng, "image/png"))), png_alone);
  }
}

// The slot states /health reports.
std::vector<std::string> slot_states(const Server& s, std::vector<int64_t>* rows = nullptr) {
  const json h = json::parse(client(s).Get("/health")->body);
  std::vector<std::string> out;
  for (const json& slot : h["slot_states"]) {
    out.push_back(slot["state"]);
    if (rows) rows->push_back(slot["rows"]);
  }
  return out;
}

TEST(ServerBatching, ADisconnectMidPrefillFreesItsRowsWhileOthersStream) {
  ServerOptions o = endless_options();
  o.parallel = 2;
  o.threads = 2;
  o.batch = 2;  // a decode row and one prompt row a step: a long prompt takes many steps
  o.ubatch = 2;
  auto s = start(o);
  RawClient keeps(s->port());
  json endless = kEndless;
  endless["max_tokens"] = 60000;  // its rows must leave room in the budget for the other
  keeps.post("/v1/completions", endless);
  ASSERT_TRUE(keeps.read_until("\"text\":", 10.0 * kSlow)) << keeps.received;
  std::string long_prompt;
  for (int i = 0; i < 1500; ++i) long_prompt.append("w").append(std::to_string(i)).append(" ");
  {
    RawClient leaves(s->port());
    leaves.post("/v1/completions", {{"prompt", long_prompt}, {"stream", true}});
    ASSERT_TRUE(eventually(
        [&] {
          const auto st = slot_states(*s);
          return std::count(st.begin(), st.end(), "prefill") == 1;
        },
        5.0 * kSlow));
    // The running stream keeps flowing while the prompt comes in.
    const size_t before = keeps.received.size();
    EXPECT_TRUE(eventually(
        [&] {
          keeps.read_until("never", 0.01);
          return keeps.received.size() > before + 400;
        },
        5.0 * kSlow))
        << "the running stream stalled while a prompt was prefilled";
    ASSERT_EQ(s->stats().busy, 2) << "the prompt's prefill ended before its client left";
  }  // gone in the middle of its prefill
  EXPECT_TRUE(eventually([&] { return s->stats().busy == 1; }, 5.0 * kSlow));
  EXPECT_EQ(s->stats().cancelled, 1);
  std::vector<int64_t> rows;
  const auto st = slot_states(*s, &rows);
  ASSERT_EQ(st.size(), 2u);
  for (size_t i = 0; i < 2; ++i)
    if (st[i] == "idle") {
      EXPECT_EQ(rows[i], 0) << "a cancelled request's rows are dropped";
    }
  keeps.close();
  EXPECT_TRUE(eventually([&] { return s->stats().busy == 0; }, 5.0 * kSlow));
  EXPECT_EQ(s->stats().kv_rows_used, 0);
  EXPECT_EQ(s->stats().kv_rows_reserved, 0);
}

TEST(ServerBatching, BudgetQueuesWhatDoesNotFitNowAndRefusesWhatNeverFits) {
  ServerOptions o = endless_options();
  o.parallel = 2;
  o.ctx = 96;  // the KV budget of both slots together
  // The big request's ~90 tokens take the tiny model a fraction of a second, so a loaded machine
  // could let it finish before the small one arrives, which then never queues. The engine waits
  // before its 41st step (big has text by then, about half its share) until the queue's checks
  // are done.
  std::mutex hold_mu;
  std::condition_variable hold_cv;
  int steps = 0;
  bool held = true;
  o.before_step = [&] {
    std::unique_lock<std::mutex> lk(hold_mu);
    if (++steps > 40) hold_cv.wait(lk, [&] { return !held; });
  };
  const auto release = [&] {
    {
      std::lock_guard<std::mutex> lk(hold_mu);
      held = false;
    }
    hold_cv.notify_all();
  };
  auto s = start(o);
  // Destroyed before the server, so a failed assertion never leaves the engine waiting.
  struct ReleaseAtExit {
    std::function<void()> release;
    ~ReleaseAtExit() { release(); }
  } release_at_exit{release};
  EXPECT_EQ(s->stats().kv_budget, 96);
  RawClient big(s->port());
  // Its prompt plus max_tokens reserve the whole budget. Greedy, so the text before the hold is
  // fixed: sampled at random, the first 40 tokens may all be byte pieces of no complete UTF-8
  // character, so nothing streams and the engine waits at the hold for ever.
  big.post("/v1/completions",
           {{"prompt", "Go on"}, {"max_tokens", 1000}, {"stream", true}, {"temperature", 0}});
  ASSERT_TRUE(big.read_until("\"text\":", 10.0 * kSlow)) << big.received;
  // A slot is free, but the rows are not: the next request waits.
  RawClient small(s->port());
  small.post("/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 4}});
  ASSERT_TRUE(eventually([&] { return s->stats().queued == 1; }, 5.0 * kSlow));
  EXPECT_EQ(s->stats().busy, 1);
  const json health = json::parse(client(*s).Get("/health")->body);
  EXPECT_EQ(health["queued"], 1);
  EXPECT_EQ(health["kv_budget"], 96);
  EXPECT_EQ(health["slot_states"].size(), 2u);
  // One that could never fit is refused at once, not queued.
  std::string longer;
  for (int i = 0; i < 120; ++i) longer += "word" + std::to_string(i) + " ";
  const auto t0 = Clock::now();
  const auto r = post(*s, "/v1/completions", {{"prompt", longer}});
  expect_error_reply(r, 400, "context_length_exceeded", "prompt");
  EXPECT_LT(seconds_since(t0), 2.0 * kSlow);
  EXPECT_EQ(metric_value(client(*s).Get("/metrics")->body,
                         "gemstage_requests_total{outcome=\"refused\"}"),
            1);
  // The big one ends at its share (finish "length"); then the waiting one runs.
  release();
  ASSERT_TRUE(big.read_until("[DONE]", 30.0 * kSlow)) << big.received.substr(0, 300);
  EXPECT_NE(big.received.find("\"finish_reason\":\"length\""), std::string::npos);
  ASSERT_TRUE(small.read_until("\"usage\"", 10.0 * kSlow)) << small.received;
  EXPECT_NE(small.received.find("HTTP/1.1 200"), std::string::npos);
  EXPECT_EQ(s->stats().completed, 2);
}

// The ids a text prompt tokenizes to, sent as the prompt, are that prompt: same reply, same usage,
// and the prefix the text left in the slot's caches is reused.
TEST(ServerHttp, TokenIdPromptEqualsItsText) {
  ServerOptions o = tiny_options();
  o.parallel = 1;  // both requests on one slot, for the prefix reuse
  auto s = start(o);
  const std::string text = "Once upon a time";
  const Tokenizer tok = Tokenizer::from_model_dir(fixture("model"));
  ASSERT_TRUE(tok.bos_id());
  std::vector<int32_t> ids = {*tok.bos_id()};  // a text prompt is <bos> + the text
  for (int32_t id : tok.encode(text)) ids.push_back(id);

  const json req = {{"prompt", text}, {"temperature", 0}, {"max_tokens", 10}};
  const auto r = post(*s, "/v1/completions", req);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json want = json::parse(r->body);
  EXPECT_EQ(want["usage"]["prompt_tokens"], ids.size());

  const std::string before = client(*s).Get("/metrics")->body;
  json ireq = req;
  ireq["prompt"] = ids;
  const auto ir = post(*s, "/v1/completions", ireq);
  ASSERT_TRUE(ir && ir->status == 200) << (ir ? ir->body : "");
  const json got = json::parse(ir->body);
  EXPECT_EQ(got["choices"][0]["text"], want["choices"][0]["text"]);
  EXPECT_EQ(got["choices"][0]["finish_reason"], want["choices"][0]["finish_reason"]);
  // The same counts but the cached ones: every prompt row the text left in the caches but the
  // last, which runs again for its logits.
  const auto without_cached = [](json u) {
    u.erase("prompt_tokens_details");
    return u;
  };
  EXPECT_EQ(without_cached(got["usage"]), without_cached(want["usage"]));
  EXPECT_EQ(got["usage"]["prompt_tokens_details"]["cached_tokens"],
            static_cast<int64_t>(ids.size()) - 1);
  const std::string after = client(*s).Get("/metrics")->body;
  EXPECT_EQ(metric_value(after, "gemstage_prompt_tokens_reused_total") -
                metric_value(before, "gemstage_prompt_tokens_reused_total"),
            static_cast<double>(ids.size() - 1));

  // Streamed, and in the one-element batch form.
  ireq["prompt"] = json::array({ids});
  ireq["stream"] = true;
  ireq["stream_options"] = {{"include_usage", true}};
  const auto sr = post(*s, "/v1/completions", ireq);
  ASSERT_TRUE(sr && sr->status == 200) << (sr ? sr->body : "");
  EXPECT_EQ(streamed_text(sr->body), want["choices"][0]["text"]);
  const auto data = sse_data(sr->body);
  ASSERT_GE(data.size(), 2u);
  EXPECT_EQ(without_cached(json::parse(data[data.size() - 2])["usage"]),
            without_cached(want["usage"]));
}

TEST(ServerHttp, TokenIdPromptRefusals) {
  ServerOptions o = tiny_options();
  o.ctx = 64;
  auto s = start(o);
  const json placeholder = json::array({2, 5, 2040});  // the fixture's image_token_id
  struct Case {
    json prompt;
    std::string param, code, message_part;
  };
  const std::vector<Case> cases = {
      // The fixture's vocab_size is 2048.
      {json::array({5, 2048}), "prompt[1]", "invalid_value", "is 2048, not a token id"},
      {json::array({-1}), "prompt[0]", "invalid_value", "is -1"},
      {json::array({1, "a"}), "prompt[1]", "invalid_value", "mixes token ids"},
      {json::array({1.0}), "prompt[0]", "invalid_type", "an integer token id"},
      {json::array(), "prompt", "empty_array", "empty array"},
      {json::array({"a", "b"}), "prompt", "unsupported_value", "one prompt per request"},
      {std::vector<int32_t>(64, 5), "prompt", "context_length_exceeded", "context holds 64"},
      // A placeholder row (2040 is the fixture's image_token_id) has no image to fill it,
      // whether sent as its id or written as text.
      {json::array({2, 5, 2040}), "prompt", "invalid_value", "token 2 is 2040"},
      {"<|image|>", "prompt", "invalid_value", "is 2040, an image / audio placeholder"},
  };
  for (bool stream : {false, true})
    for (const Case& c : cases) {
      SCOPED_TRACE(c.prompt.dump().substr(0, 60));
      const auto r = post(*s, "/v1/completions", {{"prompt", c.prompt}, {"stream", stream}});
      expect_error_reply(r, 400, c.code, c.param);
      if (r) {
        EXPECT_NE(r->body.find(c.message_part), std::string::npos) << r->body;
      }
    }
  // The server still serves after all of them.
  const auto ok = post(*s, "/v1/completions", {{"prompt", json::array({2, 5})}, {"max_tokens", 2}});
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// ignore_eos (llama.cpp's field) generates max_tokens even where the model would have stopped.
TEST(ServerHttp, IgnoreEosRunsToMaxTokens) {
  auto s = start(tiny_options());
  constexpr int kMax = 64;
  json req = {{"prompt", "Hi"}, {"temperature", 1}, {"max_tokens", kMax}};
  // A seed whose reply stops on a stop id before max_tokens (random weights: some do).
  std::optional<json> stopped;
  for (int seed = 1; seed <= 200 && !stopped; ++seed) {
    req["seed"] = seed;
    const auto r = post(*s, "/v1/completions", req);
    ASSERT_TRUE(r && r->status == 200);
    const json j = json::parse(r->body);
    if (j["choices"][0]["finish_reason"] == "stop") stopped = j;
  }
  ASSERT_TRUE(stopped) << "no seed stopped early";
  ASSERT_LT((*stopped)["usage"]["completion_tokens"].get<int>(), kMax);
  const std::string stopped_text = (*stopped)["choices"][0]["text"];

  req["ignore_eos"] = true;
  const auto r = post(*s, "/v1/completions", req);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "");
  const json j = json::parse(r->body);
  EXPECT_EQ(j["usage"]["completion_tokens"], kMax);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  // The same sampler draws up to where the reply stopped.
  EXPECT_EQ(j["choices"][0]["text"].get<std::string>().rfind(stopped_text, 0), 0u) << j.dump();

  json sreq = req;
  sreq["stream"] = true;
  sreq["stream_options"] = {{"include_usage", true}};
  const auto sr = post(*s, "/v1/completions", sreq);
  ASSERT_TRUE(sr && sr->status == 200);
  const auto data = sse_data(sr->body);
  ASSERT_GE(data.size(), 2u);
  EXPECT_EQ(json::parse(data[data.size() - 2])["usage"]["completion_tokens"], kMax);
  EXPECT_EQ(streamed_text(sr->body), j["choices"][0]["text"]);

  // On a server started with --ignore-eos, "ignore_eos": false stops on the stop ids again.
  ServerOptions o = tiny_options();
  o.ignore_eos = true;
  auto endless = start(o);
  req.erase("ignore_eos");
  const auto e = post(*endless, "/v1/completions", req);
  ASSERT_TRUE(e && e->status == 200);
  EXPECT_EQ(json::parse(e->body)["usage"]["completion_tokens"], kMax);
  req["ignore_eos"] = false;
  const auto f = post(*endless, "/v1/completions", req);
  ASSERT_TRUE(f && f->status == 200);
  EXPECT_EQ(json::parse(f->body)["choices"][0], (*stopped)["choices"][0]);
}

TEST(ServerBatching, PrefixReuseAndMetrics) {
  ServerOptions o = tiny_options();
  o.parallel = 3;
  auto s = start(o);
  const json turn1 = {
      {"messages", {user("Tell me about the sea")}}, {"temperature", 0}, {"max_tokens", 6}};
  const auto r1 = post(*s, "/v1/chat/completions", turn1);
  ASSERT_TRUE(r1 && r1->status == 200);
  const json j1 = json::parse(r1->body);
  // Something else in between, on another slot.
  ASSERT_EQ(post(*s, "/v1/completions", {{"prompt", "Unrelated"}, {"max_tokens", 4}})->status, 200);
  json turn2 = turn1;
  turn2["messages"].push_back(
      {{"role", "assistant"}, {"content", j1["choices"][0]["message"]["content"]}});
  turn2["messages"].push_back(user("And the mountains?"));
  const std::string before = client(*s).Get("/metrics")->body;
  const auto r2 = post(*s, "/v1/chat/completions", turn2);
  ASSERT_TRUE(r2 && r2->status == 200);
  const auto m = client(*s).Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 200);
  EXPECT_EQ(m->get_header_value("Content-Type"), "text/plain; version=0.0.4");
  const double reused = metric_value(m->body, "gemstage_prompt_tokens_reused_total") -
                        metric_value(before, "gemstage_prompt_tokens_reused_total");
  // The first turn's prompt at least came back from the caches.
  EXPECT_GE(reused, j1["usage"]["prompt_tokens"].get<double>()) << m->body;
  EXPECT_EQ(metric_value(m->body, "gemstage_requests_total{outcome=\"completed\"}"), 3);
  EXPECT_EQ(metric_value(m->body, "gemstage_queue_depth"), 0);
  EXPECT_EQ(metric_value(m->body, "gemstage_slots"), 3);
  EXPECT_GT(metric_value(m->body, "gemstage_kv_rows_used"), 0);
  EXPECT_EQ(metric_value(m->body, "gemstage_kv_rows_budget"),
            metric_value(m->body, "gemstage_kv_rows_used") +
                metric_value(m->body, "gemstage_kv_rows_free"));
  EXPECT_GT(metric_value(m->body, "gemstage_step_seconds_count"), 0);
  EXPECT_NE(m->body.find("gemstage_step_seconds_bucket{le=\"+Inf\"}"), std::string::npos);
}

}  // namespace

// Random mutations of valid bodies, truncated bodies and raw garbage on the socket: every reply
// is a 200 or a 4xx in the error shape, and the server serves normally afterwards.
TEST(ServerHttp, GarbageNeverBreaksTheServer) {
  auto s = start(tiny_options());
  std::mt19937 rng(20260405);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  const std::vector<json> values = {nullptr,
                                    true,
                                    0,
                                    -1,
                                    7,
                                    1.5,
                                    -1e308,
                                    18446744073709551615ull,
                                    "",
                                    "x",
                                    std::string(3000, 'z'),
                                    json::array(),
                                    {1, "a", nullptr},
                                    json::object(),
                                    {{"type", "text"}},
                                    {{"url", "data:image/png;base64,AAAA"}}};
  const std::vector<json::json_pointer> fields = {
      json::json_pointer("/messages"),
      json::json_pointer("/messages/0"),
      json::json_pointer("/messages/0/role"),
      json::json_pointer("/messages/0/content"),
      json::json_pointer("/messages/0/content/0"),
      json::json_pointer("/messages/0/content/0/type"),
      json::json_pointer("/messages/0/content/1/image_url"),
      json::json_pointer("/messages/0/content/1/image_url/url"),
      json::json_pointer("/max_tokens"),
      json::json_pointer("/temperature"),
      json::json_pointer("/top_p"),
      json::json_pointer("/seed"),
      json::json_pointer("/stop"),
      json::json_pointer("/n"),
      json::json_pointer("/stream"),
      json::json_pointer("/stream_options"),
      json::json_pointer("/stream_options/include_usage"),
      json::json_pointer("/prompt")};
  const json base = {
      {"messages",
       {user({{{"type", "text"}, {"text", "Hi"}},
              {{"type", "image_url"}, {"image_url", {{"url", data_url(kPng, "image/png")}}}}})}},
      {"max_tokens", 3},
      {"stream", false}};
  auto c = client(*s);
  for (int i = 0; i < 200; ++i) {
    json body = base;
    for (size_t k = 0, n = 1 + pick(3); k < n; ++k) {
      try {
        body[fields[pick(fields.size())]] = values[pick(values.size())];
      } catch (const json::exception&) {  // a path through a non-container: leave it
      }
    }
    std::string text = body.dump();
    if (i % 5 == 0) text.resize(pick(text.size()));
    const char* path = i % 2 ? "/v1/chat/completions" : "/v1/completions";
    const auto r = c.Post(path, text, "application/json");
    ASSERT_TRUE(r) << "no reply to " << text.substr(0, 300);
    if (r->status == 200) continue;
    EXPECT_TRUE(r->status == 400 || r->status == 413) << r->status << " " << r->body;
    // The shape, whatever the code and param are.
    const json e = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r->body;
    auto str = [](const json& v) { return v.is_string() ? v.get<std::string>() : std::string(); };
    expect_error_reply(r, r->status, str(e["error"]["code"]), str(e["error"]["param"]));
  }
  for (int i = 0; i < 20; ++i) {
    RawClient raw(s->port());
    std::string junk(1 + pick(2000), '\0');
    for (char& ch : junk) ch = static_cast<char>(rng());
    if (i % 2)
      junk =
          "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: " + std::to_string(junk.size()) +
          "\r\n\r\n" + junk;
    raw.post_raw(junk);
    // A well-framed request with a garbage body gets its 400; bare garbage is abandoned.
    if (i % 2) {
      EXPECT_TRUE(raw.read_until("invalid_json", 5.0 * kSlow)) << raw.received.substr(0, 300);
      EXPECT_EQ(raw.received.rfind("HTTP/1.1 400", 0), 0u) << raw.received.substr(0, 100);
    }
  }
  const auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 200);
  const auto ok = post(*s, "/v1/chat/completions", chat_body({{"max_tokens", 4}}));
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
}

// ------------------------------------------------------------------------------------------
// The CLI around it.

namespace {

int run_cli(const std::string& args, const std::string& err) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > /dev/null 2> " + err;
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(ServeCli, AModelThatCannotLoadExitsWithItsError) {
  const std::string dir = temp_dir("serve_cli_bad_model");
  EXPECT_EQ(run_cli("serve -m " + dir + "/missing --port 0", dir + "/err"), 1);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("listening on http://127.0.0.1:"), std::string::npos) << err;
  EXPECT_NE(err.find("error: "), std::string::npos) << err;
}

TEST(ServeCli, APortInUseIsAClearError) {
  auto s = start(tiny_options());
  const std::string dir = temp_dir("serve_cli_port");
  EXPECT_EQ(run_cli("serve -m " + fixture("model") + " --port " + std::to_string(s->port()),
                    dir + "/err"),
            1);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("cannot listen on 127.0.0.1:" + std::to_string(s->port())), std::string::npos)
      << err;
}

TEST(ServeCli, FlagsAreChecked) {
  const std::string dir = temp_dir("serve_cli_flags");
  EXPECT_NE(run_cli("serve -m " + fixture("model") + " --port 70000", dir + "/err"), 0);
  EXPECT_NE(run_cli("serve -m " + fixture("model") + " -np 0", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("parallel"), std::string::npos) << slurp(dir + "/err");
}

}  // namespace

// The tool path end to end on the tiny model: a tool round trip's second request (string
// arguments, a tool result) is rendered by the chat template and answered, streamed or not; a
// random model rarely writes a call, so the reply's mapping is tested on canned output in
// api_tools_test.cc.
TEST(ServerHttp, ToolRoundTripRequestsAreServed) {
  auto s = start(tiny_options());
  const json body = {{"messages", json::parse(R"([{"role":"user","content":"Weather in Paris?"},
         {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",
           "function":{"name":"get_weather","arguments":"{\"city\": \"Paris\"}"}}]},
         {"role":"tool","tool_call_id":"call_1","content":"15C"}])")},
                     {"tools", json::parse(R"([{"type":"function","function":{"name":"get_weather",
         "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])")},
                     {"max_tokens", 8}};
  auto r = post(*s, "/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json j = json::parse(r->body);
  const json& choice = j["choices"][0];
  EXPECT_EQ(choice["message"]["role"], "assistant");
  const std::string fr = choice["finish_reason"];
  EXPECT_TRUE(fr == "length" || fr == "stop" || fr == "tool_calls") << fr;
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int>() > 0, true);

  json streamed = body;
  streamed["stream"] = true;
  r = post(*s, "/v1/chat/completions", streamed);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const auto events = sse_data(r->body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_FALSE(json::parse(events[events.size() - 2])["choices"][0]["finish_reason"].is_null());

  json bad = body;
  bad["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{oops";
  expect_error_reply(post(*s, "/v1/chat/completions", bad), 400, "invalid_value",
                     "messages[1].tool_calls[0].function.arguments");
  // A result as a list of text parts is accepted; an image that does not decode is a 400.
  json parts_result = body;
  parts_result["messages"][2]["content"] = json::array({{{"type", "text"}, {"text", "15C"}}});
  r = post(*s, "/v1/chat/completions", parts_result);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  json with_image = body;
  with_image["messages"][0]["content"] = json::array(
      {{{"type", "image_url"}, {"image_url", {{"url", "data:image/png;base64,AAAA"}}}}});
  r = post(*s, "/v1/chat/completions", with_image);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  s->shutdown();
}

// Images with tools or thinking take the tool path in every dialect: the image's markers and soft
// tokens are in the prompt (the fixture image is 56 soft tokens, gemma4-tiny/multimodal/
// manifest.json, plus <|image> and <image|>), and its rows reach the model as on the plain path.
TEST(ServerHttp, ImagesWithToolsAndThinkingInEveryDialect) {
  auto s = start(tiny_options());
  const std::string mm = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/multimodal/image.png";
  const std::string url = data_url(mm, "image/png");
  const json image_part = {{"type", "image_url"}, {"image_url", {{"url", url}}}};
  const json tools = json::parse(R"([{"type":"function","function":{"name":"get_weather",
      "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}}])");
  constexpr int kImageRows = 56 + 2;
  auto ok = [](const httplib::Result& r) {
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 200) << r->body;
    return r->status == 200 ? json::parse(r->body) : json();
  };

  // Chat completions: the same greedy logprobs as the plain image path, whose prompt is the same
  // (thinking off), so the soft tokens reached the model.
  const json question = json::array({image_part, {{"type", "text"}, {"text", "Describe it."}}});
  json plain = {
      {"messages", {user(question)}}, {"max_tokens", 4}, {"temperature", 0}, {"logprobs", true}};
  json thinking_off = plain;
  thinking_off["chat_template_kwargs"] = {{"enable_thinking", false}};
  const json a = ok(post(*s, "/v1/chat/completions", plain));
  const json b = ok(post(*s, "/v1/chat/completions", thinking_off));
  EXPECT_EQ(b["usage"]["prompt_tokens"], a["usage"]["prompt_tokens"]);
  EXPECT_EQ(b["choices"][0]["logprobs"], a["choices"][0]["logprobs"]);

  json with_tools = {{"messages", {user(question)}}, {"tools", tools}, {"max_tokens", 4}};
  json text_only = with_tools;
  text_only["messages"][0]["content"] = "Describe it.";
  const int text_prompt = ok(post(*s, "/v1/chat/completions", text_only))["usage"]["prompt_tokens"];
  EXPECT_EQ(ok(post(*s, "/v1/chat/completions", with_tools))["usage"]["prompt_tokens"],
            text_prompt + kImageRows);
  json streamed = with_tools;
  streamed["stream"] = true;
  streamed["stream_options"] = {{"include_usage", true}};
  const httplib::Result r = post(*s, "/v1/chat/completions", streamed);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
  const auto events = sse_data(r->body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(json::parse(events[events.size() - 2])["usage"]["prompt_tokens"],
            text_prompt + kImageRows);
  // With thinking on too.
  json thinking = with_tools;
  thinking["chat_template_kwargs"] = {{"enable_thinking", true}};
  EXPECT_GT(ok(post(*s, "/v1/chat/completions", thinking))["usage"]["prompt_tokens"],
            text_prompt + kImageRows);

  // Messages: an image block with tools and thinking.
  const json image_block = {
      {"type", "image"},
      {"source",
       {{"type", "base64"}, {"media_type", "image/png"}, {"data", url.substr(url.find(',') + 1)}}}};
  const json anthropic_tools =
      json::parse(R"([{"name":"get_weather","input_schema":{"type":"object",
      "properties":{"city":{"type":"string"}}}}])");
  // Anthropic's input_tokens leaves out cache_read_input_tokens: the prompt is their sum.
  const auto messages_prompt_tokens = [&](const json& body) {
    const json usage = ok(post(*s, "/v1/messages", body))["usage"];
    return usage["input_tokens"].get<int>() + usage["cache_read_input_tokens"].get<int>();
  };
  json msg = {{"max_tokens", 4},
              {"tools", anthropic_tools},
              {"messages",
               {{{"role", "user"},
                 {"content", json::array({image_block, {{"type", "text"}, {"text", "Hi"}}})}}}}};
  json msg_text = msg;
  msg_text["messages"][0]["content"] = "Hi";
  const int msg_text_in = messages_prompt_tokens(msg_text);
  EXPECT_EQ(messages_prompt_tokens(msg), msg_text_in + kImageRows);
  // An image in a tool result (a screenshot tool): the template writes it after the response.
  json shot = msg_text;
  shot["messages"].push_back(json::parse(R"({"role":"assistant","content":[
      {"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Oslo"}}]})"));
  shot["messages"].push_back(
      {{"role", "user"},
       {"content",
        {{{"type", "tool_result"},
          {"tool_use_id", "toolu_1"},
          {"content", json::array({{{"type", "text"}, {"text", "Sunny."}}, image_block})}}}}});
  json shot_text = shot;
  shot_text["messages"][2]["content"][0]["content"] = "Sunny.";
  const int shot_text_in = messages_prompt_tokens(shot_text);
  EXPECT_EQ(messages_prompt_tokens(shot), shot_text_in + kImageRows);
  msg["thinking"] = {{"type", "enabled"}, {"budget_tokens", 1024}};
  msg["stream"] = true;
  const httplib::Result ms = post(*s, "/v1/messages", msg);
  ASSERT_TRUE(ms && ms->status == 200) << (ms ? ms->body : "no reply");
  EXPECT_NE(ms->body.find("event: message_stop"), std::string::npos) << ms->body;

  // Responses: an input_image with function tools.
  json resp = {{"max_output_tokens", 4},
               {"tools", json::parse(R"([{"type":"function","name":"get_weather",
          "parameters":{"type":"object","properties":{"city":{"type":"string"}}}}])")},
               {"input",
                {{{"role", "user"},
                  {"content", json::array({{{"type", "input_image"}, {"image_url", url}},
                                           {{"type", "input_text"}, {"text", "Hi"}}})}}}}};
  json resp_text = resp;
  resp_text["input"][0]["content"] = "Hi";
  const int resp_text_in = ok(post(*s, "/v1/responses", resp_text))["usage"]["input_tokens"];
  EXPECT_EQ(ok(post(*s, "/v1/responses", resp))["usage"]["input_tokens"],
            resp_text_in + kImageRows);
  s->shutdown();
}

// A Messages reply cut by one of its stop_sequences says so, whole and streamed.
TEST(ServerHttp, MessagesReportTheMatchedStopSequence) {
  auto s = start(tiny_options());
  json body = {{"max_tokens", 24},
               {"temperature", 0},
               {"messages", {{{"role", "user"}, {"content", "Count with me"}}}}};
  const httplib::Result full = post(*s, "/v1/messages", body);
  ASSERT_TRUE(full && full->status == 200) << (full ? full->body : "no reply");
  const json whole = json::parse(full->body);
  std::string text;
  for (const json& b : whole["content"])
    if (b["type"] == "text") text += b["text"].get<std::string>();
  // An ASCII letter or digit of the reply (random weights: the rest may be any bytes).
  size_t at = 0;
  while (at < text.size() && !std::isalnum(static_cast<unsigned char>(text[at]))) ++at;
  ASSERT_LT(at, text.size()) << "no ASCII letter or digit in " << text;
  const std::string stop = text.substr(at, 1);
  body["stop_sequences"] = {"\x01never", stop};
  const httplib::Result cut = post(*s, "/v1/messages", body);
  ASSERT_TRUE(cut && cut->status == 200) << (cut ? cut->body : "no reply");
  const json j = json::parse(cut->body);
  EXPECT_EQ(j["stop_reason"], "stop_sequence") << j;
  EXPECT_EQ(j["stop_sequence"], stop) << j;
  body["stream"] = true;
  const httplib::Result streamed = post(*s, "/v1/messages", body);
  ASSERT_TRUE(streamed && streamed->status == 200);
  const std::string want =
      "{\"stop_reason\":\"stop_sequence\",\"stop_sequence\":" + json(stop).dump() + "}";
  EXPECT_NE(streamed->body.find(want), std::string::npos) << streamed->body;
  // Without the stop sequences the same reply ends as it did.
  EXPECT_NE(whole["stop_reason"], "stop_sequence");
  EXPECT_TRUE(whole["stop_sequence"].is_null());
  s->shutdown();
}

// /v1/responses logprobs: the output_text's tokens with their alternatives, as chat completions
// reports them for the same prompt (greedy), whole and streamed.
TEST(ServerHttp, ResponsesLogprobsOfTheOutputText) {
  auto s = start(tiny_options());
  const json chat = {{"messages", {user(kPrompt)}},
                     {"max_tokens", 8},
                     {"temperature", 0},
                     {"logprobs", true},
                     {"top_logprobs", 2}};
  const httplib::Result c = post(*s, "/v1/chat/completions", chat);
  ASSERT_TRUE(c && c->status == 200) << (c ? c->body : "no reply");
  const json cj = json::parse(c->body);
  json body = {{"input", kPrompt},
               {"max_output_tokens", 8},
               {"temperature", 0},
               {"include", {"message.output_text.logprobs"}},
               {"top_logprobs", 2}};
  const httplib::Result r = post(*s, "/v1/responses", body);
  ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
  const json rj = json::parse(r->body);
  ASSERT_EQ(rj["usage"]["input_tokens"], cj["usage"]["prompt_tokens"]);
  // The reply text's tokens: chat's, less the special tokens (the tiny vocabulary has no thought
  // or call markers, so every other token is text).
  const Tokenizer tok = Tokenizer::from_model_dir(fixture("model"));
  json want = json::array();
  for (const json& e : cj["choices"][0]["logprobs"]["content"]) {
    const auto id = tok.token_to_id(e["token"].get<std::string>());
    if (!(id && tok.is_special(*id))) want.push_back(e);
  }
  json got = json::array();
  for (const json& item : rj["output"])
    if (item["type"] == "message") got = item["content"][0]["logprobs"];
  ASSERT_FALSE(want.empty()) << cj;
  EXPECT_EQ(got, want);
  for (const json& e : got) EXPECT_EQ(e["top_logprobs"].size(), 2u) << e;

  body["stream"] = true;
  const httplib::Result st = post(*s, "/v1/responses", body);
  ASSERT_TRUE(st && st->status == 200);
  json streamed = json::array();
  for (size_t at = 0; at < st->body.size();) {
    size_t end = st->body.find("\n\n", at);
    if (end == std::string::npos) end = st->body.size();
    const size_t data = st->body.find("\ndata: ", at) + 7;
    const json e = json::parse(st->body.substr(data, end - data));
    if (e["type"] == "response.output_text.delta")
      for (const json& x : e["logprobs"]) streamed.push_back(x);
    at = end + 2;
  }
  EXPECT_EQ(streamed, want);
  // Without include or top_logprobs there are none.
  body.erase("include");
  body.erase("top_logprobs");
  body["stream"] = false;
  const json plain = json::parse(post(*s, "/v1/responses", body)->body);
  for (const json& item : plain["output"])
    if (item["type"] == "message") {
      EXPECT_EQ(item["content"][0]["logprobs"], json::array());
    }
  s->shutdown();
}

// tool_choice required with thinking on: the model may think first, then must call. The audio
// fixture's tokenizer has the thought-channel markers; its random weights choose among the
// allowed tokens, so some replies think first, and every reply is a valid call.
TEST(ServerHttp, AForcedCallMayFollowAThought) {
  ServerOptions o = tiny_options();
  o.model_path = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-audio/model";
  auto s = start(o);
  json body = {{"messages", {user("What time is it in Oslo?")}},
               {"tools", json::parse(R"([{"type":"function","function":{"name":"get_time",
                   "parameters":{"type":"object","properties":{"tz":{"enum":["UTC","CET"]}},
                   "required":["tz"]}}}])")},
               {"tool_choice", "required"},
               {"chat_template_kwargs", {{"enable_thinking", true}}},
               {"temperature", 1},
               {"max_tokens", 96}};
  int thought_first = 0;
  for (int seed = 1; seed <= 8; ++seed) {
    body["seed"] = seed;
    const httplib::Result r = post(*s, "/v1/chat/completions", body);
    ASSERT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
    const json j = json::parse(r->body);
    const json& m = j["choices"][0]["message"];
    EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls") << j;
    const json calls = m.value("tool_calls", json::array());
    ASSERT_FALSE(calls.empty()) << j;
    for (const json& c : calls) {
      EXPECT_EQ(c["function"]["name"], "get_time") << j;
      const json args = json::parse(c["function"]["arguments"].get<std::string>());
      EXPECT_TRUE((args == json{{"tz", "UTC"}} || args == json{{"tz", "CET"}})) << j;
    }
    EXPECT_TRUE(m["content"].is_null()) << j;
    thought_first += m.contains("reasoning_content");
  }
  EXPECT_GT(thought_first, 0);
  s->shutdown();
}
