// `gemstage serve -md`: speculative decoding inside the batched engine, against the MTP drafter
// fixtures (tests/fixtures/gemma4-tiny-assistant). The fixture prompts are token ids the tiny
// tokenizer does not name, so the tests serve the tiny target with a copy of its tokenizer that
// names every id i as the added token "<ti>": a raw prompt of such names is exactly the fixture's
// prompt, and a reply's text spells its ids. Then the served greedy ids are the fixture target's
// own greedy ids, and the rounds, drafts and acceptances the server counts are the fixture's
// (with a constant draft length, --no-draft-adapt).
#include <gtest/gtest.h>
#include <httplib.h>

#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <thread>

#include "runtime/generation.h"
#include "server/api.h"
#include "server/server.h"
#include "server_test_util.h"
#include "stage/bundle.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::server;
using namespace gemstage::testing;
using json = nlohmann::json;

namespace {

std::string assistant_fixture(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-assistant/" + rel;
}

// The tiny target with a tokenizer that names every id: "<t900>" is id 900 (the ids the original
// tokenizer names as special keep their names).
const std::string& id_named_model() {
  static const std::string dir = [] {
    const std::string d = temp_dir("spec_id_tokenizer");
    namespace fs = std::filesystem;
    for (const char* f :
         {"config.json", "model.safetensors", "tokenizer_config.json", "preprocessor_config.json"})
      fs::create_symlink(fs::absolute(fixture("model/" + std::string(f))), d + "/" + f);
    std::ifstream in(fixture("model/tokenizer.json"));
    json t = json::parse(in);
    std::set<int> named;
    for (const json& a : t["added_tokens"]) named.insert(a["id"].get<int>());
    std::ifstream cfg(fixture("model/config.json"));
    const json c = json::parse(cfg);
    const int vocab = c.contains("text_config") ? c["text_config"]["vocab_size"].get<int>()
                                                : c["vocab_size"].get<int>();
    for (int i = 0; i < vocab; ++i)
      if (!named.count(i))
        t["added_tokens"].push_back({{"id", i},
                                     {"content", "<t" + std::to_string(i) + ">"},
                                     {"single_word", false},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"normalized", false},
                                     {"special", false}});
    std::ofstream(d + "/tokenizer.json") << t.dump();
    return d;
  }();
  return dir;
}

// The ids a reply's text spells (special ids are not in a completion's text); the text must
// be nothing but such names.
std::vector<int32_t> ids_of(const std::string& text) {
  std::vector<int32_t> out;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i + 2;
    while (j < text.size() && std::isdigit(static_cast<unsigned char>(text[j]))) ++j;
    if (text.compare(i, 2, "<t") != 0 || j == i + 2 || j >= text.size() || text[j] != '>') {
      ADD_FAILURE() << "text that is not an id name at " << i << ": " << text;
      break;
    }
    out.push_back(std::stoi(text.substr(i + 2, j - i - 2)));
    i = j + 1;
  }
  return out;
}

struct SpecFixture {
  std::vector<int32_t> prompt, greedy;  // greedy without the ids a reply's text leaves out
  int64_t rounds = 0, drafted = 0, accepted = 0;
  std::string prompt_text() const {
    std::string s;
    for (size_t i = 1; i < prompt.size(); ++i) s += "<t" + std::to_string(prompt[i]) + ">";
    return s;  // the server puts <bos> (prompt[0]) first
  }
};

SpecFixture spec_fixture(const std::string& name) {
  const std::string d = assistant_fixture(name) + "/";
  SpecFixture f;
  f.prompt = load_ids(d + "input_ids.npy");
  EXPECT_EQ(f.prompt.at(0), 2);  // <bos>
  const std::set<int32_t> special = {0, 1, 2, 3, 105, 106, 2000, 2040, 2041, 2042, 2044};
  for (int32_t id : load_ids(d + "greedy_ids.npy"))
    if (!special.count(id)) f.greedy.push_back(id);
  const std::vector<int32_t> n = load_ids(d + "spec_round_num_drafts.npy");
  const std::vector<int32_t> a = load_ids(d + "spec_round_accepted.npy");
  for (size_t r = 0; r < n.size(); ++r) {
    f.rounds += n[r] > 0 ? 1 : 0;
    f.drafted += n[r];
    f.accepted += a[r];
  }
  return f;
}

