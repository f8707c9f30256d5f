// Constrained decoding (runtime/json_constraint.h): the matcher against hand-written valid and
// invalid JSON for each schema feature, the schema compiler's refusals, and the token mask
// against trying every token one by one; then random walks through the tiny tokenizer's
// vocabulary that must always end in text nlohmann parses and a hand-written validator accepts,
// and in forced tool calls the output parser reads back with valid arguments.
#include "runtime/json_constraint.h"

#include <gtest/gtest.h>

#include <random>

#include "test_util.h"
#include "tokenizer/chat_output.h"

using namespace gemstage;
using nlohmann::json;

namespace {

bool matches(const JsonGrammar& g, std::string_view text) {
  JsonMatcher m(g);
  return m.feed(text) && m.complete();
}

bool prefix_ok(const JsonGrammar& g, std::string_view text) {
  JsonMatcher m(g);
  return m.feed(text);
}

std::string refusal(const json& schema) {
  try {
    JsonGrammar::from_schema(schema);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

const json kPerson = json::parse(R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 5},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "ok": {"type": "boolean"},
    "note": {"type": ["string", "null"]}
  },
  "required": ["name", "age"],
  "additionalProperties": false
})");

// An independent check of kPerson, written from the schema, not from the matcher.
bool valid_person(const json& v) {
  if (!v.is_object()) return false;
  for (auto it = v.begin(); it != v.end(); ++it)
    if (it.key() != "name" && it.key() != "age" && it.key() != "tags" && it.key() != "ok" &&
        it.key() != "note")
      return false;
  if (!v.contains("name") || !v["name"].is_string()) return false;
  const size_t chars = [&] {
    size_t n = 0;
    for (unsigned char c : v["name"].get<std::string>()) n += (c & 0xC0) != 0x80;
    return n;
  }();
  if (chars < 1 || chars > 5) return false;
  if (!v.contains("age") || !v["age"].is_number_integer()) return false;
  if (v["age"].get<int64_t>() < 18 || v["age"].get<int64_t>() > 99) return false;
  if (v.contains("tags")) {
    if (!v["tags"].is_array() || v["tags"].size() > 2) return false;
    for (const json& t : v["tags"])
      if (t != "a" && t != "b") return false;
  }
  if (v.contains("ok") && !v["ok"].is_boolean()) return false;
  if (v.contains("note") && !v["note"].is_string() && !v["note"].is_null()) return false;
  return true;
}

}  // namespace

TEST(JsonConstraint, AnyObjectAcceptsJsonObjectsOnly) {
  const auto g = JsonGrammar::any_object();
  for (const char* ok :
       {R"({})", R"({"a": [1, -2.5e+3, "x\u00e9\n", true, null, {"b": {}}]})",
        "{\n  \"k\": \"caf\xC3\xA9 \xF0\x9F\x98\x80\"\n}", R"({"a":{"a":{"a":[]}}})"})
    EXPECT_TRUE(matches(*g, ok)) << ok;
  for (const char* bad : {"[1]", "1", R"("s")", R"({"a" 1})", R"({"a":1,})", R"({"a":1} x)",
                          R"({"a":01})", R"({"a":1.})", R"({"a":.5})", R"({"a":-})", R"({"a":1e})",
                          R"({"a":"\x"})", R"({'a':1})", "{\"a\":\"\x80\"}", "{\"a\":\"\xC0\x80\"}",
                          "{\"a\":\"\xED\xA0\x80\"}", "{\"a\":\"tab\there\"}", R"({"a":tru})"})
    EXPECT_FALSE(matches(*g, bad)) << bad;
  // Whitespace runs are bounded; so is nesting.
  EXPECT_TRUE(matches(*g, "{" + std::string(kMaxWhitespaceRun, ' ') + "}"));
  EXPECT_FALSE(prefix_ok(*g, "{" + std::string(kMaxWhitespaceRun + 1, ' ')));
  std::string deep = "{\"a\":";
  for (int i = 0; i < kMaxJsonDepth; ++i) deep += "[";
  EXPECT_FALSE(prefix_ok(*g, deep));
}

