// `gemstage serve` as a drop-in for llama-server: /tokenize and /detokenize against the fixture
// tokenizer.json's own vocabulary, the native /completion (reply, stream, timings, n_probs) against
// the OpenAI route's reply, /props, /slots, /apply-template, the unprefixed aliases, the
// llamacpp:* metrics, OPTIONS and CORS, and cached-token usage after a repeated prompt.
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "runtime/sampler.h"
#include "server/api.h"
#include "server/server.h"
#include "server_test_util.h"
#include "test_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

using namespace gemstage;
using namespace gemstage::server;
using namespace gemstage::testing;
using json = nlohmann::json;

namespace {

ServerOptions options() {
  return tiny_server_options();
}
std::unique_ptr<Server> start(ServerOptions o) {
  return start_server(std::move(o));
}
httplib::Client client(const Server& s) {
  return server_client(s);
}

// The fixture tokenizer.json's vocabulary, read here, not through our tokenizer.
int32_t vocab_id(const std::string& piece) {
  std::ifstream in(fixture("model") + "/tokenizer.json");
  const json j = json::parse(in);
  if (j["model"]["vocab"].contains(piece)) return j["model"]["vocab"][piece].get<int32_t>();
  for (const json& t : j["added_tokens"])
    if (t["content"] == piece) return t["id"].get<int32_t>();
  ADD_FAILURE() << "no such piece " << piece;
  return -1;
}

std::vector<json> sse_events(const std::string& body) {
  std::vector<json> out;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(at, end - at);
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    EXPECT_NE(ev, "data: [DONE]");
    if (ev.rfind("data: {", 0) == 0) out.push_back(json::parse(ev.substr(6)));
    at = end + 2;
  }
  return out;
}