ServerOptions spec_options(bool with_drafter = true) {
  ServerOptions o;
  o.model_path = id_named_model();
  o.port = 0;
  o.parallel = 3;
  o.threads = 2;
  o.defaults.max_tokens = 16;  // the fixtures' n_new
  o.defaults.sampling.temperature = 0;
  o.ignore_eos = true;  // the fixtures treat EOS as an ordinary token
  o.shutdown_grace_seconds = 1;
  if (with_drafter) {
    o.model_draft = assistant_fixture("assistant_e");
    o.draft_max = 4;  // the fixtures' K
    o.draft_adapt = false;
  }
  return o;
}

std::unique_ptr<Server> start(ServerOptions o) {
  return start_server(std::move(o));
}
httplib::Result post(const Server& s, const std::string& path, const json& body) {
  return post_json(s, path, body);
}

json health(const Server& s) {
  httplib::Client c("127.0.0.1", s.port());
  const auto r = c.Get("/health");
  EXPECT_TRUE(r && r->status == 200);
  return r ? json::parse(r->body) : json();
}

// The text of a streamed completion; also counts its text chunks.
std::string streamed_text(const std::string& body, int* chunks = nullptr) {
  std::string text;
  size_t at = 0;
  while (at < body.size()) {
    size_t end = body.find("\n\n", at);
    if (end == std::string::npos) end = body.size();
    const std::string ev = body.substr(at, end - at);
    at = end + 2;
    if (ev.rfind("data: ", 0) != 0 || ev == "data: [DONE]") continue;
    const json c = json::parse(ev.substr(6));
    const std::string piece = c["choices"][0].value("text", "");
    if (!piece.empty() && chunks) ++*chunks;
    text += piece;
  }
  return text;
}

json completion(const Server& s, const SpecFixture& f, const json& extra = json::object()) {
  json body = {{"prompt", f.prompt_text()}};
  body.update(extra);
  const auto r = post(s, "/v1/completions", body);
  EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
  return r && r->status == 200 ? json::parse(r->body) : json();
}

void expect_400(const httplib::Result& r, const std::string& param) {
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  const json e = json::parse(r->body)["error"];
  EXPECT_EQ(e["param"], param) << r->body;
  EXPECT_NE(e["message"].get<std::string>().find(param), std::string::npos) << r->body;
}

// A Messages-route refusal: Anthropic's error shape, which names the field in its message.
void expect_messages_400(const httplib::Result& r, const std::string& param) {
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  const json b = json::parse(r->body);
  EXPECT_EQ(b.value("type", ""), "error") << r->body;
  const json e = b.value("error", json::object());
  EXPECT_EQ(e.value("type", ""), "invalid_request_error") << r->body;
  EXPECT_NE(e.value("message", "").find(param), std::string::npos) << r->body;
}

TEST(ServerSpeculative, ParsesTheSpeculativeFields) {
  const json base = {{"prompt", "hi"}};
  auto with = [&](const json& extra) {
    json b = base;
    b.update(extra);
    return b;
  };
  const CompletionRequest r =
      parse_completion_request(with({{"speculative.n_max", 3}, {"speculative.n_min", 2}}));
  EXPECT_EQ(r.sampling.draft_max, 3);
  EXPECT_EQ(r.sampling.draft_min, 2);
  const ChatRequest c = parse_chat_request(
      {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"speculative.n_max", 0}});
  EXPECT_EQ(c.sampling.draft_max, 0);
  EXPECT_FALSE(c.sampling.draft_min);
  EXPECT_FALSE(parse_completion_request(base).sampling.draft_max);
  const std::vector<std::pair<json, std::string>> bad = {
      {{{"speculative.n_max", -1}}, "speculative.n_max"},
      {{{"speculative.n_max", kMaxDraftsPerRound + 1}}, "speculative.n_max"},
      {{{"speculative.n_max", "4"}}, "speculative.n_max"},
      {{{"speculative.n_min", 1.5}}, "speculative.n_min"},
      {{{"speculative.n_max", 2}, {"speculative.n_min", 3}}, "speculative.n_min"},
      {{{"speculative", {{"n_max", 4}}}}, "speculative"},
  };
  for (const auto& [extra, param] : bad) {
    try {
      parse_completion_request(with(extra));
      ADD_FAILURE() << "accepted " << extra.dump();
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400) << extra.dump();
      EXPECT_EQ(e.param(), param) << extra.dump();
    }
  }
}

