#include "server/api.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <limits>

#include "audio/audio_decode.h"
#include "image/image_decode.h"
#include "tokenizer/utf8.h"

namespace gemstage::server {

using nlohmann::json;

void bad_request(const std::string& param, const std::string& code, const std::string& message) {
  throw ApiError(400, message, "invalid_request_error", param, code);
}

json error_json(const ApiError& e) {
  auto or_null = [](const std::string& s) { return s.empty() ? json(nullptr) : json(s); };
  return {{"error",
           {{"message", e.what()},
            {"type", e.type()},
            {"param", or_null(e.param())},
            {"code", or_null(e.code())}}}};
}

json parse_json_body(std::string_view body) {
  json j;
  try {
    j = json::parse(body.begin(), body.end());
  } catch (const json::exception& e) {
    // nlohmann's message names the byte offset, which is what a client needs to find the fault.
    // Not only parse_error: a number too large for a double ("1e99999") is an out_of_range
    // thrown from the parser (found by fuzz/fuzz_openai_request.cc).
    bad_request({}, "invalid_json", std::string("the request body is not valid JSON: ") + e.what());
  }
  if (!j.is_object()) bad_request({}, "invalid_json", "the request body must be a JSON object");
  return j;
}

const char* type_name(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a number";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "an array";
    case json::value_t::object:
      return "an object";
    default:
      return "an unsupported value";
  }
}

[[noreturn]] void wrong_type(const std::string& param, const char* want, const json& got) {
  bad_request(param, "invalid_type",
              detail::concat("'", param, "' must be ", want, ", not ", type_name(got)));
}

const json* member(const json& obj, const char* key) {
  const auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

const json& required_member(const json& obj, const char* key, const std::string& param) {
  const json* v = member(obj, key);
  if (!v) bad_request(param, "missing_required_parameter", "'" + param + "' is required");
  return *v;
}

std::string required_string(const json& obj, const char* key, const std::string& param) {
  const json& v = required_member(obj, key, param);
  if (!v.is_string()) wrong_type(param, "a string", v);
  return v.get<std::string>();
}

namespace {

std::optional<int64_t> get_int(const json& obj, const char* key, int64_t lo, int64_t hi) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) wrong_type(key, "an integer", *v);
  // Unsigned values beyond int64 are out of every range we accept.
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(hi))
    bad_request(key, "invalid_value", detail::concat("'", key, "' must be at most ", hi));
  const int64_t x = v->get<int64_t>();
  if (x < lo || x > hi)
    bad_request(key, "invalid_value",
                detail::concat("'", key, "' must be between ", lo, " and ", hi, ", got ", x));
  return x;
}

std::optional<double> get_number(const json& obj, const char* key, double lo, double hi,
                                 bool lo_open = false) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_number()) wrong_type(key, "a number", *v);
  const double x = v->get<double>();
  if (!(lo_open ? x > lo : x >= lo) || !(x <= hi)) {
    std::ostringstream os;
    os << "'" << key << "' must be " << (lo_open ? "> " : ">= ") << lo << " and <= " << hi
       << ", got " << x;
    bad_request(key, "invalid_value", os.str());
  }
  return x;
}