TEST(LlamaServer, TokenizeAndDetokenize) {
  auto s = start(options());
  const std::vector<int32_t> want = {vocab_id("\u2581the"), vocab_id("\u2581and"),
                                     vocab_id("\u2581of")};
  json r = post_ok(*s, "/tokenize", {{"content", " the and of"}});
  EXPECT_EQ(r["tokens"], json(want));
  r = post_ok(*s, "/tokenize", {{"content", " the and of"}, {"with_pieces", true}});
  ASSERT_EQ(r["tokens"].size(), 3u);
  EXPECT_EQ(r["tokens"][0], json({{"id", want[0]}, {"piece", " the"}}));
  EXPECT_EQ(r["tokens"][2], json({{"id", want[2]}, {"piece", " of"}}));
  // add_special inserts what the tokenizer's config asks for: the fixture's says no <bos>.
  {
    std::ifstream in(fixture("model") + "/tokenizer_config.json");
    ASSERT_EQ(json::parse(in)["add_bos_token"], false);
  }
  r = post_ok(*s, "/tokenize", {{"content", " the"}, {"add_special", true}});
  EXPECT_EQ(r["tokens"], json::array({want[0]}));
  // Special tokens in the text are parsed unless parse_special is false.
  r = post_ok(*s, "/tokenize", {{"content", "<bos>"}});
  EXPECT_EQ(r["tokens"], json::array({vocab_id("<bos>")}));
  r = post_ok(*s, "/tokenize", {{"content", "<bos>"}, {"parse_special", false}});
  EXPECT_GT(r["tokens"].size(), 1u);
  r = post_ok(*s, "/detokenize", {{"tokens", want}});
  EXPECT_EQ(r["content"], " the and of");
  auto bad =
      client(*s).Post("/detokenize", json({{"tokens", {want[0], -3}}}).dump(), "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "tokens[1]");
  bad = client(*s).Post("/tokenize", json({{"text", "x"}}).dump(), "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
}

TEST(LlamaServer, NativeCompletionMatchesTheOpenAIRoute) {
  auto s = start(options());
  const std::string prompt = "Once upon a time";
  const json oai =
      post_ok(*s, "/v1/completions",
              {{"prompt", prompt}, {"temperature", 0}, {"max_tokens", 6}, {"ignore_eos", true}});
  json whole_tokens;  // the non-streamed reply's ids
  for (const char* path : {"/completion", "/completions"}) {
    SCOPED_TRACE(path);
    const json r = post_ok(*s, path,
                           {{"prompt", prompt},
                            {"temperature", 0},
                            {"n_predict", 6},
                            {"ignore_eos", true},
                            {"cache_prompt", true},
                            {"n_probs", 3},
                            {"return_tokens", true}});
    EXPECT_EQ(r["content"], oai["choices"][0]["text"]);
    EXPECT_EQ(r["stop"], true);
    EXPECT_EQ(r["stop_type"], "limit");
    EXPECT_EQ(r["tokens_predicted"], 6);
    EXPECT_EQ(r["tokens"].size(), 6u);
    whole_tokens = r["tokens"];
    EXPECT_EQ(r["tokens_evaluated"], oai["usage"]["prompt_tokens"]);
    EXPECT_EQ(r["model"], "model");
    EXPECT_EQ(r["generation_settings"]["n_predict"], 6);
    EXPECT_GT(r["generation_settings"]["n_ctx"].get<int64_t>(), 0);
    const json& t = r["timings"];
    EXPECT_EQ(t["predicted_n"], 6);
    EXPECT_EQ(t["prompt_n"].get<int64_t>() + t["cache_n"].get<int64_t>(),
              r["tokens_evaluated"].get<int64_t>());
    EXPECT_EQ(r["tokens_cached"], t["cache_n"]);
    EXPECT_GT(t["predicted_ms"].get<double>(), 0);
    // Six tokens: the decode phase made the five after the first.
    EXPECT_DOUBLE_EQ(t["predicted_per_second"].get<double>(),
                     5e3 / t["predicted_ms"].get<double>());
    for (const char* k :
         {"prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_per_token_ms"})
      EXPECT_TRUE(t.contains(k)) << k;
    ASSERT_EQ(r["completion_probabilities"].size(), 6u);
    for (size_t i = 0; i < 6; ++i) {
      const json& p = r["completion_probabilities"][i];
      EXPECT_EQ(p["id"], r["tokens"][i]);
      EXPECT_LE(p["logprob"].get<double>(), 0);
      ASSERT_EQ(p["top_logprobs"].size(), 3u);
      EXPECT_TRUE(p["top_logprobs"][0].contains("id"));
    }
  }
  // Streamed: pieces with "stop": false, then the reply's fields with "stop": true; no [DONE].
  auto r = client(*s).Post("/completion",
                           json({{"prompt", prompt},
                                 {"temperature", 0},
                                 {"n_predict", 6},
                                 {"ignore_eos", true},
                                 {"stream", true}})
                               .dump(),
                           "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const std::vector<json> events = sse_events(r->body);
  ASSERT_GE(events.size(), 2u);
  std::string text;
  json streamed_tokens = json::array();
  int64_t predicted = 0;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    EXPECT_EQ(events[i]["stop"], false);
    text += events[i]["content"].get<std::string>();
    // Each piece carries the ids generated since the one before, and the count so far.
    for (const json& id : events[i]["tokens"]) streamed_tokens.push_back(id);
    EXPECT_EQ(events[i]["tokens_predicted"].get<int64_t>(),
              static_cast<int64_t>(streamed_tokens.size()));
    EXPECT_GE(events[i]["tokens_predicted"].get<int64_t>(), predicted);
    predicted = events[i]["tokens_predicted"].get<int64_t>();
  }
  EXPECT_EQ(text, oai["choices"][0]["text"]);
  EXPECT_EQ(streamed_tokens, whole_tokens);
  EXPECT_EQ(events.back()["stop"], true);
  EXPECT_EQ(events.back()["tokens_predicted"], 6);
  EXPECT_EQ(events.back()["timings"]["predicted_n"], 6);
  // n_predict 0 and n_probs out of range are refused, naming the field.
  for (const auto& [field, value] : {std::pair{"n_predict", 0}, std::pair{"n_probs", 21}}) {
    auto bad = client(*s).Post("/completion", json({{"prompt", "x"}, {field, value}}).dump(),
                               "application/json");
    ASSERT_TRUE(bad);
    EXPECT_EQ(bad->status, 400);
    EXPECT_EQ(json::parse(bad->body)["error"]["param"], field);
  }
  for (const json& bad :
       {json{{"post_sampling_probs", true}}, json{{"response_fields", {"content"}}}}) {
    json body = {{"prompt", "x"}, {"n_predict", 2}};
    body.update(bad);
    auto refused = client(*s).Post("/completion", body.dump(), "application/json");
    ASSERT_TRUE(refused);
    EXPECT_EQ(refused->status, 400) << refused->body;
    EXPECT_EQ(json::parse(refused->body)["error"]["param"], bad.begin().key());
  }
}

TEST(LlamaServer, PropsSlotsAliasesAndApplyTemplate) {
  ServerOptions o = options();
  o.alias = "my-gemma";
  auto s = start(o);
  auto c = client(*s);
  auto p = c.Get("/props");
  ASSERT_TRUE(p);
  ASSERT_EQ(p->status, 200) << p->body;
  const json props = json::parse(p->body);
  EXPECT_EQ(props["total_slots"], 2);
  EXPECT_EQ(props["model_path"], fixture("model"));
  EXPECT_EQ(props["model_alias"], "my-gemma");
  EXPECT_EQ(props["default_generation_settings"]["n_ctx"], props["n_ctx"]);
  EXPECT_EQ(props["default_generation_settings"]["params"]["n_predict"], 16);
  EXPECT_EQ(props["bos_token"], "<bos>");
  EXPECT_TRUE(props["chat_template"].is_string());
  auto slots = c.Get("/slots");
  ASSERT_TRUE(slots);
  EXPECT_EQ(slots->status, 501);  // off without --slots
  auto models = c.Get("/models");
  ASSERT_TRUE(models);
  EXPECT_EQ(json::parse(models->body)["data"][0]["id"], "my-gemma");
  // The tiny fixture has a vision tower.
  EXPECT_EQ(json::parse(models->body)["models"][0]["capabilities"],
            json::array({"completion", "multimodal"}));

  // /apply-template's prompt, tokenized and completed natively, is the chat reply.
  const json messages = json::array({{{"role", "user"}, {"content", "Tell me about the sea"}}});
  const json tpl = post_ok(*s, "/apply-template", {{"messages", messages}});
  const std::string prompt = tpl["prompt"];
  EXPECT_NE(prompt.find("Tell me about the sea"), std::string::npos);
  const json ids = post_ok(*s, "/tokenize", {{"content", prompt}})["tokens"];
  const json native =
      post_ok(*s, "/completion", {{"prompt", ids}, {"temperature", 0}, {"n_predict", 8}});
  const json chat = post_ok(*s, "/chat/completions",
                            {{"messages", messages}, {"temperature", 0}, {"max_tokens", 8}});
  EXPECT_EQ(chat["model"], "my-gemma");
  EXPECT_EQ(native["content"], chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(native["tokens_evaluated"], chat["usage"]["prompt_tokens"]);
  // llama-server's timings on the OpenAI reply too.
  EXPECT_EQ(chat["timings"]["predicted_n"], chat["usage"]["completion_tokens"]);
  // The prompt's token count without running it, under both spellings of the route (a stream
  // flag changes nothing: nothing is generated).
  for (const char* path : {"/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"})
    EXPECT_EQ(post_ok(*s, path, {{"messages", messages}, {"stream", true}}),
              json({{"input_tokens", chat["usage"]["prompt_tokens"]}}))
        << path;

  ServerOptions so = options();
  so.slots_endpoint = true;
  auto s2 = start(so);
  slots = client(*s2).Get("/slots");
  ASSERT_TRUE(slots);
  ASSERT_EQ(slots->status, 200);
  const json sj = json::parse(slots->body);
  ASSERT_EQ(sj.size(), 2u);
  EXPECT_EQ(sj[1]["id"], 1);
  EXPECT_EQ(sj[0]["is_processing"], false);
  EXPECT_EQ(sj[0]["next_token"][0]["has_next_token"], false);
  EXPECT_EQ(sj[0]["next_token"][0]["n_remain"], -1);  // idle
  EXPECT_EQ(sj[0]["next_token"][0]["n_decoded"], 0);
  // The Responses API without its /v1, as llama-server serves it.
  const json resp = post_ok(*s2, "/responses", {{"input", "Hi"}, {"max_output_tokens", 4}});
  EXPECT_EQ(resp["object"], "response");
  // OpenAI's input token count of a Responses request.
  EXPECT_EQ(
      post_ok(*s2, "/v1/responses/input_tokens", {{"input", "Hi"}}),
      json({{"object", "response.input_tokens"}, {"input_tokens", resp["usage"]["input_tokens"]}}));
}

// The template controls of vLLM and llama-server: no generation prompt, and continuing the last
// assistant message (its text left open, the reply its continuation); both at once, or a
// continuation without an assistant message last, is a 400.
TEST(LlamaServer, TemplateControlsAreHonoured) {
  auto s = start(options());
  const json user = {{"role", "user"}, {"content", "Tell me about the sea"}};
  const std::string open =
      post_ok(*s, "/apply-template", {{"messages", {user}}})["prompt"].get<std::string>();
  const std::string closed =
      post_ok(*s, "/apply-template",
              {{"messages", {user}}, {"add_generation_prompt", false}})["prompt"]
          .get<std::string>();
  EXPECT_EQ(open, closed + "<|turn>model\n");
  const json partial = {{"role", "assistant"}, {"content", "The sea is"}};
  const std::string continued =
      post_ok(*s, "/apply-template",
              {{"messages", {user, partial}}, {"continue_final_message", true}})["prompt"]
          .get<std::string>();
  EXPECT_EQ(continued, open + "The sea is");
  // The chat route continues the same prompt: its reply is /completion's on that text.
  const json chat = post_ok(*s, "/v1/chat/completions",
                            {{"messages", {user, partial}},
                             {"continue_final_message", true},
                             {"add_generation_prompt", false},
                             {"temperature", 0},
                             {"max_tokens", 6}});
  const json native =
      post_ok(*s, "/completion",
              {{"prompt", post_ok(*s, "/tokenize", {{"content", continued}})["tokens"]},
               {"temperature", 0},
               {"n_predict", 6}});
  EXPECT_EQ(chat["choices"][0]["message"]["content"], native["content"]);
  for (const json& bad : {json{{"messages", {user, partial}},
                               {"continue_final_message", true},
                               {"add_generation_prompt", true}},
                          json{{"messages", {user}}, {"continue_final_message", true}}}) {
    for (const char* route : {"/apply-template", "/v1/chat/completions"}) {
      auto r = client(*s).Post(route, bad.dump(), "application/json");
      ASSERT_TRUE(r);
      EXPECT_EQ(r->status, 400) << route << ": " << r->body;
      EXPECT_NE(r->body.find("continue_final_message"), std::string::npos) << r->body;
    }
  }
}

TEST(LlamaServer, CachedTokensAreReported) {
  auto s = start(options());
  const json body = {{"messages", {{{"role", "user"}, {"content", "Tell me about the mountains"}}}},
                     {"temperature", 0},
                     {"max_tokens", 4}};
  const json first = post_ok(*s, "/v1/chat/completions", body);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  const json second = post_ok(*s, "/v1/chat/completions", body);
  const int64_t cached = second["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GT(cached, 0);
  EXPECT_LT(cached, second["usage"]["prompt_tokens"].get<int64_t>());
  EXPECT_EQ(second["timings"]["cache_n"], cached);
}

double metric(const std::string& body, const std::string& series) {
  const size_t at = body.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(body.substr(at + series.size() + 2));
}

TEST(LlamaServer, LlamaCppMetricNames) {
  auto s = start(options());
  post_ok(*s, "/completion", {{"prompt", "Hello"}, {"n_predict", 5}, {"ignore_eos", true}});
  auto m = client(*s).Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(metric(m->body, "llamacpp:tokens_predicted_total"), 5);
  EXPECT_EQ(metric(m->body, "llamacpp:tokens_predicted_total"),
            metric(m->body, "gemstage_generated_tokens_total"));
  EXPECT_EQ(metric(m->body, "llamacpp:prompt_tokens_total"),
            metric(m->body, "gemstage_prompt_tokens_total") -
                metric(m->body, "gemstage_prompt_tokens_reused_total"));
  EXPECT_GT(metric(m->body, "llamacpp:tokens_predicted_seconds_total"), 0);
  EXPECT_EQ(metric(m->body, "llamacpp:requests_processing"), 0);
  EXPECT_GT(metric(m->body, "llamacpp:n_decode_total"), 0);
}

TEST(LlamaServer, OptionsAndCors) {
  for (bool cors : {false, true}) {
    SCOPED_TRACE(cors ? "--cors" : "no cors");
    ServerOptions o = options();
    o.api_key = "k";  // a preflight carries no key and must still be answered
    if (cors) o.cors_origins = "http://a.example, http://b.example";
    auto s = start(o);
    auto c = client(*s);
    const httplib::Headers preflight = {{"Origin", "http://b.example"},
                                        {"Access-Control-Request-Method", "POST"}};
    auto r = c.Options("/v1/chat/completions", preflight);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 204);
    EXPECT_EQ(r->get_header_value("Allow"), "POST, OPTIONS");
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), cors ? "http://b.example" : "");
    r = c.Options("/props", {{"Origin", "http://evil.example"}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 204);
    EXPECT_EQ(r->get_header_value("Allow"), "GET, OPTIONS");
    EXPECT_FALSE(r->has_header("Access-Control-Allow-Origin"));
    r = c.Options("/no/such/route");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 404);
    // An allowed origin sees its header on real replies too, an error included.
    r = c.Get("/props", {{"Origin", "http://a.example"}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401);  // the key is required on llama-server's routes too
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), cors ? "http://a.example" : "");
  }
  // "localhost": any page on this machine, any port; not a look-alike host.
  ServerOptions o = options();
  o.cors_origins = "localhost";
  auto s = start(o);
  for (const char* origin : {"http://localhost", "http://127.0.0.1:3000", "https://[::1]:8443"}) {
    auto r = client(*s).Options("/health", {{"Origin", origin}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), origin);
  }
  for (const char* origin : {"http://localhost.evil.example", "http://127.0.0.1:80/x"}) {
    auto r = client(*s).Options("/health", {{"Origin", origin}});
    ASSERT_TRUE(r);
    EXPECT_FALSE(r->has_header("Access-Control-Allow-Origin")) << origin;
  }
  // An entry that is not an origin would match nothing: the server does not start.
  for (const char* bad : {"bogus-origin", "http://a.example/path", "ftp://a.example"}) {
    ServerOptions b = options();
    b.cors_origins = std::string("http://ok.example,") + bad;
    Server server(b);
    try {
      server.start();
      ADD_FAILURE() << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
    }
  }
}

}  // namespace