TEST(JsonConstraint, SchemaFeatures) {
  const auto g = JsonGrammar::from_schema(kPerson);
  for (const char* ok : {R"({"name":"bob","age":42})",
                         R"({"name": "bob", "age": 18, "tags": ["a", "b"], "ok": false})",
                         R"({"name":"\u00e9","age":99,"ok":true,"note":null})",
                         R"({"name":"b","age":42,"note":"x"})", R"({"age":42,"name":"bob"})"})
    EXPECT_TRUE(matches(*g, ok)) << ok;
  for (const char* bad :
       {R"({"name":"bob"})",  // missing required
        R"({"name":"bob","age":17})", R"({"name":"bob","age":100})", R"({"name":"bob","age":42.0})",
        R"({"name":"","age":42})", R"({"name":"toolong","age":42})",
        R"({"name":"b","age":42,"tags":["a","b","a"]})", R"({"name":"b","age":42,"tags":["c"]})",
        R"({"name":"b","age":42,"x":1})", R"({"name":"b","age":42,"ok":"yes"})",
        R"({"name":"b","age":42,"note":3})", R"({"name":"b","age":42,"name":"c"})"})
    EXPECT_FALSE(matches(*g, bad)) << bad;
  // Integer bounds prune digit by digit: "1" may still become 18, "10" can no longer fit.
  EXPECT_TRUE(prefix_ok(*g, R"({"name":"b","age":1)"));
  EXPECT_FALSE(prefix_ok(*g, R"({"name":"b","age":10)"));
  EXPECT_FALSE(prefix_ok(*g, R"({"name":"b","age":-)"));

  const auto numbers = JsonGrammar::from_schema(
      json::parse(R"({"type":"array","items":{"type":"integer","exclusiveMinimum":-3,
                      "exclusiveMaximum":3},"minItems":1})"));
  EXPECT_TRUE(matches(*numbers, "[-2,0,2]"));
  EXPECT_FALSE(matches(*numbers, "[]"));
  EXPECT_FALSE(matches(*numbers, "[3]"));
  EXPECT_FALSE(matches(*numbers, "[-3]"));
  // A number at the root may end where the text ends.
  const auto root_number = JsonGrammar::from_schema(json::parse(R"({"type":"number"})"));
  EXPECT_TRUE(matches(*root_number, "-0.25e10"));
  EXPECT_FALSE(matches(*root_number, "-"));
  // anyOf of different types, $ref into $defs, const, nullable.
  const auto refs = JsonGrammar::from_schema(json::parse(R"({
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}},
                        "required": ["x"]}},
    "type": "object",
    "properties": {
      "p": {"$ref": "#/$defs/point"},
      "q": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
      "kind": {"const": "pt"},
      "n": {"type": "string", "nullable": true}
    },
    "required": ["p", "q", "kind", "n"]})"));
  EXPECT_TRUE(matches(*refs, R"({"p":{"x":1},"q":null,"kind":"pt","n":null})"));
  EXPECT_TRUE(matches(*refs, R"({"p":{"x":1},"q":{"x":-5},"kind":"pt","n":"s"})"));
  EXPECT_FALSE(matches(*refs, R"({"p":{"x":1},"q":null,"kind":"pq","n":null})"));
  // No properties and additionalProperties false: only the empty object.
  const auto empty =
      JsonGrammar::from_schema(json::parse(R"({"type":"object","additionalProperties":false})"));
  EXPECT_TRUE(matches(*empty, "{}"));
  EXPECT_FALSE(matches(*empty, R"({"a":1})"));
  // A value schema for free keys.
  const auto dict = JsonGrammar::from_schema(
      json::parse(R"({"type":"object","additionalProperties":{"type":"integer"}})"));
  EXPECT_TRUE(matches(*dict, R"({"a":1,"b":2})"));
  EXPECT_FALSE(matches(*dict, R"({"a":"x"})"));
  // Positional items: 2020-12's prefixItems with items for the rest, draft-07's tuple items with
  // additionalItems; false for the rest closes the array after the positional ones.
  const auto pair = JsonGrammar::from_schema(json::parse(
      R"({"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],"items":false})"));
  EXPECT_TRUE(matches(*pair, R"(["a",1])"));
  EXPECT_TRUE(matches(*pair, R"(["a"])"));  // prefixItems alone requires nothing
  EXPECT_FALSE(matches(*pair, R"([1,"a"])"));
  EXPECT_FALSE(matches(*pair, R"(["a",1,2])"));
  const auto tuple = JsonGrammar::from_schema(json::parse(
      R"({"type":"array","items":[{"const":-3000}],"additionalItems":{"type":"boolean"},
          "minItems":2})"));
  EXPECT_TRUE(matches(*tuple, R"([-3000,true,false])"));
  EXPECT_FALSE(matches(*tuple, R"([-3000])"));
  EXPECT_FALSE(matches(*tuple, R"([-3000,1])"));
  EXPECT_FALSE(matches(*tuple, R"([3000,true])"));
  const auto open_tail = JsonGrammar::from_schema(json::parse(R"({"items":[{"type":"null"}]})"));
  EXPECT_TRUE(matches(*open_tail, R"([null,"x",{}])"));
  EXPECT_FALSE(matches(*open_tail, R"([0])"));
}