std::optional<bool> get_bool(const json& obj, const char* key, const std::string& param) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) wrong_type(param, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> get_string(const json& obj, const char* key) {
  const json* v = member(obj, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) wrong_type(key, "a string", *v);
  return v->get<std::string>();
}

// Up to this many stop strings; OpenAI allows 4, llama.cpp any number: enough for real use
// without letting one request make every generated token scan thousands of strings.
constexpr size_t kMaxStopStrings = 16;

std::vector<std::string> parse_stop(const json& v) {
  std::vector<std::string> out;
  auto add = [&](const json& s, const std::string& param) {
    if (!s.is_string()) wrong_type(param, "a string", s);
    std::string str = s.get<std::string>();
    if (str.empty()) bad_request(param, "invalid_value", "stop strings must not be empty");
    out.push_back(std::move(str));
  };
  if (v.is_string()) {
    add(v, "stop");
  } else if (v.is_array()) {
    if (v.size() > kMaxStopStrings)
      bad_request("stop", "invalid_value",
                  detail::concat("'stop' has ", v.size(), " strings; at most ", kMaxStopStrings,
                                 " are accepted"));
    for (size_t i = 0; i < v.size(); ++i) add(v[i], "stop[" + std::to_string(i) + "]");
  } else {
    wrong_type("stop", "a string or an array of strings", v);
  }
  return out;
}

// A JSON schema as the grammar that enforces it while sampling; a schema we cannot enforce is a
// 400 naming where it was given.
std::shared_ptr<const JsonGrammar> schema_grammar(const json& schema, const std::string& param) {
  try {
    return JsonGrammar::from_schema(schema);
  } catch (const ApiError&) {
    throw;
  } catch (const Error& e) {
    bad_request(param, "unsupported_schema", e.what());
  }
}

// response_format: text (free), json_object (any JSON object) or json_schema ({"name", "schema",
// "strict"}), the last two enforced while sampling (runtime/json_constraint.h). llama.cpp's
// spellings too: a "schema" beside json_object or json_schema constrains to that schema.
std::shared_ptr<const JsonGrammar> parse_response_format(const json& rf) {
  if (!rf.is_object()) wrong_type("response_format", "an object", rf);
  const json* t = member(rf, "type");
  if (!t || !t->is_string())
    bad_request("response_format.type", "missing_required_parameter",
                "'response_format.type' must be text, json_object or json_schema");
  const std::string type = t->get<std::string>();
  const json* direct = member(rf, "schema");
  if (type == "text") {
    if (direct)
      bad_request("response_format.schema", "invalid_value",
                  "a schema needs response_format type json_object or json_schema, not text");
    return nullptr;
  }
  if (type != "json_object" && type != "json_schema")
    bad_request(
        "response_format.type", "invalid_value",
        "'response_format.type' must be text, json_object or json_schema, not '" + type + "'");
  const json* js = member(rf, "json_schema");
  if (direct && js)
    bad_request("response_format.schema", "invalid_value",
                "give the schema once: response_format.schema or response_format.json_schema");
  if (direct) return schema_grammar(*direct, "response_format.schema");
  if (type == "json_object") return JsonGrammar::any_object();
  if (!js || !js->is_object())
    bad_request("response_format.json_schema", "missing_required_parameter",
                "response_format json_schema needs 'json_schema': {\"name\", \"schema\"}");
  const json* schema = member(*js, "schema");
  if (!schema) return JsonGrammar::any_object();  // a name alone: any JSON object
  return schema_grammar(*schema, "response_format.json_schema.schema");
}

// logit_bias: OpenAI's {"token id": bias} or llama.cpp's [[id, bias], ...], each bias -100 to
// 100 (llama.cpp's false, "never", is -100's ban). Ids are checked against the vocabulary when
// the request is prepared.
std::vector<std::pair<int32_t, float>> parse_logit_bias(const json& lb) {
  std::vector<std::pair<int32_t, float>> out;
  auto add = [&](const std::string& param, int64_t id, const json& v) {
    float bias = 0;
    if (v.is_boolean() && !v.get<bool>())
      bias = -100;
    else if (!v.is_number())
      wrong_type(param, "a number from -100 to 100", v);
    else
      bias = v.get<float>();
    if (!(bias >= -100 && bias <= 100))
      bad_request(param, "invalid_value", "'" + param + "' must be from -100 to 100");
    if (id < 0 || id > std::numeric_limits<int32_t>::max())
      bad_request(param, "invalid_value", "'" + param + "' names no token id");
    out.emplace_back(static_cast<int32_t>(id), bias);
  };
  constexpr size_t kMaxEntries = 1 << 16;
  if (lb.size() > kMaxEntries)
    bad_request("logit_bias", "invalid_value", "'logit_bias' holds more than 65536 entries");
  if (lb.is_object()) {
    for (const auto& [key, v] : lb.items()) {
      const std::string param = "logit_bias." + key;
      size_t used = 0;
      int64_t id = -1;
      try {
        id = std::stoll(key, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != key.size() || key.empty())
        bad_request(param, "invalid_value",
                    "'logit_bias' keys must be token ids, not '" + key + "'");
      add(param, id, v);
    }
  } else if (lb.is_array()) {
    for (size_t i = 0; i < lb.size(); ++i) {
      const std::string param = "logit_bias[" + std::to_string(i) + "]";
      const json& e = lb[i];
      if (!e.is_array() || e.size() != 2 || !e[0].is_number_integer())
        wrong_type(param, "an [id, bias] pair", e);
      add(param, e[0].get<int64_t>(), e[1]);
    }
  } else {
    wrong_type("logit_bias", "an object of token id -> bias", lb);
  }
  return out;
}

// The fields chat and text completions share: sampling, n, streaming, and the features we refuse
// rather than silently ignore.
void parse_common(const json& body, GenerationRequest& r) {
  r.model = get_string(body, "model").value_or("");
  // Bounded here by a size no server's slot count reaches; the server holds it to its own.
  if (const auto n = get_int(body, "n", 1, kMaxChoices)) r.n = static_cast<int>(*n);
  SamplingOverrides& s = r.sampling;
  constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
  const auto max_tokens = get_int(body, "max_tokens", 1, kMaxTokens);
  // max_completion_tokens is OpenAI's newer name; it wins when a client sends both.
  const auto max_completion = get_int(body, "max_completion_tokens", 1, kMaxTokens);
  if (max_completion)
    s.max_tokens = static_cast<int>(*max_completion);
  else if (max_tokens)
    s.max_tokens = static_cast<int>(*max_tokens);
  if (const auto t = get_number(body, "temperature", 0, 2)) s.temperature = static_cast<float>(*t);
  if (const auto p = get_number(body, "top_p", 0, 1, /*lo_open=*/true))
    s.top_p = static_cast<float>(*p);
  // llama.cpp's extensions, for clients that tune Gemma's recommended top_k / min_p.
  if (const auto k = get_int(body, "top_k", 0, std::numeric_limits<int32_t>::max()))
    s.top_k = static_cast<int>(*k);
  if (const auto p = get_number(body, "min_p", 0, 1)) s.min_p = static_cast<float>(*p);
  if (const auto p = get_number(body, "repeat_penalty", 0, 10, /*lo_open=*/true))
    s.repeat_penalty = static_cast<float>(*p);
  if (const auto n = get_int(body, "repeat_last_n", -1, std::numeric_limits<int32_t>::max()))
    s.repeat_last_n = static_cast<int>(*n);
  // llama.cpp's other samplers are not implemented: at their "off" values (what its web UI
  // sends by default) they change nothing; set to do something, they are refused, never ignored.
  struct OffValue {
    const char* field;
    double off;
  };
  for (const OffValue& f : {OffValue{"mirostat", 0}, OffValue{"typical_p", 1},
                            OffValue{"dry_multiplier", 0}, OffValue{"xtc_probability", 0},
                            OffValue{"dynatemp_range", 0}, OffValue{"top_n_sigma", -1}}) {
    const json* v = member(body, f.field);
    if (!v || v->is_null()) continue;
    if (!v->is_number()) wrong_type(f.field, "a number", *v);
    const double x = v->get<double>();
    if (x != f.off && !(f.off < 0 && x <= 0))
      bad_request(f.field, "unsupported_value",
                  detail::concat("the '", f.field, "' sampler is not implemented; send ", f.off,
                                 " (off) or leave it out"));
  }
  if (const json* seed = member(body, "seed")) {
    if (!seed->is_number_integer()) wrong_type("seed", "an integer", *seed);
    // Negative seeds are valid in OpenAI's API; any 64-bit pattern seeds our generator.
    s.seed = seed->is_number_unsigned() ? seed->get<uint64_t>()
                                        : static_cast<uint64_t>(seed->get<int64_t>());
  }
  if (const json* stop = member(body, "stop")) s.stop = parse_stop(*stop);
  r.stream = get_bool(body, "stream", "stream").value_or(false);
  if (const json* so = member(body, "stream_options")) {
    if (!so->is_object()) wrong_type("stream_options", "an object", *so);
    r.include_usage =
        get_bool(*so, "include_usage", "stream_options.include_usage").value_or(false);
  }
  if (const auto p = get_number(body, "frequency_penalty", -2, 2))
    s.frequency_penalty = static_cast<float>(*p);
  if (const auto p = get_number(body, "presence_penalty", -2, 2))
    s.presence_penalty = static_cast<float>(*p);
  if (const json* lb = member(body, "logit_bias")) s.logit_bias = parse_logit_bias(*lb);
  if (const json* rf = member(body, "response_format")) s.json_grammar = parse_response_format(*rf);
  // llama.cpp's top-level json_schema; its GBNF grammar is not implemented, so it is refused.
  if (const json* js = member(body, "json_schema"); js && !js->is_null()) {
    if (s.json_grammar)
      bad_request("json_schema", "invalid_value",
                  "give either 'json_schema' or a response_format with a schema, not both");
    s.json_grammar = schema_grammar(*js, "json_schema");
  }
  if (const json* g = member(body, "grammar");
      g && !(g->is_string() && g->get<std::string>().empty()) && !g->is_null())
    bad_request("grammar", "unsupported_value",
                "GBNF grammars are not supported; constrain the output with a JSON schema "
                "(response_format json_schema, or 'json_schema')");
  // llama.cpp's names, keys with a dot in them (not a nested object).
  if (const auto n = get_int(body, "speculative.n_max", 0, kMaxDraftsPerRound))
    s.draft_max = static_cast<int>(*n);
  if (const auto n = get_int(body, "speculative.n_min", 0, kMaxDraftsPerRound))
    s.draft_min = static_cast<int>(*n);
  if (s.draft_max && s.draft_min && *s.draft_max > 0 && *s.draft_min > *s.draft_max)
    bad_request("speculative.n_min", "invalid_value",
                detail::concat("'speculative.n_min' (", *s.draft_min,
                               ") must not exceed 'speculative.n_max' (", *s.draft_max, ")"));
  s.ignore_eos = get_bool(body, "ignore_eos", "ignore_eos");
  if (const json* spec = member(body, "speculative"); spec && spec->is_object())
    bad_request("speculative", "invalid_type",
                "send the speculative fields as llama.cpp does, as top-level keys "
                "\"speculative.n_max\" and \"speculative.n_min\", not as an object");
  // Chat's form: logprobs true, then top_logprobs 0-20 (the legacy completions form, an integer
  // logprobs, is refused by parse_completion_request).
  const json* lp = member(body, "logprobs");
  const bool want_logprobs = lp && lp->is_boolean() && lp->get<bool>();
  if (lp && !lp->is_boolean() && !lp->is_number_integer()) wrong_type("logprobs", "a boolean", *lp);
  if (const auto top = get_int(body, "top_logprobs", 0, 20)) {
    if (!want_logprobs)
      bad_request("top_logprobs", "invalid_value", "'top_logprobs' needs 'logprobs': true");
    s.top_logprobs = static_cast<int>(*top);
  } else if (want_logprobs) {
    s.top_logprobs = 0;
  }
}

// Accepted role names; "developer" is OpenAI's newer name for the system message.
constexpr std::array<std::string_view, 4> kRoles = {"system", "developer", "user", "assistant"};

// Each image may have up to max_image_pixels, and a request's images together this many times
// that: a few large pictures are fine, but a body of small-compressing, huge images must not make
// one request allocate gigabytes of RGB before the model ever sees it.
constexpr int64_t kRequestImageBudget = 4;

struct ImageBudget {
  size_t count = 0;
  int64_t pixels_left = 0;
  size_t videos = 0;  // video_url parts so far, for their names in errors
};

// A vLLM-style media part, {"type": K, K: {"url": ...}} (or K's value the URL string itself), from
// a user or tool message: its URL and the parameter path that names the URL in errors.
struct PartUrl {
  std::string url, param;
};
PartUrl media_part_url(const json& part, const std::string& key, const std::string& param,
                       const std::string& role, const char* media) {
  if (role != "user" && role != "tool")
    bad_request(param, "invalid_value",
                detail::concat(media, " only accepted in user and tool messages, not in ", role,
                               " messages"));
  const json* obj = member(part, key.c_str());
  if (!obj)
    bad_request(param + "." + key, "missing_required_parameter", "'" + key + "' is required");
  const json* url = obj->is_object() ? member(*obj, "url") : obj;
  PartUrl out{"", param + "." + key + (obj->is_object() ? ".url" : "")};
  if (!url) bad_request(out.param, "missing_required_parameter", "'" + key + ".url' is required");
  if (!url->is_string()) wrong_type(out.param, "a string", *url);
  out.url = url->get<std::string>();
  return out;
}

// The payload of a base64 data: URL whose media type `accepts` takes (`expected` says which, for
// the error); `kind` ("audio", "video") names the error codes.
std::vector<uint8_t> data_url_payload(const std::string& url, const std::string& param,
                                      const std::string& kind,
                                      const std::function<bool(const std::string&)>& accepts,
                                      const char* expected) {
  const std::string invalid = "invalid_" + kind + "_url";
  const size_t comma = url.find(',');
  if (comma == std::string::npos)
    bad_request(param, invalid, "the data URL has no ',' before its payload");
  const std::string header = url.substr(5, comma - 5);  // e.g. "audio/wav;base64"
  const size_t semi = header.find(';');
  const std::string mime = header.substr(0, semi);
  const std::string params = semi == std::string::npos ? std::string() : header.substr(semi);
  if (!accepts(mime))
    bad_request(param, invalid,
                detail::concat("the data URL's media type is '", mime, "'; send ", expected));
  if (params.size() < 7 || params.compare(params.size() - 7, 7, ";base64") != 0)
    bad_request(param, invalid, "the data URL must be base64-encoded (';base64,')");
  auto bytes = decode_base64(std::string_view(url).substr(comma + 1));
  if (!bytes) bad_request(param, "invalid_base64", "the data URL's payload is not valid base64");
  if (bytes->empty())
    bad_request(param, "invalid_" + kind, "the data URL holds no " + kind + " bytes");
  return std::move(*bytes);
}

bool is_remote_url(const std::string& url) {
  return url.rfind("http://", 0) == 0 || url.rfind("https://", 0) == 0;
}

// The bytes behind an http(s) URL when the server fetches them, else a 400 that says why not.
std::vector<uint8_t> fetch_or_refuse(const std::string& url, const std::string& param,
                                     const RequestLimits& limits, const char* what,
                                     const char* unsupported_code, const char* invalid_code) {
  if (!limits.remote_media.enabled)
    bad_request(param, unsupported_code,
                detail::concat("remote ", what,
                               " URLs are not fetched by this server (a server that fetches "
                               "whatever URL a client names can be turned against its own "
                               "network); send the ",
                               what,
                               " inline as a base64 data: URL, or start the server with "
                               "--allow-remote-media"));
  try {
    return fetch_remote_media(url, limits.remote_media);
  } catch (const Error& e) {
    bad_request(param, invalid_code, e.what());
  }
}

RgbImage decode_image_bytes(const std::vector<uint8_t>& bytes, const std::string& param,
                            const RequestLimits& limits, ImageBudget& budget);

RgbImage decode_data_url(const std::string& url, const std::string& param,
                         const RequestLimits& limits, ImageBudget& budget) {
  if (is_remote_url(url))
    return decode_image_bytes(
        fetch_or_refuse(url, param, limits, "image", "unsupported_image_url", "invalid_image_url"),
        param, limits, budget);
  if (url.rfind("data:", 0) != 0)
    bad_request(param, "unsupported_image_url",
                "image_url.url must be a data:image/png;base64,... or data:image/jpeg;base64,... "
                "URL");
  const std::vector<uint8_t> bytes = data_url_payload(
      url, param, "image",
      [](const std::string& m) {
        return m == "image/png" || m == "image/jpeg" || m == "image/jpg";
      },
      "image/png or image/jpeg");
  return decode_image_bytes(bytes, param, limits, budget);
}

RgbImage decode_image_bytes(const std::vector<uint8_t>& bytes, const std::string& param,
                            const RequestLimits& limits, ImageBudget& budget) {
  ImageLimits il;
  il.max_pixels = std::min(limits.max_image_pixels, budget.pixels_left);
  try {
    RgbImage img = decode_image(bytes.data(), bytes.size(), il,
                                detail::concat("image ", ++budget.count, " (", param, ")"));
    budget.pixels_left -= int64_t{img.width} * img.height;
    return img;
  } catch (const Error& e) {
    if (il.max_pixels < limits.max_image_pixels)
      bad_request(param, "invalid_image",
                  detail::concat(e.what(), " (what is left of this request's budget of ",
                                 kRequestImageBudget * limits.max_image_pixels,
                                 " pixels for all its images)"));
    bad_request(param, "invalid_image", e.what());
  }
}

// OpenAI's input_audio part: {"data": base64 bytes, "format": "wav" | "mp3"}. The bytes are
// decoded here (libsndfile: WAV, MP3, and FLAC/OGG too), so a bad clip is refused with a 400
// before the request waits for a slot; clips over 30 s are refused, not truncated.
AudioClip parse_input_audio(const json& part, const std::string& param, const std::string& role) {
  if (role != "user" && role != "tool")
    bad_request(param, "invalid_value",
                detail::concat("audio is only accepted in user and tool messages, not in ", role,
                               " messages"));
  const json* ia = member(part, "input_audio");
  const std::string p = param + ".input_audio";
  if (!ia) bad_request(p, "missing_required_parameter", "'input_audio' is required");
  if (!ia->is_object()) wrong_type(p, "an object with 'data' and 'format'", *ia);
  const json* data = member(*ia, "data");
  if (!data)
    bad_request(p + ".data", "missing_required_parameter", "'input_audio.data' is required");
  if (!data->is_string()) wrong_type(p + ".data", "a base64 string", *data);
  const json* format = member(*ia, "format");
  if (!format)
    bad_request(p + ".format", "missing_required_parameter", "'input_audio.format' is required");
  if (!format->is_string()) wrong_type(p + ".format", "a string", *format);
  const std::string f = format->get<std::string>();
  if (f != "wav" && f != "mp3" && f != "flac" && f != "ogg")
    bad_request(p + ".format", "unsupported_audio_format",
                detail::concat("audio format '", f,
                               "' cannot be decoded; send wav or mp3 (flac and ogg also work)"));
  const auto bytes = decode_base64(data->get<std::string>());
  if (!bytes) bad_request(p + ".data", "invalid_base64", "input_audio.data is not valid base64");
  try {
    return decode_audio(bytes->data(), bytes->size(),
                        detail::concat("the ", f, " audio in ", p, ".data"));
  } catch (const Error& e) {
    bad_request(p + ".data", "invalid_audio", e.what());
  }
}

// vLLM's audio_url part: {"type": "audio_url", "audio_url": {"url": ...}} with a
// data:audio/...;base64 URL, or an http(s) URL when the server fetches them. Decoded and bounded
// as input_audio is.
AudioClip parse_audio_url(const json& part, const std::string& param, const std::string& role,
                          const RequestLimits& limits) {
  const PartUrl u = media_part_url(part, "audio_url", param, role, "audio is");
  std::vector<uint8_t> bytes;
  if (is_remote_url(u.url)) {
    bytes = fetch_or_refuse(u.url, u.param, limits, "audio", "unsupported_audio_url",
                            "invalid_audio_url");
  } else {
    if (u.url.rfind("data:", 0) != 0)
      bad_request(u.param, "unsupported_audio_url",
                  "audio_url.url must be a data:audio/...;base64,... URL (or http(s) on a server "
                  "started with --allow-remote-media)");
    bytes = data_url_payload(
        u.url, u.param, "audio", [](const std::string& m) { return m.rfind("audio/", 0) == 0; },
        "audio/wav, audio/mpeg, audio/flac or audio/ogg");
  }
  try {
    return decode_audio(bytes.data(), bytes.size(), detail::concat("the audio in ", u.param));
  } catch (const Error& e) {
    bad_request(u.param, "invalid_audio", e.what());
  }
}

// vLLM's video_url part: {"type": "video_url", "video_url": {"url": ...}} with a
// data:video/...;base64 URL, or a file:///path under --allowed-local-media-path. The bytes are
// checked here; decoding (and a 400 for a video that does not decode, or that would not fit the
// context) happens when the prompt is prepared, with the model's video processor settings.
ChatInputPart parse_video_url(const json& part, const std::string& param, const std::string& role,
                              const RequestLimits& limits, ImageBudget& media) {
  const PartUrl u = media_part_url(part, "video_url", param, role, "videos are");
  const std::string& url = u.url;
  const std::string& p = u.param;
  VideoSource src;
  src.what = detail::concat("video ", ++media.videos, " (", p, ")");
  src.num_frames = limits.video_frames;
  src.max_soft_tokens = limits.video_budget;
  ChatInputPart out;
  if (url.rfind("file://", 0) == 0) {
    namespace fs = std::filesystem;
    if (limits.allowed_local_media_path.empty())
      bad_request(p, "unsupported_video_url",
                  "this server reads no local files; send the video as a data:video/mp4;base64,... "
                  "URL, or start the server with --allowed-local-media-path DIR");
    std::error_code ec;
    const fs::path file = fs::weakly_canonical(fs::path(url.substr(7)), ec);
    const fs::path root = fs::weakly_canonical(fs::path(limits.allowed_local_media_path), ec);
    const auto [r, f] = std::mismatch(root.begin(), root.end(), file.begin(), file.end());
    if (ec || !fs::path(url.substr(7)).is_absolute() || r != root.end())
      bad_request(p, "invalid_video_url",
                  detail::concat("'", url,
                                 "' is not a file under the server's "
                                 "--allowed-local-media-path"));
    if (!fs::is_regular_file(file, ec))
      bad_request(p, "invalid_video_url", detail::concat("'", url, "' is not a readable file"));
    src.path = file.string();
    out.video_source = std::move(src);
    return out;
  }
  if (is_remote_url(url))
    bad_request(p, "unsupported_video_url",
                "remote video URLs are not fetched (a server that fetches whatever URL a client "
                "names can be turned against its own network); send the video inline as a "
                "data:video/mp4;base64,... URL");
  if (url.rfind("data:", 0) != 0)
    bad_request(p, "unsupported_video_url",
                "video_url.url must be a data:video/...;base64,... URL or a file:/// URL");
  std::vector<uint8_t> bytes = data_url_payload(
      url, p, "video",
      [](const std::string& m) { return m.rfind("video/", 0) == 0 || m == "image/gif"; },
      "video/mp4, video/webm, video/quicktime, video/x-matroska or image/gif");
  src.bytes = std::make_shared<const std::vector<uint8_t>>(std::move(bytes));
  out.video_source = std::move(src);
  return out;
}

ChatInputPart parse_part(const json& part, const std::string& param, const std::string& role,
                         const RequestLimits& limits, ImageBudget& images) {
  if (!part.is_object()) wrong_type(param, "an object (a content part)", part);
  const json* type = member(part, "type");
  if (!type) bad_request(param + ".type", "missing_required_parameter", "'type' is required");
  if (!type->is_string()) wrong_type(param + ".type", "a string", *type);
  const std::string t = type->get<std::string>();
  if (t == "text") {
    const json* text = member(part, "text");
    if (!text) bad_request(param + ".text", "missing_required_parameter", "'text' is required");
    if (!text->is_string()) wrong_type(param + ".text", "a string", *text);
    return {text->get<std::string>(), std::nullopt};
  }
  if (t == "image_url") {
    if (role != "user" && role != "tool")
      bad_request(param, "invalid_value",
                  detail::concat("images are only accepted in user and tool messages, not in ",
                                 role, " messages"));
    const json* iu = member(part, "image_url");
    if (!iu)
      bad_request(param + ".image_url", "missing_required_parameter", "'image_url' is required");
    // OpenAI sends {"url": ...}; some clients send the URL string itself.
    const json* url = iu->is_object() ? member(*iu, "url") : iu;
    const std::string url_param = param + ".image_url" + (iu->is_object() ? ".url" : "");
    if (!url) bad_request(url_param, "missing_required_parameter", "'image_url.url' is required");
    if (!url->is_string()) wrong_type(url_param, "a string", *url);
    return {"", decode_data_url(url->get<std::string>(), url_param, limits, images)};
  }
  if (t == "input_audio") return {"", std::nullopt, parse_input_audio(part, param, role)};
  if (t == "audio_url") return {"", std::nullopt, parse_audio_url(part, param, role, limits)};
  if (t == "video_url") return parse_video_url(part, param, role, limits, images);
  bad_request(param + ".type", "invalid_value",
              detail::concat("content part type '", t,
                             "' is not supported; use 'text', 'image_url', 'input_audio', "
                             "'audio_url' or 'video_url'"));
}

}  // namespace

ChatRequest parse_chat_request(const json& body, const RequestLimits& limits) {
  ChatRequest r;
  parse_common(body, r);
  if (const json* tools = member(body, "tools"); tools && !(tools->is_array() && tools->empty()))
    bad_request("tools", "unsupported_value", "tool calling is not supported by this server");
  if (const json* tc = member(body, "tool_choice"); tc && *tc != "none" && *tc != "auto")
    bad_request("tool_choice", "unsupported_value", "tool calling is not supported by this server");
  const json* msgs = member(body, "messages");
  if (!msgs) bad_request("messages", "missing_required_parameter", "'messages' is required");
  if (!msgs->is_array()) wrong_type("messages", "an array", *msgs);
  if (msgs->empty())
    bad_request("messages", "empty_array", "'messages' must contain at least one message");
  ImageBudget images;
  images.pixels_left = kRequestImageBudget * limits.max_image_pixels;
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) wrong_type(p, "an object", m);
    const json* role = member(m, "role");
    if (!role) bad_request(p + ".role", "missing_required_parameter", "'role' is required");
    if (!role->is_string()) wrong_type(p + ".role", "a string", *role);
    const std::string rs = role->get<std::string>();
    bool known = false;
    for (std::string_view k : kRoles) known = known || rs == k;
    if (!known)
      bad_request(p + ".role", "invalid_value",
                  "role '" + rs +
                      "' is not supported; use system, developer, user or assistant (tool "
                      "messages are not supported)");
    if (rs == "developer" && i != 0)
      bad_request(p + ".role", "invalid_value",
                  "a developer message is only accepted first (it becomes the system turn)");
    if (const json* tc = member(m, "tool_calls"); tc && !(tc->is_array() && tc->empty()))
      bad_request(p + ".tool_calls", "unsupported_value", "tool calls are not supported");
    const json* content = member(m, "content");
    if (!content)
      bad_request(p + ".content", "missing_required_parameter", "'content' is required");
    ChatInput in{rs, {}};
    if (content->is_string()) {
      in.parts.push_back({content->get<std::string>(), std::nullopt});
    } else if (content->is_array()) {
      for (size_t j = 0; j < content->size(); ++j)
        in.parts.push_back(parse_part((*content)[j], p + ".content[" + std::to_string(j) + "]", rs,
                                      limits, images));
    } else {
      wrong_type(p + ".content", "a string or an array of content parts", *content);
    }
    r.messages.push_back(std::move(in));
  }
  return r;
}