// Greedy replies with drafting are the target's own greedy ids, and the server's rounds are the
// fixture's, while a request that turned drafting off runs in the same engine at the same time.
TEST(ServerSpeculative, GreedyDraftedRepliesAreTheTargetsWhileAPlainOneRuns) {
  const SpecFixture text = spec_fixture("e_text"), longer = spec_fixture("e_long");
  auto s = start(spec_options());
  std::string drafted_stream, plain_stream;
  json drafted_long;
  int chunks = 0;
  {
    std::vector<std::thread> clients;
    clients.emplace_back([&] {
      const auto r =
          post(*s, "/v1/completions", {{"prompt", text.prompt_text()}, {"stream", true}});
      if (r && r->status == 200) drafted_stream = streamed_text(r->body, &chunks);
    });
    clients.emplace_back([&] { drafted_long = completion(*s, longer); });
    clients.emplace_back([&] {
      const auto r =
          post(*s, "/v1/completions",
               {{"prompt", text.prompt_text()}, {"stream", true}, {"speculative.n_max", 0}});
      if (r && r->status == 200) plain_stream = streamed_text(r->body);
    });
    for (auto& t : clients) t.join();
  }
  EXPECT_EQ(ids_of(drafted_stream), text.greedy);
  EXPECT_EQ(ids_of(plain_stream), text.greedy);
  ASSERT_TRUE(drafted_long.contains("choices"));
  EXPECT_EQ(ids_of(drafted_long["choices"][0]["text"]), longer.greedy);
  EXPECT_EQ(drafted_long["usage"]["completion_tokens"], 16);
  EXPECT_GT(chunks, 1);  // streamed as tokens were accepted, not all at the end
  // Exactly the fixtures' rounds: the plain request drafted nothing.
  const json spec = health(*s)["speculative"];
  EXPECT_EQ(spec["rounds"], text.rounds + longer.rounds) << spec;
  EXPECT_EQ(spec["drafted"], text.drafted + longer.drafted) << spec;
  EXPECT_EQ(spec["accepted"], text.accepted + longer.accepted) << spec;
  ASSERT_GT(text.accepted, 0);  // rounds that accept several drafts were served
  httplib::Client c("127.0.0.1", s->port());
  const std::string m = c.Get("/metrics")->body;
  EXPECT_NE(m.find("\ngemstage_draft_accepted_total " +
                   std::to_string(text.accepted + longer.accepted) + "\n"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("\ngemstage_draft_tokens_total " +
                   std::to_string(text.drafted + longer.drafted) + "\n"),
            std::string::npos)
      << m;
}

// A bundle's drafter stage (export -md) drafts in the server as the checkpoint does, unless
// turned off.
TEST(ServerSpeculative, ABundlesDrafterStageDrafts) {
  const SpecFixture f = spec_fixture("e_text");
  const std::string bundle = temp_dir("spec_bundle");
  ExportOptions e;
  e.stages = "2";
  e.weights = "f32";
  e.progress = false;
  e.force = true;
  e.drafter = assistant_fixture("assistant_e");
  export_bundle(id_named_model(), bundle, e);
  ServerOptions o = spec_options(false);
  o.model_path = bundle;
  o.draft_adapt = false;
  {
    auto s = start(o);
    EXPECT_EQ(ids_of(completion(*s, f)["choices"][0]["text"]), f.greedy);
    const json spec = health(*s)["speculative"];
    EXPECT_NE(spec["draft_model"].get<std::string>().find("drafter"), std::string::npos) << spec;
    EXPECT_EQ(spec["rounds"], f.rounds) << spec;
    EXPECT_EQ(spec["accepted"], f.accepted) << spec;
  }
  o.bundle_drafter = false;
  auto s = start(o);
  EXPECT_EQ(ids_of(completion(*s, f)["choices"][0]["text"]), f.greedy);
  EXPECT_FALSE(health(*s).contains("speculative"));
}

// max_tokens and stop strings end a reply inside a round exactly where plain decoding ends it;
// per-request draft lengths give the same ids; the off switch drafts nothing.
TEST(ServerSpeculative, MaxTokensStopStringsAndThePerRequestSwitch) {
  const SpecFixture f = spec_fixture("e_text");
  auto s = start(spec_options());
  for (int n : {1, 2, 3, 4, 6, 7, 9, 13}) {
    const json r = completion(*s, f, {{"max_tokens", n}});
    ASSERT_TRUE(r.contains("choices"));
    EXPECT_EQ(r["usage"]["completion_tokens"], n);
    EXPECT_EQ(r["choices"][0]["finish_reason"], "length");
    // The fixture's greedy ids leave out one special id (2044) at index 7.
    const std::vector<int32_t> want(f.greedy.begin(), f.greedy.begin() + (n > 7 ? n - 1 : n));
    EXPECT_EQ(ids_of(r["choices"][0]["text"]), want) << "max_tokens " << n;
  }
  // A stop string in the middle of the round that accepts all four drafts (ids 2..6).
  const std::string stop = "<t" + std::to_string(f.greedy.at(4)) + ">";
  const json cut = completion(*s, f, {{"stop", stop}});
  const json cut_plain = completion(*s, f, {{"stop", stop}, {"speculative.n_max", 0}});
  EXPECT_EQ(cut["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(cut["choices"][0]["text"], cut_plain["choices"][0]["text"]);
  EXPECT_EQ(ids_of(cut["choices"][0]["text"]),
            std::vector<int32_t>(f.greedy.begin(), f.greedy.begin() + 4));
  for (int k : {1, 2, 3}) {
    const json r = completion(*s, f, {{"speculative.n_max", k}, {"speculative.n_min", 1}});
    EXPECT_EQ(ids_of(r["choices"][0]["text"]), f.greedy) << "n_max " << k;
  }
  const json before = health(*s)["speculative"];
  completion(*s, f, {{"speculative.n_max", 0}});
  EXPECT_EQ(health(*s)["speculative"]["rounds"], before["rounds"]);
}

// Each token's logprobs come from its own verify row: the same as plain decoding's. Sampling
// with drafts runs (its distribution is tested in speculative_test.cc).
TEST(ServerSpeculative, LogprobsAndSampling) {
  const SpecFixture f = spec_fixture("e_text");
  auto s = start(spec_options());
  auto chat = [&](const json& extra) {
    json body = {{"messages", {{{"role", "user"}, {"content", f.prompt_text()}}}},
                 {"logprobs", true},
                 {"top_logprobs", 2}};
    body.update(extra);
    const auto r = post(*s, "/v1/chat/completions", body);
    EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "");
    return r && r->status == 200 ? json::parse(r->body)["choices"][0] : json();
  };
  const int64_t rounds_before = health(*s)["speculative"]["rounds"].get<int64_t>();
  const json drafted = chat(json::object()), plain = chat({{"speculative.n_max", 0}});
  EXPECT_GT(health(*s)["speculative"]["rounds"].get<int64_t>(), rounds_before);
  EXPECT_EQ(drafted["message"]["content"], plain["message"]["content"]);
  const json& a = drafted["logprobs"]["content"];
  const json& b = plain["logprobs"]["content"];
  ASSERT_EQ(a.size(), b.size());
  ASSERT_EQ(a.size(), 16u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i]["token"], b[i]["token"]) << i;
    EXPECT_NEAR(a[i]["logprob"].get<double>(), b[i]["logprob"].get<double>(), 1e-4) << i;
    ASSERT_EQ(a[i]["top_logprobs"].size(), 2u);
    EXPECT_EQ(a[i]["top_logprobs"][0]["token"], b[i]["top_logprobs"][0]["token"]) << i;
  }
  const json sampled = completion(*s, f, {{"temperature", 0.8}, {"seed", 5}, {"max_tokens", 12}});
  EXPECT_EQ(sampled["usage"]["completion_tokens"], 12);
}