TEST(JsonConstraint, RefusesWhatItCannotEnforceNamingThePlace) {
  EXPECT_NE(refusal(json::parse(R"({"type":"object","properties":{"x":{"type":"string",
              "pattern":"^a"}}})"))
                .find("#/properties/x/pattern"),
            std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"type":"number","minimum":0})")).find("use type integer"),
            std::string::npos);
  EXPECT_NE(
      refusal(json::parse(R"({"anyOf":[{"type":"string"},{"type":"string"}]})")).find("#/anyOf/1"),
      std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"$ref":"#/$defs/missing"})")).find("names no definition"),
            std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"$ref":"https://example.com/s.json"})")).find("only local"),
            std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"$defs":{"a":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})"))
                .find("recurse"),
            std::string::npos);
  EXPECT_NE(
      refusal(json::parse(R"({"type":"integer","minimum":5,"maximum":4})")).find("no integer fits"),
      std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"type":"strnig"})")).find("unknown type 'strnig'"),
            std::string::npos);
  EXPECT_EQ(refusal(json::parse(R"({"type":"string","format":"date-time","description":"d"})")),
            "(accepted)");
  EXPECT_NE(refusal(json::parse(R"({"prefixItems":[{}],"items":[{}]})")).find("not both"),
            std::string::npos);
  EXPECT_NE(refusal(json::parse(R"({"prefixItems":{}})")).find("#/prefixItems"), std::string::npos);
}

TEST(JsonConstraint, MaskEqualsTryingEveryTokenAndWalksAlwaysValidate) {
  const Tokenizer tok = Tokenizer::from_model_dir(gemstage::testing::fixture("model"));
  const auto vocab = ConstraintVocabulary::of(tok);
  const auto g = JsonGrammar::from_schema(kPerson);
  const int32_t stop = *tok.eos_id();
  const auto V = static_cast<int64_t>(tok.vocab_size());
  std::mt19937 rng(7);
  int finished = 0;
  for (int walk = 0; walk < 40; ++walk) {
    TokenConstraint c(g, vocab, {stop});
    std::vector<int32_t> ids;
    for (int step = 0; step < 400; ++step) {
      std::vector<float> logits(static_cast<size_t>(V), 0.0f);
      c.mask(logits.data(), V);
      std::vector<int32_t> allowed;
      for (int32_t id = 0; id < V; ++id) {
        const bool in_mask = std::isfinite(logits[static_cast<size_t>(id)]);
        ASSERT_EQ(in_mask, c.allows(id)) << "token " << id << " after " << ids.size() << " ids";
        if (in_mask) allowed.push_back(id);
      }
      ASSERT_FALSE(allowed.empty()) << "no token may follow " << tok.decode(ids);
      // Prefer the stop token now and then, and structural tokens, so walks end.
      int32_t id = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
      if (c.allows(stop) && rng() % 2 == 0) id = stop;
      c.accept(id);
      if (id == stop) break;
      ids.push_back(id);
    }
    if (!c.complete()) continue;  // cut off by the step limit: not a finished value
    ++finished;
    const std::string text = tok.decode(ids);
    json v;
    ASSERT_NO_THROW(v = json::parse(text)) << text;
    EXPECT_TRUE(valid_person(v)) << text;
  }
  EXPECT_GT(finished, 10);
}