namespace {

// A prompt given as token ids (`param` names the array): each an integer in [0, vocab_size).
std::vector<int32_t> parse_prompt_ids(const json& a, const std::string& param,
                                      const PromptIdLimits& limits) {
  if (a.empty())
    bad_request(param, "empty_array",
                "'" + param + "' is an empty array; send a string or at least one token id");
  // Checked before the ids are copied; the same limit a text prompt meets once tokenized.
  if (static_cast<int64_t>(a.size()) >= limits.max_context)
    bad_request(param, "context_length_exceeded",
                detail::concat("the prompt is ", a.size(), " tokens but the context holds ",
                               limits.max_context,
                               " (including room for at least one generated token); shorten "
                               "the prompt or start the server with a larger -c / --ctx-size"));
  std::vector<int32_t> ids;
  ids.reserve(a.size());
  for (size_t i = 0; i < a.size(); ++i) {
    const json& v = a[i];
    const std::string p = detail::concat(param, "[", i, "]");
    if (!v.is_number_integer()) wrong_type(p, "an integer token id", v);
    const bool negative = !v.is_number_unsigned() && v.get<int64_t>() < 0;
    if (negative || v.get<uint64_t>() >= static_cast<uint64_t>(limits.vocab_size))
      bad_request(p, "invalid_value",
                  detail::concat("'", p, "' is ", v.dump(), ", not a token id of this model (0 to ",
                                 limits.vocab_size - 1, ")"));
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return ids;
}

}  // namespace

CompletionRequest parse_completion_request(const json& body, const PromptIdLimits& id_limits) {
  CompletionRequest r;
  parse_common(body, r);
  const json* prompt = member(body, "prompt");
  if (!prompt) bad_request("prompt", "missing_required_parameter", "'prompt' is required");
  // A string, an array of token ids, or OpenAI's batch form (an array of those) with one element.
  const json* one = prompt;
  std::string param = "prompt";
  if (prompt->is_array() && !prompt->empty()) {
    const bool ids = (*prompt)[0].is_number();
    for (size_t i = 1; i < prompt->size(); ++i)
      if ((*prompt)[i].is_number() != ids)
        bad_request(
            detail::concat("prompt[", i, "]"), "invalid_value",
            detail::concat("'prompt' mixes token ids and other values: prompt[0] is ",
                           type_name((*prompt)[0]), " but prompt[", i, "] is ",
                           type_name((*prompt)[i]), "; send one string or one array of token ids"));
    if (!ids) {
      if (prompt->size() > 1)
        bad_request("prompt", "unsupported_value",
                    detail::concat("'prompt' holds ", prompt->size(),
                                   " prompts, but this server serves one prompt per request; "
                                   "send each prompt as its own request"));
      one = &(*prompt)[0];
      param = "prompt[0]";
    }
  }
  if (one->is_string())
    r.prompt = one->get<std::string>();
  else if (one->is_array())
    r.prompt_ids = parse_prompt_ids(*one, param, id_limits);
  else
    wrong_type(param, "a string or an array of token ids", *one);
  if (const json* lp = member(body, "logprobs"); lp && !(lp->is_boolean() && !lp->get<bool>()))
    bad_request("logprobs", "unsupported_value",
                "'logprobs' is not supported on /v1/completions; use /v1/chat/completions");
  if (const auto echo = get_bool(body, "echo", "echo"); echo && *echo)
    bad_request("echo", "unsupported_value", "'echo' is not supported");
  if (const auto suffix = get_string(body, "suffix"); suffix && !suffix->empty())
    bad_request("suffix", "unsupported_value", "'suffix' is not supported");
  if (const auto best_of = get_int(body, "best_of", std::numeric_limits<int64_t>::min(),
                                   std::numeric_limits<int64_t>::max());
      best_of && *best_of != 1)
    bad_request("best_of", "unsupported_value", "'best_of' must be 1");
  return r;
}

std::optional<std::vector<uint8_t>> decode_base64(std::string_view text) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  size_t n = text.size();
  // Up to two '=' of padding, which must then complete a 4-character group.
  size_t pad = 0;
  while (pad < 2 && n > 0 && text[n - 1] == '=') {
    --n;
    ++pad;
  }
  if (pad > 0 && (n + pad) % 4 != 0) return std::nullopt;
  if (n % 4 == 1) return std::nullopt;  // no byte count encodes to 4k+1 characters
  std::vector<uint8_t> out;
  out.reserve(n / 4 * 3 + 2);
  uint32_t acc = 0;
  int bits = 0;
  for (size_t i = 0; i < n; ++i) {
    const int v = value(text[i]);
    if (v < 0) return std::nullopt;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<uint8_t>((acc >> bits) & 0xff));
    }
  }
  // The leftover bits of the last group must be zero, or two encodings would name one payload.
  if (bits > 0 && (acc & ((1u << bits) - 1)) != 0) return std::nullopt;
  return out;
}