namespace {

TEST(SamplerBiasAndPenalties, OpenAISemantics) {
  const std::vector<float> logits = {1.0f, 2.0f, 3.0f, 0.5f};
  auto greedy = [&](SamplingParams p, std::vector<int32_t> history) {
    p.temperature = 0;
    return Sampler(p).sample(logits.data(), 4, history);
  };
  SamplingParams p;
  EXPECT_EQ(greedy(p, {}), 2);
  p.logit_bias = {{3, 100.0f}};
  EXPECT_EQ(greedy(p, {}), 3);
  p.logit_bias = {{2, -100.0f}};
  EXPECT_EQ(greedy(p, {}), 1);
  p.logit_bias = {{99, 100.0f}};  // outside the vocabulary: ignored
  EXPECT_EQ(greedy(p, {}), 2);
  p = SamplingParams{};
  p.frequency_penalty = 0.6f;  // token 2 seen twice: 3 - 1.2 = 1.8 < 2
  EXPECT_EQ(greedy(p, {2, 2}), 1);
  EXPECT_EQ(greedy(p, {2}), 2);  // once: 2.4 > 2
  p = SamplingParams{};
  p.presence_penalty = 1.5f;  // once is enough: 1.5 < 2
  EXPECT_EQ(greedy(p, {2}), 1);
  p.presence_penalty = -2.0f;  // a negative penalty favours what was seen
  EXPECT_EQ(greedy(p, {0}), 0);
  p = SamplingParams{};
  p.frequency_penalty = 3;
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(LlamaServer, LogitBiasForcesAndBans) {
  auto s = start(options());
  const json base = {{"prompt", "Once upon a time"},
                     {"temperature", 0},
                     {"n_predict", 4},
                     {"ignore_eos", true},
                     {"return_tokens", true}};
  const json plain = post_ok(*s, "/completion", base);
  ASSERT_EQ(plain["tokens"].size(), 4u);
  const int32_t first = plain["tokens"][0];
  const int32_t forced =
      vocab_id("\u2581the") == first ? vocab_id("\u2581and") : vocab_id("\u2581the");
  json b = base;
  b["logit_bias"] = {{std::to_string(forced), 100}};
  const json f = post_ok(*s, "/completion", b);
  EXPECT_EQ(f["tokens"], json::array({forced, forced, forced, forced}));
  b["logit_bias"] = json::array({json::array({first, -100})});  // llama.cpp's form
  const json banned = post_ok(*s, "/completion", b);
  ASSERT_EQ(banned["tokens"].size(), 4u);
  for (const json& t : banned["tokens"]) EXPECT_NE(t.get<int32_t>(), first);
  // Also on the OpenAI routes, and in the constrained path (a JSON object is forced; its text
  // can hold no banned token).
  const json chat = post_ok(*s, "/v1/chat/completions",
                            {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                             {"temperature", 0},
                             {"max_tokens", 3},
                             {"logit_bias", {{std::to_string(forced), 100}}}});
  const json tok =
      post_ok(*s, "/tokenize", {{"content", chat["choices"][0]["message"]["content"]}});
  EXPECT_EQ(tok["tokens"], json::array({forced, forced, forced}));
  const json brace = post_ok(*s, "/tokenize", {{"content", "{"}});
  ASSERT_EQ(brace["tokens"].size(), 1u);
  const json constrained =
      post_ok(*s, "/v1/chat/completions",
              {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
               {"temperature", 0},
               {"max_tokens", 8},
               {"response_format", {{"type", "json_object"}}},
               {"logit_bias", {{std::to_string(brace["tokens"][0].get<int>()), -100}}}});
  // Without the bias the grammar's first token is "{" itself; banned, the reply holds no such
  // token, and whatever it wrote is still the start of a JSON object (whitespace may lead).
  const std::string text = constrained["choices"][0]["message"]["content"];
  const json retokenized = post_ok(*s, "/tokenize", {{"content", text}});
  for (const json& t : retokenized["tokens"]) EXPECT_NE(t, brace["tokens"][0]) << text;
  const size_t first_char = text.find_first_not_of(" \t\r\n");
  if (first_char != std::string::npos) {
    EXPECT_EQ(text[first_char], '{') << text;
  }
  auto bad = client(*s).Post("/completion",
                             json({{"prompt", "x"}, {"logit_bias", {{"99999999", 1}}}}).dump(),
                             "application/json");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_EQ(json::parse(bad->body)["error"]["param"], "logit_bias");
}

// The access log: one line per request once its reply went out, streamed replies included, with
// the counts the reply's usage gives, the time to the first token and an error's code.
// Lines in a log file, waiting up to ten seconds for `want` of them: a request's line is written
// once its reply has gone out, which the client of a streamed reply can see before the line lands.
size_t wait_for_log_lines(const std::string& path, size_t want) {
  size_t have = 0;
  for (int tries = 0; tries < 1000; ++tries) {
    std::ifstream in(path);
    have = 0;
    for (std::string line; std::getline(in, line);) ++have;
    if (have >= want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return have;
}

TEST(LlamaServer, AccessLogWritesALinePerRequest) {
  const std::string dir = temp_dir("access_log");
  const json body = {
      {"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"temperature", 0}, {"max_tokens", 4}};
  json streamed = body;
  streamed["stream"] = true;
  json whole;
  for (const std::string format : {"json", "text"}) {
    ServerOptions o = options();
    o.access_log_format = format;
    o.access_log_path = dir + "/" + format + ".log";
    auto s = start(o);
    // Each request waits for the one before it to be logged, so the lines keep request order.
    whole = post_ok(*s, "/v1/chat/completions", body);
    ASSERT_EQ(wait_for_log_lines(o.access_log_path, 1), 1u);
    auto r = client(*s).Post("/v1/chat/completions", streamed.dump(), "application/json");
    ASSERT_TRUE(r && r->status == 200);
    ASSERT_EQ(wait_for_log_lines(o.access_log_path, 2), 2u);
    auto bad = client(*s).Post("/v1/chat/completions", R"({"messages": 3})", "application/json");
    ASSERT_TRUE(bad);
    EXPECT_EQ(bad->status, 400);
    s.reset();  // the library's threads end, so every line is written
  }
  const int64_t prompt = whole["usage"]["prompt_tokens"],
                generated = whole["usage"]["completion_tokens"];
  std::vector<json> lines;
  {
    std::ifstream in(dir + "/json.log");
    for (std::string line; std::getline(in, line);) lines.push_back(json::parse(line));
  }
  ASSERT_EQ(lines.size(), 3u);
  for (int i = 0; i < 2; ++i) {
    const json& l = lines[i];
    EXPECT_EQ(l["method"], "POST");
    EXPECT_EQ(l["path"], "/v1/chat/completions");
    EXPECT_EQ(l["status"], 200);
    EXPECT_EQ(l["remote"], "127.0.0.1");
    EXPECT_EQ(l["prompt_tokens"], prompt) << l;
    EXPECT_EQ(l["generated_tokens"], generated) << l;
    // The streamed repeat found all its prompt rows but the last in a slot's caches.
    EXPECT_EQ(l["cached_tokens"], i == 0 ? 0 : prompt - 1) << l;
    EXPECT_GT(l["ttft_ms"].get<double>(), 0) << l;
    EXPECT_GE(l["duration_ms"].get<double>(), l["ttft_ms"].get<double>()) << l;
    if (generated > 1) {
      EXPECT_GT(l["tokens_per_second"].get<double>(), 0) << l;
    }
    EXPECT_FALSE(l.contains("error")) << l;
    EXPECT_EQ(l["time"].get<std::string>().back(), 'Z') << l;
  }
  EXPECT_EQ(lines[2]["status"], 400);
  EXPECT_FALSE(lines[2]["error"].get<std::string>().empty()) << lines[2];
  EXPECT_FALSE(lines[2].contains("prompt_tokens")) << lines[2];

  std::ifstream text_file(dir + "/text.log");
  const std::string text((std::istreambuf_iterator<char>(text_file)),
                         std::istreambuf_iterator<char>());
  const std::regex ok_line(R"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z 127\.0\.0\.1 POST )"
                           R"(/v1/chat/completions 200 [\d.]+ms prompt=(\d+) cached=\d+ )"
                           R"(generated=(\d+) ttft=[\d.]+ms.*)");
  const std::regex bad_line(R"(.* POST /v1/chat/completions 400 [\d.]+ms error=\S+)");
  std::istringstream in(text);
  std::vector<std::string> text_lines;
  for (std::string line; std::getline(in, line);) text_lines.push_back(line);
  ASSERT_EQ(text_lines.size(), 3u) << text;
  std::smatch m;
  ASSERT_TRUE(std::regex_match(text_lines[0], m, ok_line)) << text_lines[0];
  EXPECT_EQ(std::stoll(m[1]), prompt);
  EXPECT_EQ(std::stoll(m[2]), generated);
  EXPECT_TRUE(std::regex_match(text_lines[1], ok_line)) << text_lines[1];
  EXPECT_TRUE(std::regex_match(text_lines[2], bad_line)) << text_lines[2];
}

// One rule for text that is not UTF-8: a logprob's token reads as the reply's text reads the same
// bytes (Hugging Face's byte fallback, one U+FFFD per byte of an ill-formed run), its `bytes`
// stay raw.
TEST(LlamaServer, LogprobTokenTextFollowsTheDecodersReplacementRule) {
  const Tokenizer t = Tokenizer::from_model_dir(fixture("model"));
  const int32_t lead = *t.token_to_id("<0xC3>"), tail = *t.token_to_id("<0xA9>");
  const std::vector<TokenLogprob> tokens = {{lead, -0.5f, {}}, {tail, -0.25f, {}}};
  const json content = logprobs_json(t, tokens)["content"];
  ASSERT_EQ(content.size(), 2u);
  EXPECT_EQ(content[0]["token"], t.decode(std::vector<int32_t>{lead}));
  EXPECT_EQ(content[0]["token"], "\xEF\xBF\xBD");
  EXPECT_EQ(content[0]["bytes"], json::array({0xC3}));
  EXPECT_EQ(content[1]["token"], t.decode(std::vector<int32_t>{tail}));
  EXPECT_EQ(content[1]["bytes"], json::array({0xA9}));
  // The two bytes together are the character the reply's text holds.
  EXPECT_EQ(t.decode(std::vector<int32_t>{lead, tail}), "\u00e9");
  EXPECT_EQ(utf8::byte_run_text("\xE2\x82"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(utf8::byte_run_text("ok"), "ok");
}

// llama.cpp's schema spellings are applied, not dropped: a "schema" beside json_object, and the
// top-level "json_schema" of its native route; a GBNF "grammar" is refused, naming the field.
TEST(LlamaServer, SchemasInLlamaCppsSpellingsConstrainTheReply) {
  auto s = start(options());
  const json constant = {{"const", "forty-two"}};
  const json chat = post_ok(*s, "/v1/chat/completions",
                            {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                             {"max_tokens", 24},
                             {"response_format", {{"type", "json_object"}, {"schema", constant}}}});
  EXPECT_EQ(json::parse(chat["choices"][0]["message"]["content"].get<std::string>()), "forty-two")
      << chat;
  const json native =
      post_ok(*s, "/completion", {{"prompt", "Hi"}, {"n_predict", 24}, {"json_schema", constant}});
  EXPECT_EQ(json::parse(native["content"].get<std::string>()), "forty-two") << native;
  for (const json& bad :
       {json{{"grammar", "root ::= \"a\""}},
        json{{"json_schema", constant}, {"response_format", {{"type", "json_object"}}}}}) {
    json body = {{"prompt", "Hi"}};
    body.update(bad);
    auto r = client(*s).Post("/completion", body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    const std::string param = json::parse(r->body)["error"]["param"];
    EXPECT_TRUE(param == "grammar" || param == "json_schema") << r->body;
  }
}

// OpenAI's `n`: three greedy choices each equal the reply a request alone gets, usage counts
// the prompt once and every choice's tokens; more than the slots, or streamed, is a 400 naming n.
TEST(LlamaServer, NChoicesEachEqualAGreedyReplyAlone) {
  ServerOptions o = options();
  o.parallel = 3;
  auto s = start(o);
  for (const char* route : {"/v1/chat/completions", "/v1/completions"}) {
    const bool chat = std::string(route) == "/v1/chat/completions";
    json body = {{"temperature", 0}, {"max_tokens", 6}};
    if (chat)
      body["messages"] = {{{"role", "user"}, {"content", "Say something"}}};
    else
      body["prompt"] = "Once upon";
    const json alone = post_ok(*s, route, body);
    body["n"] = 3;
    const json three = post_ok(*s, route, body);
    ASSERT_EQ(three["choices"].size(), 3u) << three;
    const auto text = [chat](const json& choice) {
      return chat ? choice["message"]["content"] : choice["text"];
    };
    for (int i = 0; i < 3; ++i) {
      EXPECT_EQ(three["choices"][i]["index"], i);
      EXPECT_EQ(text(three["choices"][i]), text(alone["choices"][0])) << three;
      EXPECT_EQ(three["choices"][i]["finish_reason"], alone["choices"][0]["finish_reason"]);
    }
    EXPECT_EQ(three["usage"]["prompt_tokens"], alone["usage"]["prompt_tokens"]);
    EXPECT_EQ(three["usage"]["completion_tokens"].get<int64_t>(),
              3 * alone["usage"]["completion_tokens"].get<int64_t>());
    EXPECT_GT(alone["usage"]["completion_tokens"].get<int64_t>(), 0);
    for (const json& bad : {json{{"n", 4}}, json{{"n", 2}, {"stream", true}}}) {
      json b = body;
      b.update(bad);
      auto r = client(*s).Post(route, b.dump(), "application/json");
      ASSERT_TRUE(r);
      EXPECT_EQ(r->status, 400) << r->body;
      EXPECT_EQ(json::parse(r->body)["error"]["param"], "n") << r->body;
    }
  }
  // Sampled choices differ from one another: each counts the seed on from the request's.
  const json sampled = post_ok(
      *s, "/v1/completions",
      {{"prompt", "Once upon"}, {"temperature", 1.5}, {"seed", 7}, {"max_tokens", 12}, {"n", 3}});
  std::set<std::string> texts;
  for (const json& c : sampled["choices"]) texts.insert(c["text"].get<std::string>());
  EXPECT_GT(texts.size(), 1u) << sampled;
}

// A forced tool call on a model whose tokenizer lacks Gemma 4's call tokens (the tiny fixture's
// 2k vocabulary) is refused when the request is checked, naming the missing token, instead of
// failing mid-generation.
TEST(LlamaServer, ForcedToolCallWithoutTheCallTokensIsA400) {
  auto s = start(options());
  const json tools = json::parse(R"([{"type":"function","function":{"name":"get_time",
      "parameters":{"type":"object","properties":{"tz":{"type":"string"}}}}}])");
  for (const json& choice :
       {json("required"), json({{"type", "function"}, {"function", {{"name", "get_time"}}}})}) {
    auto r = client(*s).Post("/v1/chat/completions",
                             json({{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                                   {"tools", tools},
                                   {"tool_choice", choice}})
                                 .dump(),
                             "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400) << r->body;
    const json e = json::parse(r->body)["error"];
    EXPECT_EQ(e["param"], "tool_choice");
    EXPECT_EQ(e["code"], "unsupported_value");
    EXPECT_NE(e["message"].get<std::string>().find("<|tool_call>"), std::string::npos) << e;
  }
  // tool_choice auto still answers: the model may simply not call.
  const json ok = post_ok(
      *s, "/v1/chat/completions",
      {{"messages", {{{"role", "user"}, {"content", "Hi"}}}}, {"tools", tools}, {"max_tokens", 4}});
  EXPECT_EQ(ok["object"], "chat.completion");
}

}  // namespace