namespace {

std::string run_cli(const std::string& args) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  std::string out;
  if (!p) return out;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  pclose(p);
  return out;
}

// One step of a random walk through what the constraint allows (its mask already applied to
// `logits`): a random allowed id, or the stop id half the times it is allowed; accepted and
// returned.
int32_t accept_random_allowed(TokenConstraint& c, const std::vector<float>& logits, int32_t stop,
                              std::mt19937& rng) {
  std::vector<int32_t> allowed;
  for (size_t id = 0; id < logits.size(); ++id)
    if (std::isfinite(logits[id])) allowed.push_back(static_cast<int32_t>(id));
  int32_t id = allowed[std::uniform_int_distribution<size_t>(0, allowed.size() - 1)(rng)];
  if (c.allows(stop) && rng() % 2 == 0) id = stop;
  c.accept(id);
  return id;
}

// The walk's text as the server streams it, special tokens (the call markers) included.
std::string stream_text(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string text;
  StreamDecoder dec(tok, /*skip_special=*/false);
  for (int32_t id : ids) text += dec.push(id);
  return text + dec.flush();
}

}  // namespace

TEST(JsonConstraint, RandomWeightModelAtTemperatureOneAlwaysWritesValidOutput) {
  // The tiny checkpoint has random weights: unconstrained, it writes noise. With the schema
  // enforced every sample must parse and validate.
  const std::string schema = kPerson.dump();
  int stopped = 0;
  for (int seed = 1; seed <= 8; ++seed) {
    const std::string out = run_cli("generate -m " + gemstage::testing::fixture("model") +
                                    " -p 'Describe a person.' --temp 1 -n 400 --json -s " +
                                    std::to_string(seed) + " -j '" + schema + "'");
    json r;
    ASSERT_NO_THROW(r = json::parse(out)) << out;
    if (r["finish_reason"] != "stop") continue;  // ran out of tokens inside a long string
    ++stopped;
    json v;
    ASSERT_NO_THROW(v = json::parse(r["text"].get<std::string>())) << r["text"];
    EXPECT_TRUE(valid_person(v)) << r["text"];
  }
  EXPECT_GE(stopped, 6);
  // Any JSON object; and a schema the engine cannot enforce is refused before loading anything.
  const json any = json::parse(run_cli("generate -m " + gemstage::testing::fixture("model") +
                                       " -p x --temp 1 -n 300 --json -s 5 -j '{}'"));
  if (any["finish_reason"] == "stop") {
    EXPECT_TRUE(json::parse(any["text"].get<std::string>()).is_object());
  }
  EXPECT_EQ(run_cli("generate -m " + gemstage::testing::fixture("model") +
                    " -p x -j '{\"type\":\"string\",\"pattern\":\"a+\"}' && echo accepted"),
            "");
}