std::string encode_base64(const uint8_t* data, size_t size) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((size + 2) / 3 * 4);
  for (size_t i = 0; i < size; i += 3) {
    const uint32_t b0 = data[i], b1 = i + 1 < size ? data[i + 1] : 0,
                   b2 = i + 2 < size ? data[i + 2] : 0;
    const uint32_t v = (b0 << 16) | (b1 << 8) | b2;
    out += kAlphabet[(v >> 18) & 63];
    out += kAlphabet[(v >> 12) & 63];
    out += i + 1 < size ? kAlphabet[(v >> 6) & 63] : '=';
    out += i + 2 < size ? kAlphabet[v & 63] : '=';
  }
  return out;
}

GenerationOptions apply_overrides(const GenerationOptions& defaults, const SamplingOverrides& o,
                                  uint64_t fallback_seed) {
  GenerationOptions g = defaults;
  if (o.max_tokens) g.max_tokens = *o.max_tokens;
  if (o.temperature) g.sampling.temperature = *o.temperature;
  if (o.top_p) g.sampling.top_p = *o.top_p;
  if (o.top_k) g.sampling.top_k = *o.top_k;
  if (o.min_p) g.sampling.min_p = *o.min_p;
  g.sampling.seed = o.seed.value_or(fallback_seed);
  if (o.frequency_penalty) g.sampling.frequency_penalty = *o.frequency_penalty;
  if (o.presence_penalty) g.sampling.presence_penalty = *o.presence_penalty;
  if (o.repeat_penalty) g.sampling.repetition_penalty = *o.repeat_penalty;
  if (o.repeat_last_n) g.sampling.repeat_last_n = *o.repeat_last_n;
  g.sampling.logit_bias = o.logit_bias;
  if (o.stop) g.stop_strings = *o.stop;
  g.json_grammar = o.json_grammar;
  g.top_logprobs = o.top_logprobs.value_or(-1);
  return g;
}