// What the drafter cannot serve: a server without one refuses a request that asks for drafts;
// constrained output decodes plainly, images draft; a drafter that does not fit the target is
// refused at load, naming both.
TEST(ServerSpeculative, RequestsAndDraftersItCannotServe) {
  const SpecFixture f = spec_fixture("e_text");
  {
    auto plain = start(spec_options(false));
    expect_400(post(*plain, "/v1/completions", {{"prompt", "hi"}, {"speculative.n_max", 4}}),
               "speculative.n_max");
    expect_400(post(*plain, "/v1/chat/completions",
                    {{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                     {"speculative.n_max", 2},
                     {"speculative.n_min", 3}}),
               "speculative.n_min");
    expect_messages_400(post(*plain, "/v1/messages",
                             {{"max_tokens", 4},
                              {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                              {"speculative.n_max", 4}}),
                        "speculative.n_max");
    expect_400(post(*plain, "/v1/responses", {{"input", "hi"}, {"speculative.n_max", 4}}),
               "speculative.n_max");
    EXPECT_EQ(completion(*plain, f, {{"speculative.n_max", 0}})["usage"]["completion_tokens"], 16);
    EXPECT_FALSE(health(*plain).contains("speculative"));
  }
  // The tiny target with its own tokenizer (the JSON constraint needs real token texts).
  ServerOptions real = spec_options();
  real.model_path = fixture("model");
  auto s = start(real);
  std::ifstream png(std::string(GEMSTAGE_FIXTURES) + "/image/decode/rgb_interlaced.png",
                    std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(png)), {});
  const std::string url =
      "data:image/png;base64," +
      encode_base64(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  const auto constrained = post(*s, "/v1/chat/completions",
                                {{"messages", {{{"role", "user"}, {"content", f.prompt_text()}}}},
                                 {"response_format", {{"type", "json_object"}}},
                                 {"max_tokens", 8}});
  ASSERT_TRUE(constrained && constrained->status == 200) << (constrained ? constrained->body : "");
  EXPECT_EQ(health(*s)["speculative"]["rounds"], 0);
  // A prompt with an image drafts (its rows prefilled as usual, read by the drafter through the
  // target's caches), and its greedy reply is the one plain decoding gives.
  const json image_body = {{"messages",
                            {{{"role", "user"},
                              {"content",
                               {{{"type", "image_url"}, {"image_url", {{"url", url}}}},
                                {{"type", "text"}, {"text", "What is this?"}}}}}}},
                           {"max_tokens", 12}};
  const auto image = post(*s, "/v1/chat/completions", image_body);
  ASSERT_TRUE(image && image->status == 200) << (image ? image->body : "");
  EXPECT_GT(health(*s)["speculative"]["rounds"], 0);
  json plain_body = image_body;
  plain_body["speculative.n_max"] = 0;
  const auto image_plain = post(*s, "/v1/chat/completions", plain_body);
  ASSERT_TRUE(image_plain && image_plain->status == 200);
  EXPECT_EQ(json::parse(image->body)["choices"][0]["message"],
            json::parse(image_plain->body)["choices"][0]["message"]);

  ServerOptions mismatched = spec_options();
  mismatched.model_draft = assistant_fixture("assistant_dense");
  Server bad(mismatched);
  bad.start();
  EXPECT_FALSE(bad.wait_loaded());
  EXPECT_NE(bad.load_error().find("assistant_dense"), std::string::npos) << bad.load_error();
  EXPECT_NE(bad.load_error().find(id_named_model()), std::string::npos) << bad.load_error();
}

// /v1/messages and /v1/responses take the per-request keys as chat completions does: a drafted
// reply is the plain one, drafting at most n_max per round; n_max 0 drafts nothing; bad values
// are refused in the route's error shape, naming the field.
TEST(ServerSpeculative, MessagesAndResponsesTakeThePerRequestSwitch) {
  const SpecFixture f = spec_fixture("e_text");
  auto s = start(spec_options());
  struct Route {
    std::string path;
    json body;
  };
  const std::vector<Route> routes = {
      {"/v1/messages",
       {{"max_tokens", 16}, {"messages", {{{"role", "user"}, {"content", f.prompt_text()}}}}}},
      {"/v1/responses", {{"max_output_tokens", 16}, {"input", f.prompt_text()}}}};
  for (const Route& route : routes) {
    SCOPED_TRACE(route.path);
    const bool messages = route.path == "/v1/messages";
    // The reply's content blocks or output items, without the ids each reply draws afresh.
    auto reply = [&](const json& extra) {
      json body = route.body;
      body.update(extra);
      const auto r = post(*s, route.path, body);
      EXPECT_TRUE(r && r->status == 200) << (r ? r->body : "no reply");
      if (!r || r->status != 200) return json();
      const json j = json::parse(r->body);
      EXPECT_EQ(j["usage"]["output_tokens"], 16) << r->body;
      json out = j[messages ? "content" : "output"];
      for (json& item : out) item.erase("id");
      return out;
    };
    const json before = health(*s)["speculative"];
    const json drafted = reply({{"speculative.n_max", 2}, {"speculative.n_min", 1}});
    const json mid = health(*s)["speculative"];
    const int64_t rounds = mid["rounds"].get<int64_t>() - before["rounds"].get<int64_t>();
    EXPECT_GT(rounds, 0) << mid;
    // --draft-max is 4 and not adapted: two drafts a round at most only if n_max got through.
    EXPECT_LE(mid["drafted"].get<int64_t>() - before["drafted"].get<int64_t>(), 2 * rounds) << mid;
    const json plain = reply({{"speculative.n_max", 0}});
    EXPECT_EQ(health(*s)["speculative"]["rounds"], mid["rounds"]);
    ASSERT_FALSE(drafted.empty());
    EXPECT_EQ(drafted, plain);
    for (const auto& [extra, param] : std::vector<std::pair<json, std::string>>{
             {{{"speculative.n_max", kMaxDraftsPerRound + 1}}, "speculative.n_max"},
             {{{"speculative.n_min", -1}}, "speculative.n_min"},
             {{{"speculative", {{"n_max", 2}}}}, "speculative"}}) {
      json body = route.body;
      body.update(extra);
      if (messages)
        expect_messages_400(post(*s, route.path, body), param);
      else
        expect_400(post(*s, route.path, body), param);
    }
  }
}

// TokenStream::next_verified takes a round's tokens one by one as next() would: a round that
// accepts more than max_tokens allows is cut, and so is one that reaches a stop string.
TEST(ServerSpeculative, TokenStreamCutsARoundAtMaxTokensAndStopStrings) {
  const Tokenizer tok = Tokenizer::from_model_dir(id_named_model());
  constexpr int64_t V = 2048;
  // Rows whose argmax are `ids`.
  auto rows = [&](const std::vector<int32_t>& ids) {
    std::vector<float> l(ids.size() * V, 0.0f);
    for (size_t r = 0; r < ids.size(); ++r) l[r * V + static_cast<size_t>(ids[r])] = 5.0f;
    return l;
  };
  GenerationOptions opt;
  opt.sampling = SamplingParams::greedy();
  opt.max_tokens = 3;
  opt.top_logprobs = 1;
  {
    TokenStream st(&tok, {2, 900}, opt);
    const std::vector<float> first = rows({500});
    ASSERT_EQ(st.next(first.data(), V, true), 500);
    // Drafts 600 700 800 all agree, and the target's own token is 900: five tokens, but
    // max_tokens leaves room for two.
    const std::vector<float> verify = rows({600, 700, 800, 900});
    const std::vector<int32_t> drafts = {600, 700, 800};
    int accepted = -1;
    const auto next = st.next_verified(
        verify.data(), V, drafts, [](int64_t) { return true; }, {}, &accepted);
    EXPECT_EQ(accepted, 3);
    EXPECT_FALSE(next);
    EXPECT_EQ(st.result().tokens, (std::vector<int32_t>{500, 600, 700}));
    EXPECT_EQ(st.result().text, "<t500><t600><t700>");
    EXPECT_EQ(st.result().finish_reason, "length");
    EXPECT_EQ(st.result().logprobs.size(), 3u);
  }
  opt.max_tokens = 16;
  opt.stop_strings = {"<t700>"};
  {
    TokenStream st(&tok, {2, 900}, opt);
    const std::vector<float> first = rows({500});
    ASSERT_EQ(st.next(first.data(), V, true), 500);
    // The second draft is rejected (the target chose 650): 600 then 650 are taken.
    const std::vector<float> verify = rows({600, 650, 800});
    const std::vector<int32_t> drafts = {600, 700};
    int accepted = -1;
    auto next = st.next_verified(
        verify.data(), V, drafts, [](int64_t) { return true; }, {}, &accepted);
    EXPECT_EQ(accepted, 1);
    EXPECT_EQ(next, 650);
    // Then a round whose first accepted draft is the stop string.
    const std::vector<float> again = rows({700, 710});
    const std::vector<int32_t> one = {700};
    next = st.next_verified(
        again.data(), V, one, [](int64_t) { return true; }, {}, &accepted);
    EXPECT_FALSE(next);
    EXPECT_EQ(st.result().text, "<t500><t600><t650>");
    EXPECT_EQ(st.result().finish_reason, "stop");
  }
  {
    // An accepted draft that is a stop id ends the reply before it.
    opt.stop_strings.clear();
    opt.stop_ids = {106};
    TokenStream st(&tok, {2, 900}, opt);
    const std::vector<float> first = rows({500});
    ASSERT_EQ(st.next(first.data(), V, true), 500);
    const std::vector<float> verify = rows({600, 106, 800});
    const std::vector<int32_t> drafts = {600, 106};
    int accepted = -1;
    EXPECT_FALSE(st.next_verified(
        verify.data(), V, drafts, [](int64_t) { return true; }, {}, &accepted));
    EXPECT_EQ(accepted, 2);
    EXPECT_EQ(st.result().tokens, (std::vector<int32_t>{500, 600}));
    EXPECT_EQ(st.result().finish_reason, "stop");
    opt.stop_ids.clear();
  }
  {
    // No room for the row after the second token: the reply ends at the context limit.
    opt.stop_strings.clear();
    TokenStream st(&tok, {2, 900}, opt);
    const std::vector<float> first = rows({500});
    ASSERT_EQ(st.next(first.data(), V, true), 500);
    const std::vector<float> verify = rows({600, 700, 800});
    const std::vector<int32_t> drafts = {600, 700};
    int accepted = -1;
    EXPECT_FALSE(st.next_verified(
        verify.data(), V, drafts, [](int64_t j) { return j < 1; }, {}, &accepted));
    EXPECT_EQ(st.result().tokens, (std::vector<int32_t>{500, 600, 700}));
    EXPECT_EQ(st.result().finish_reason, "context");
  }
}

}  // namespace

namespace {

int run_cli(const std::string& args, const std::string& err) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > /dev/null 2> " + err;
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  return std::string((std::istreambuf_iterator<char>(f)), {});
}

TEST(ServerSpeculative, ServeDraftFlagsAreChecked) {
  const std::string dir = temp_dir("serve_cli_draft_flags");
  const std::string serve = "serve -m " + fixture("model") + " --port 0 ";
  EXPECT_NE(
      run_cli(serve + "-md " + assistant_fixture("assistant_e") + " --draft-max 65", dir + "/err"),
      0);
  EXPECT_NE(slurp(dir + "/err").find("draft-max"), std::string::npos) << slurp(dir + "/err");
  EXPECT_NE(run_cli(serve + "-md " + dir + "/missing", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("missing"), std::string::npos) << slurp(dir + "/err");
}

}  // namespace