TEST(JsonConstraint, ForcedToolCallsAlwaysParseAndValidate) {
  const nlohmann::ordered_json tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string", "maxLength": 10},
                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
      "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
      "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}])");
  const auto any = ToolCallGrammar::from_tools(tools, "", true);
  auto fed = [](const ToolCallGrammar& g, std::string_view s) {
    ToolCallMatcher m(g);
    return m.feed(s) && m.complete();
  };
  // \1 = <|tool_call>, \2 = <tool_call|>, \0 = <|"|>.
  using namespace std::string_literals;
  EXPECT_TRUE(fed(*any, "\1call:get_time{tz:\0CET\0}\2"s));
  EXPECT_TRUE(
      fed(*any, "\1call:get_weather{days:3,city:\0Oslo\0}\2\1call:get_time{tz:\0UTC\0}\2"s));
  EXPECT_FALSE(fed(*any, "\1call:get_time{tz:\0PST\0}\2"s));
  EXPECT_FALSE(fed(*any, "\1call:get_time{\"tz\":\"CET\"}\2"s));
  EXPECT_FALSE(fed(*any, "\1call:get_weather{city:\0Oslo\0}\2"s));  // days is required
  EXPECT_FALSE(fed(*any, "\1call:get_date{}\2"s));
  EXPECT_FALSE(fed(*any, "\1call:get_time{tz:\0CET\0}"s));          // not closed
  EXPECT_FALSE(fed(*any, "Sure. \1call:get_time{tz:\0CET\0}\2"s));  // the call comes first
  const auto one = ToolCallGrammar::from_tools(tools, "get_time", false);
  EXPECT_TRUE(fed(*one, "\1call:get_time{tz:\0UTC\0}\2"s));
  EXPECT_FALSE(fed(*one, "\1call:get_weather{days:3,city:\0Oslo\0}\2"s));
  EXPECT_FALSE(fed(*one, "\1call:get_time{tz:\0UTC\0}\2\1call:get_time{tz:\0UTC\0}\2"s));
  EXPECT_THROW(ToolCallGrammar::from_tools(tools, "nope", true), Error);

  // Random walks over the full tokenizer (it has the tool-call markers): every finished walk,
  // decoded with special tokens kept, parses into calls whose arguments validate.
  const Tokenizer tok = Tokenizer::from_model_dir(gemstage::testing::fixture("tokenizer_full"));
  const auto vocab = ConstraintVocabulary::of(tok);
  const int32_t stop = *tok.token_to_id("<turn|>");
  const auto V = static_cast<int64_t>(tok.vocab_size());
  std::mt19937 rng(11);
  int finished = 0;
  for (int walk = 0; walk < 30; ++walk) {
    TokenConstraint c(any, vocab, {stop});
    std::vector<int32_t> ids;
    for (int step = 0; step < 300; ++step) {
      std::vector<float> logits(static_cast<size_t>(V), 0.0f);
      ASSERT_GT(c.mask(logits.data(), V), 0);
      const int32_t id = accept_random_allowed(c, logits, stop, rng);
      if (id == stop) break;
      ids.push_back(id);
    }
    if (!c.complete()) continue;
    ++finished;
    const std::string text = stream_text(tok, ids);
    const ParsedOutput parsed = parse_model_output(text);
    ASSERT_FALSE(parsed.tool_calls.empty()) << text;
    EXPECT_FALSE(parsed.content.has_value()) << text;
    for (const ParsedToolCall& call : parsed.tool_calls) {
      const json args = json::parse(call.arguments.dump());
      if (call.name == "get_time") {
        EXPECT_TRUE(args == json::parse(R"({"tz":"UTC"})") ||
                    args == json::parse(R"({"tz":"CET"})"))
            << text;
      } else {
        ASSERT_EQ(call.name, "get_weather") << text;
        EXPECT_EQ(args.size(), 2u) << text;
        EXPECT_TRUE(args["city"].is_string()) << text;
        EXPECT_TRUE(args["days"].is_number_integer() && args["days"] >= 1 && args["days"] <= 7)
            << text;
      }
    }
  }
  EXPECT_GT(finished, 10);
}