std::string openai_finish_reason(const std::string& finish_reason) {
  return finish_reason == "context" ? "length" : finish_reason;
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

namespace {
json finish_json(const std::optional<std::string>& f) {
  return f ? json(*f) : json(nullptr);
}
}  // namespace

namespace {
// Every completion object and chunk: id, object, created, model, one choice (none in a usage
// chunk), and usage where given.
json completion_envelope(const ResponseMeta& m, const std::string& object, json choices,
                         const json* usage = nullptr) {
  json j = {{"id", m.id},
            {"object", object},
            {"created", m.created},
            {"model", m.model},
            {"choices", std::move(choices)}};
  if (usage) j["usage"] = *usage;
  return j;
}
json one_choice(const char* field, json value, json finish) {
  return json::array({{{"index", 0},
                       {field, std::move(value)},
                       {"logprobs", nullptr},
                       {"finish_reason", std::move(finish)}}});
}
}  // namespace

json chat_completion_json(const ResponseMeta& m, const std::string& text,
                          const std::string& finish_reason, int64_t prompt_tokens,
                          int64_t completion_tokens) {
  const json usage = usage_json(prompt_tokens, completion_tokens);
  return completion_envelope(
      m, "chat.completion",
      one_choice("message", {{"role", "assistant"}, {"content", text}}, finish_reason), &usage);
}

json chat_chunk_json(const ResponseMeta& m, const json& delta,
                     const std::optional<std::string>& finish_reason) {
  return completion_envelope(m, "chat.completion.chunk",
                             one_choice("delta", delta, finish_json(finish_reason)));
}

json text_completion_json(const ResponseMeta& m, const std::string& text,
                          const std::string& finish_reason, int64_t prompt_tokens,
                          int64_t completion_tokens) {
  const json usage = usage_json(prompt_tokens, completion_tokens);
  return completion_envelope(m, "text_completion", one_choice("text", text, finish_reason), &usage);
}

json text_completion_chunk_json(const ResponseMeta& m, const std::string& text,
                                const std::optional<std::string>& finish_reason) {
  return completion_envelope(m, "text_completion",
                             one_choice("text", text, finish_json(finish_reason)));
}

json usage_chunk_json(const ResponseMeta& m, const std::string& object, int64_t prompt_tokens,
                      int64_t completion_tokens) {
  const json usage = usage_json(prompt_tokens, completion_tokens);
  return completion_envelope(m, object, json::array(), &usage);
}

json models_json(const std::string& model, int64_t created, bool multimodal) {
  json capabilities = json::array({"completion"});
  if (multimodal) capabilities.push_back("multimodal");
  // OpenAI's list, and llama-server's "models" beside it (its clients read the capabilities).
  return {
      {"object", "list"},
      {"data",
       json::array(
           {{{"id", model}, {"object", "model"}, {"created", created}, {"owned_by", "gemstage"}}})},
      {"models",
       json::array(
           {{{"name", model}, {"model", model}, {"capabilities", std::move(capabilities)}}})}};
}

std::string wire_json(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string sse_event(const json& chunk) {
  // dump() escapes newlines inside strings, so one event is always one "data:" line.
  return "data: " + wire_json(chunk) + "\n\n";
}

json logprobs_json(const Tokenizer& tokenizer, std::span<const TokenLogprob> tokens) {
  auto entry = [&](int32_t id, float logprob) {
    const std::string raw = tokenizer.has_id(id) ? tokenizer.token_bytes(id) : std::string();
    json bytes = json::array();
    for (unsigned char b : raw) bytes.push_back(b);
    // A lone byte of a longer character reads as the reply's text would read it; `bytes` keeps
    // the raw bytes for clients that join them.
    return json{
        {"token", utf8::byte_run_text(raw)}, {"logprob", logprob}, {"bytes", std::move(bytes)}};
  };
  json content = json::array();
  for (const TokenLogprob& t : tokens) {
    json e = entry(t.id, t.logprob);
    json top = json::array();
    for (const auto& [id, lp] : t.top) top.push_back(entry(id, lp));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return {{"content", std::move(content)}, {"refusal", nullptr}};
}

ReplyTextTokens::ReplyTextTokens(const Tokenizer& tokenizer, std::string_view generation_prefix)
    : tokenizer_(tokenizer),
      channel_open_(tokenizer.token_to_id("<|channel>")),
      channel_close_(tokenizer.token_to_id("<channel|>")),
      call_open_(tokenizer.token_to_id("<|tool_call>")),
      call_close_(tokenizer.token_to_id("<tool_call|>")) {
  for (int32_t id : tokenizer.encode(generation_prefix, false, true)) take(id);
}

bool ReplyTextTokens::take(int32_t id) {
  if (channel_open_ && id == *channel_open_ && in_ == In::kText) in_ = In::kThought;
  if (call_open_ && id == *call_open_ && in_ == In::kText) in_ = In::kCall;
  const bool text = in_ == In::kText && !(tokenizer_.has_id(id) && tokenizer_.is_special(id));
  if ((channel_close_ && id == *channel_close_ && in_ == In::kThought) ||
      (call_close_ && id == *call_close_ && in_ == In::kCall))
    in_ = In::kText;
  return text;
}

json ReplyTextTokens::take_logprobs(std::span<const TokenLogprob> tokens) {
  std::vector<TokenLogprob> text;
  for (const TokenLogprob& t : tokens)
    if (take(t.id)) text.push_back(t);
  return std::move(logprobs_json(tokenizer_, text)["content"]);
}

std::string sse_named_event(const std::string& name, const json& data) {
  return "event: " + name + "\ndata: " + wire_json(data) + "\n\n";
}

}  // namespace gemstage::server

namespace gemstage::server {

namespace {

using ojson = nlohmann::ordered_json;

ojson ordered(const json& j) {
  return ojson::parse(j.dump());
}

}  // namespace

ToolRequest parse_tool_request(const json& body, const RequestLimits& limits) {
  ToolRequest r;
  ImageBudget images;
  images.pixels_left = kRequestImageBudget * limits.max_image_pixels;
  std::vector<std::string> names;
  if (const json* tools = member(body, "tools")) {
    if (!tools->is_array()) wrong_type("tools", "an array", *tools);
    for (size_t i = 0; i < tools->size(); ++i) {
      const json& t = (*tools)[i];
      const std::string p = "tools[" + std::to_string(i) + "]";
      if (!t.is_object()) wrong_type(p, "an object", t);
      const json* type = member(t, "type");
      if (!type || *type != "function")
        bad_request(p + ".type", "unsupported_value",
                    "only tools of type 'function' can be given to this model");
      const json* fn = member(t, "function");
      if (!fn || !fn->is_object()) wrong_type(p + ".function", "an object", fn ? *fn : json());
      const json* name = member(*fn, "name");
      if (!name || !name->is_string() || name->get<std::string>().empty())
        bad_request(p + ".function.name", "invalid_value", "a tool needs a non-empty name");
      if (const json* params = member(*fn, "parameters"); params && !params->is_object())
        wrong_type(p + ".function.parameters", "an object (a JSON schema)", *params);
      names.push_back(name->get<std::string>());
    }
    if (!tools->empty()) r.tools = ordered(*tools);
  }
  if (const json* tc = member(body, "tool_choice")) {
    if (tc->is_string()) {
      const std::string c = tc->get<std::string>();
      if (c != "auto" && c != "none" && c != "required")
        bad_request("tool_choice", "invalid_value",
                    "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                    "\"function\": {\"name\": ...}}");
      r.tool_choice = c;
    } else if (tc->is_object()) {
      const json* fn = member(*tc, "function");
      const json* name = fn && fn->is_object() ? member(*fn, "name") : nullptr;
      if (!name || !name->is_string())
        bad_request("tool_choice.function.name", "missing_required_parameter",
                    "a named tool_choice needs function.name");
      r.tool_choice = "function";
      r.tool_choice_name = name->get<std::string>();
      if (std::find(names.begin(), names.end(), r.tool_choice_name) == names.end())
        bad_request("tool_choice.function.name", "invalid_value",
                    "tool_choice names '" + r.tool_choice_name + "', which is not among 'tools'");
    } else {
      wrong_type("tool_choice", "a string or an object", *tc);
    }
    if ((r.tool_choice == "required" || r.tool_choice == "function") && names.empty())
      bad_request("tool_choice", "invalid_value",
                  "tool_choice '" + r.tool_choice + "' needs at least one tool in 'tools'");
  }
  r.parallel_tool_calls =
      get_bool(body, "parallel_tool_calls", "parallel_tool_calls").value_or(true);
  if (const json* kw = member(body, "chat_template_kwargs")) {
    if (!kw->is_object()) wrong_type("chat_template_kwargs", "an object", *kw);
    r.enable_thinking = get_bool(*kw, "enable_thinking", "chat_template_kwargs.enable_thinking");
  }
  r.continue_final_message =
      get_bool(body, "continue_final_message", "continue_final_message").value_or(false);
  r.add_generation_prompt = get_bool(body, "add_generation_prompt", "add_generation_prompt")
                                .value_or(!r.continue_final_message);
  if (r.add_generation_prompt && r.continue_final_message)
    bad_request("continue_final_message", "invalid_value",
                "continue_final_message and add_generation_prompt cannot both be true: one opens "
                "a new model turn, the other continues the last assistant message");

  const json* msgs = member(body, "messages");
  if (!msgs) bad_request("messages", "missing_required_parameter", "'messages' is required");
  if (!msgs->is_array()) wrong_type("messages", "an array", *msgs);
  if (msgs->empty())
    bad_request("messages", "empty_array", "'messages' must contain at least one message");
  r.messages = ojson::array();
  for (size_t i = 0; i < msgs->size(); ++i) {
    const json& m = (*msgs)[i];
    const std::string p = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) wrong_type(p, "an object", m);
    const json* role = member(m, "role");
    if (!role || !role->is_string())
      bad_request(p + ".role", "missing_required_parameter", "'role' must be a string");
    const std::string rs = role->get<std::string>();
    if (rs != "system" && rs != "developer" && rs != "user" && rs != "assistant" && rs != "tool")
      bad_request(
          p + ".role", "invalid_value",
          "role '" + rs + "' is not supported; use system, developer, user, assistant or tool");
    ojson out = ordered(m);
    const json* content = member(m, "content");
    if (content && !content->is_string() && !content->is_array())
      wrong_type(p + ".content", "a string, an array of content parts or null", *content);
    if (!content && rs != "assistant")
      bad_request(p + ".content", "missing_required_parameter", "'content' is required");
    if (content && content->is_array()) {
      // Images and audio are decoded here (a bad one is refused before the request queues); the
      // template gets the part it writes a placeholder for.
      for (size_t j = 0; j < content->size(); ++j) {
        ChatInputPart part = parse_part((*content)[j], p + ".content[" + std::to_string(j) + "]",
                                        rs, limits, images);
        if (!part.is_media()) continue;
        out["content"][j] = ojson{{"type", part.image ? "image" : part.audio ? "audio" : "video"}};
        r.media.push_back(std::move(part));
      }
    }
    if (const json* calls = member(m, "tool_calls")) {
      if (rs != "assistant")
        bad_request(p + ".tool_calls", "invalid_value", "only assistant messages carry tool_calls");
      if (!calls->is_array()) wrong_type(p + ".tool_calls", "an array", *calls);
      for (size_t j = 0; j < calls->size(); ++j) {
        const std::string cp = p + ".tool_calls[" + std::to_string(j) + "]";
        const json& call = (*calls)[j];
        const json* fn = call.is_object() ? member(call, "function") : nullptr;
        if (!fn || !fn->is_object()) wrong_type(cp + ".function", "an object", fn ? *fn : json());
        const json* name = member(*fn, "name");
        if (!name || !name->is_string())
          bad_request(cp + ".function.name", "missing_required_parameter", "'name' is required");
        // OpenAI sends arguments as JSON text; the template needs the object itself.
        ojson args = ojson::object();
        if (const json* a = member(*fn, "arguments")) {
          if (a->is_string()) {
            try {
              args = ojson::parse(a->get<std::string>());
            } catch (const ojson::exception&) {
              bad_request(cp + ".function.arguments", "invalid_value",
                          "the arguments of " + p + "'s tool call are not valid JSON");
            }
          } else {
            args = ordered(*a);
          }
          if (!args.is_object())
            bad_request(cp + ".function.arguments", "invalid_value",
                        "the arguments of " + p + "'s tool call must be a JSON object");
        }
        out["tool_calls"][j]["function"]["arguments"] = std::move(args);
      }
    }
    if (rs == "tool") {
      if (const json* id = member(m, "tool_call_id"); id && !id->is_string())
        wrong_type(p + ".tool_call_id", "a string", *id);
    }
    r.messages.push_back(std::move(out));
  }
  return r;
}

bool wants_tool_path(const json& body) {
  if (const json* t = member(body, "tools"); t && !(t->is_array() && t->empty())) return true;
  if (member(body, "tool_choice") || member(body, "parallel_tool_calls")) return true;
  // The template controls: the tool path renders with the checkpoint's template and honours them.
  if (member(body, "add_generation_prompt") || member(body, "continue_final_message")) return true;
  // A per-request thinking switch: the tool path renders it and parses the reasoning out.
  if (const json* kw = member(body, "chat_template_kwargs");
      kw && kw->is_object() && member(*kw, "enable_thinking"))
    return true;
  if (const json* msgs = member(body, "messages"); msgs && msgs->is_array())
    for (const json& m : *msgs)
      if (m.is_object() && (m.value("role", json()) == "tool" || member(m, "tool_calls") ||
                            member(m, "reasoning_content") || member(m, "reasoning")))
        return true;
  return false;
}

GenerationRequest parse_generation_fields(const json& body) {
  GenerationRequest r;
  parse_common(body, r);
  return r;
}

json chat_message_json(const ParsedOutput& parsed,
                       const std::function<std::string()>& new_call_id) {
  json msg = {{"role", "assistant"},
              {"content", parsed.content ? json(*parsed.content) : json(nullptr)}};
  if (parsed.reasoning) msg["reasoning_content"] = *parsed.reasoning;
  if (!parsed.tool_calls.empty()) {
    json calls = json::array();
    for (const ParsedToolCall& c : parsed.tool_calls)
      calls.push_back({{"id", new_call_id()},
                       {"type", "function"},
                       {"function", {{"name", c.name}, {"arguments", c.arguments.dump()}}}});
    msg["tool_calls"] = std::move(calls);
  }
  return msg;
}

json chat_tool_completion_json(const ResponseMeta& m, const std::string& raw_text,
                               bool stopped_on_stop_token, int64_t prompt_tokens,
                               int64_t completion_tokens,
                               const std::function<std::string()>& new_call_id) {
  const ParsedOutput parsed = parse_model_output(raw_text);
  const json usage = usage_json(prompt_tokens, completion_tokens);
  return completion_envelope(
      m, "chat.completion",
      one_choice("message", chat_message_json(parsed, new_call_id),
                 tool_finish_reason(parsed, raw_text, stopped_on_stop_token)),
      &usage);
}

std::vector<json> chat_delta_chunks(const ResponseMeta& m, const OutputDelta& d,
                                    const std::function<std::string()>& new_call_id) {
  std::vector<json> out;
  if (!d.reasoning.empty())
    out.push_back(chat_chunk_json(m, {{"reasoning_content", d.reasoning}}, std::nullopt));
  if (!d.content.empty()) out.push_back(chat_chunk_json(m, {{"content", d.content}}, std::nullopt));
  for (size_t k = 0; k < d.tool_calls.size(); ++k) {
    const ParsedToolCall& c = d.tool_calls[k];
    out.push_back(chat_chunk_json(
        m,
        {{"tool_calls",
          json::array({{{"index", d.first_call_index + k},
                        {"id", new_call_id()},
                        {"type", "function"},
                        {"function", {{"name", c.name}, {"arguments", c.arguments.dump()}}}}})}},
        std::nullopt));
  }
  return out;
}

}  // namespace gemstage::server