TEST(JsonConstraint, WithThinkingAThoughtMayComeBeforeTheForcedCall) {
  const nlohmann::ordered_json tools = nlohmann::ordered_json::parse(R"([
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
      "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}])");
  using Thought = ToolCallGrammar::Thought;
  const auto may = ToolCallGrammar::from_tools(tools, "", true, Thought::kMayOpen, 8);
  const auto open = ToolCallGrammar::from_tools(tools, "", true, Thought::kOpen, 8);
  const auto none = ToolCallGrammar::from_tools(tools, "", true);
  auto fed = [](const ToolCallGrammar& g, std::string_view s) {
    ToolCallMatcher m(g);
    return m.feed(s) && m.complete();
  };
  // \3 = <|channel>, \4 = <channel|>, \1 = <|tool_call>, \2 = <tool_call|>, \0 = <|"|>.
  using namespace std::string_literals;
  const std::string call = "\1call:get_time{tz:\0CET\0}\2"s;
  EXPECT_TRUE(fed(*may, "\3thought\nThe user wants the time.\4"s + call));
  EXPECT_TRUE(fed(*may, call));  // the thought is optional
  EXPECT_FALSE(fed(*may, "\3thought\nno call follows\4"s));
  EXPECT_FALSE(fed(*may, "Sure. "s + call));                      // no text outside the thought
  EXPECT_FALSE(fed(*may, "\3thought\n\1call inside\4"s + call));  // no marker inside it
  EXPECT_FALSE(fed(*none, "\3thought\nx\4"s + call));             // thinking off: the call first
  EXPECT_TRUE(fed(*open, "still thinking\4"s + call));            // the prompt opened it
  EXPECT_FALSE(fed(*open, call));

  // Over tokens: a thought gets max_thought_tokens, then only <channel|> may come; random walks
  // always end in a valid call after their thought.
  const Tokenizer tok = Tokenizer::from_model_dir(gemstage::testing::fixture("tokenizer_full"));
  const auto vocab = ConstraintVocabulary::of(tok);
  const int32_t stop = *tok.token_to_id("<turn|>");
  const int32_t channel_open = *tok.token_to_id("<|channel>");
  const int32_t channel_close = *tok.token_to_id("<channel|>");
  const auto V = static_cast<int64_t>(tok.vocab_size());
  std::mt19937 rng(5);
  int thought_first = 0, finished = 0;
  for (int walk = 0; walk < 20; ++walk) {
    TokenConstraint c(may, vocab, {stop});
    std::vector<int32_t> ids;
    // Half the walks open the thought channel, where any text token may come.
    if (walk % 2 == 0) {
      ASSERT_TRUE(c.allows(channel_open));
      c.accept(channel_open);
      ids.push_back(channel_open);
    }
    for (int step = 0; step < 300; ++step) {
      std::vector<float> logits(static_cast<size_t>(V), 0.0f);
      const int64_t allowed_count = c.mask(logits.data(), V);
      ASSERT_GT(allowed_count, 0);
      if (ids.size() == 8 && ids[0] == channel_open &&
          std::find(ids.begin(), ids.end(), channel_close) == ids.end()) {  // budget spent
        EXPECT_EQ(allowed_count, 1);
        EXPECT_TRUE(std::isfinite(logits[static_cast<size_t>(channel_close)]));
      }
      const int32_t id = accept_random_allowed(c, logits, stop, rng);
      if (id == stop) break;
      ids.push_back(id);
    }
    if (!c.complete()) continue;
    ++finished;
    const std::string text = stream_text(tok, ids);
    const ParsedOutput parsed = parse_model_output(text);
    ASSERT_FALSE(parsed.tool_calls.empty()) << text;
    EXPECT_FALSE(parsed.content.has_value()) << text;
    thought_first += ids[0] == channel_open;
    for (const ParsedToolCall& tool_call : parsed.tool_calls)
      EXPECT_EQ(tool_call.name, "get_time") << text;
  }
  EXPECT_GT(finished, 10);
  EXPECT_GT(thought_first, 5);
}
