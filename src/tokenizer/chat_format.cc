#include "tokenizer/chat_format.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"
#include "template/jinja.h"
#include "tokenizer/chat_output.h"
#include "tokenizer/utf8.h"

namespace gemstage {

using nlohmann::json;

namespace {

constexpr std::string_view kBosText = "<bos>";
constexpr std::string_view kTurnOpenText = "<|turn>";
constexpr std::string_view kTurnCloseText = "<turn|>";
constexpr std::string_view kThinkText = "<|think|>";
constexpr std::string_view kImageOpenText = "<|image>";
constexpr std::string_view kImageSoftText = "<|image|>";
constexpr std::string_view kImageCloseText = "<image|>";
constexpr std::string_view kAudioOpenText = "<|audio>";
constexpr std::string_view kAudioSoftText = "<|audio|>";
constexpr std::string_view kAudioCloseText = "<audio|>";
constexpr std::string_view kVideoSoftText = "<|video|>";
constexpr std::string_view kChannelOpenText = "<|channel>";
constexpr std::string_view kChannelCloseText = "<channel|>";

// One step of the rendered prompt: literal text, or a marker that is a single token.
struct Piece {
  enum class Kind { kText, kBos, kTurnOpen, kTurnClose, kThink, kImage, kAudio, kVideoFrame } kind;
  std::string text;
  int32_t image_tokens = 0;
};

class PieceList {
 public:
  void text(std::string_view s) {
    if (s.empty()) return;
    if (!pieces_.empty() && pieces_.back().kind == Piece::Kind::kText)
      pieces_.back().text.append(s);
    else
      pieces_.push_back({Piece::Kind::kText, std::string(s)});
  }
  void marker(Piece::Kind k, int32_t image_tokens = 0) { pieces_.push_back({k, {}, image_tokens}); }
  const std::vector<Piece>& pieces() const { return pieces_; }

 private:
  std::vector<Piece> pieces_;
};

enum class TurnRole { kSystem, kUser, kModel };

TurnRole map_role(const std::string& role, size_t index) {
  if (role == "user") return TurnRole::kUser;
  if (role == "assistant" || role == "model") return TurnRole::kModel;
  if (role == "system") return TurnRole::kSystem;
  if (role == "developer") {
    if (index == 0) return TurnRole::kSystem;
    fail("chat message ", index,
         ": role \"developer\" is only accepted as the first message (it becomes the system turn)");
  }
  fail("chat message ", index, ": unknown role \"", role,
       "\"; use system, user, assistant (or model); tool messages are not supported yet");
}

const char* role_name(TurnRole r) {
  switch (r) {
    case TurnRole::kSystem:
      return "system";
    case TurnRole::kUser:
      return "user";
    case TurnRole::kModel:
      return "model";
  }
  return "";
}

void render_content(PieceList& out, const ChatMessage& m, TurnRole role, size_t index) {
  for (const ChatPart& part : m.parts) {
    if (part.kind == ChatPart::Kind::kText) {
      if (const size_t bad = utf8::find_invalid(part.text); bad != std::string::npos)
        fail("chat message ", index, ": text is not valid UTF-8 (byte ", bad, ")");
      if (role == TurnRole::kModel)
        out.text(strip_thinking(part.text));
      else
        out.text(utf8::trim(part.text));
      continue;
    }
    if (part.kind == ChatPart::Kind::kAudio) {
      if (role != TurnRole::kUser)
        fail("chat message ", index, " (", m.role, "): audio is only supported in user messages");
      if (part.audio_tokens <= 0)
        fail("chat message ", index, ": audio part has ", part.audio_tokens,
             " soft tokens; pass the count the clip yields (> 0)");
      out.marker(Piece::Kind::kAudio, part.audio_tokens);
      continue;
    }
    if (part.kind == ChatPart::Kind::kVideo) {
      if (role != TurnRole::kUser)
        fail("chat message ", index, " (", m.role, "): videos are only supported in user messages");
      if (part.image_tokens <= 0 || part.frame_timestamps.empty())
        fail("chat message ", index, ": video part has ", part.frame_timestamps.size(),
             " frames of ", part.image_tokens, " soft tokens; both must be positive");
      for (size_t f = 0; f < part.frame_timestamps.size(); ++f) {
        if (f) out.text(" ");
        out.text(part.frame_timestamps[f]);
        out.text(" ");
        out.marker(Piece::Kind::kVideoFrame, part.image_tokens);
      }
      continue;
    }
    if (role != TurnRole::kUser)
      fail("chat message ", index, " (", m.role, "): images are only supported in user messages");
    if (part.image_tokens <= 0)
      fail("chat message ", index, ": image part has ", part.image_tokens,
           " soft tokens; pass the count the image processor produced (> 0)");
    out.marker(Piece::Kind::kImage, part.image_tokens);
  }
}

PieceList render_pieces(std::span<const ChatMessage> messages, const ChatOptions& options) {
  PieceList out;
  out.marker(Piece::Kind::kBos);
  size_t next = 0;
  const bool leading_system =
      !messages.empty() && map_role(messages[0].role, 0) == TurnRole::kSystem;
  if (options.enable_thinking || leading_system) {
    out.marker(Piece::Kind::kTurnOpen);
    out.text("system\n");
    if (options.enable_thinking) {
      out.marker(Piece::Kind::kThink);
      out.text("\n");
    }
    if (leading_system) {
      render_content(out, messages[0], TurnRole::kSystem, 0);
      next = 1;
    }
    out.marker(Piece::Kind::kTurnClose);
    out.text("\n");
  }
  for (size_t i = next; i < messages.size(); ++i) {
    const TurnRole role = map_role(messages[i].role, i);
    out.marker(Piece::Kind::kTurnOpen);
    out.text(role_name(role));
    out.text("\n");
    render_content(out, messages[i], role, i);
    // Consecutive assistant messages continue one model turn (revision B).
    while (role == TurnRole::kModel && i + 1 < messages.size() &&
           map_role(messages[i + 1].role, i + 1) == TurnRole::kModel) {
      ++i;
      render_content(out, messages[i], role, i);
    }
    out.marker(Piece::Kind::kTurnClose);
    out.text("\n");
  }
  if (options.add_generation_prompt) {
    out.marker(Piece::Kind::kTurnOpen);
    out.text("model\n");
  }
  return out;
}

std::optional<int32_t> config_id(const json& config, const char* field) {
  if (config.contains(field) && config[field].is_number_integer())
    return config[field].get<int32_t>();
  return std::nullopt;
}

// eos_token_id may be one id or a list of them.
void append_ids(const json& v, const std::string& where, std::vector<int32_t>& out) {
  if (v.is_number_integer()) {
    out.push_back(v.get<int32_t>());
  } else if (v.is_array()) {
    for (const json& e : v) {
      if (!e.is_number_integer()) fail(where, ": eos_token_id entries must be integers");
      out.push_back(e.get<int32_t>());
    }
  } else if (!v.is_null()) {
    fail(where, ": eos_token_id must be an integer or a list of integers");
  }
}

json read_json(const std::string& path) {
  try {
    return json::parse(read_text_file(path));
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON: ", e.what());
  }
}

}  // namespace

std::string strip_thinking(std::string_view text) {
  std::string kept;
  size_t pos = 0;
  while (true) {
    const size_t close = text.find(kChannelCloseText, pos);
    const std::string_view piece =
        text.substr(pos, close == std::string_view::npos ? std::string_view::npos : close - pos);
    const size_t open = piece.find(kChannelOpenText);
    kept.append(open == std::string_view::npos ? piece : piece.substr(0, open));
    if (close == std::string_view::npos) break;
    pos = close + kChannelCloseText.size();
  }
  return std::string(utf8::trim(kept));
}

std::string render_chat_text(std::span<const ChatMessage> messages, const ChatOptions& options) {
  std::string out;
  const PieceList rendered = render_pieces(messages, options);
  for (const Piece& p : rendered.pieces()) {
    switch (p.kind) {
      case Piece::Kind::kText:
        out += p.text;
        break;
      case Piece::Kind::kBos:
        out += kBosText;
        break;
      case Piece::Kind::kTurnOpen:
        out += kTurnOpenText;
        break;
      case Piece::Kind::kTurnClose:
        out += kTurnCloseText;
        break;
      case Piece::Kind::kThink:
        out += kThinkText;
        break;
      case Piece::Kind::kImage:
        out += kImageOpenText;
        for (int32_t i = 0; i < p.image_tokens; ++i) out += kImageSoftText;
        out += kImageCloseText;
        break;
      case Piece::Kind::kAudio:
        out += kAudioOpenText;
        for (int32_t i = 0; i < p.image_tokens; ++i) out += kAudioSoftText;
        out += kAudioCloseText;
        break;
      case Piece::Kind::kVideoFrame:
        out += kImageOpenText;
        for (int32_t i = 0; i < p.image_tokens; ++i) out += kVideoSoftText;
        out += kImageCloseText;
        break;
    }
  }
  return out;
}

ChatTokenIds resolve_chat_token_ids(const Tokenizer& tokenizer,
                                    const std::string& config_json_path) {
  ChatTokenIds ids;
  ids.bos = tokenizer.require_id(kBosText);
  ids.turn_open = tokenizer.require_id(kTurnOpenText);
  ids.turn_close = tokenizer.require_id(kTurnCloseText);
  ids.think = tokenizer.token_to_id(kThinkText);
  ids.image_open = tokenizer.token_to_id(kImageOpenText);
  ids.image_soft = tokenizer.token_to_id(kImageSoftText);
  ids.image_close = tokenizer.token_to_id(kImageCloseText);
  ids.audio_open = tokenizer.token_to_id(kAudioOpenText);
  ids.audio_soft = tokenizer.token_to_id(kAudioSoftText);
  ids.audio_close = tokenizer.token_to_id(kAudioCloseText);
  ids.video_soft = tokenizer.token_to_id(kVideoSoftText);
  if (config_json_path.empty()) return ids;
  const json config = read_json(config_json_path);
  if (!config.is_object()) fail(config_json_path, ": top level is not a JSON object");
  const auto take = [&](const char* field, std::string_view name, std::optional<int32_t>& slot) {
    const auto from_config = config_id(config, field);
    if (!from_config) return;
    if (slot && *slot != *from_config)
      fail(config_json_path, ": ", field, " is ", *from_config, " but the tokenizer (",
           tokenizer.source_path(), ") has \"", name, "\" at id ", *slot,
           "; the config and tokenizer belong to different models");
    if (*from_config < 0 || static_cast<size_t>(*from_config) >= tokenizer.vocab_size())
      fail(config_json_path, ": ", field, " = ", *from_config, " is outside the tokenizer's ",
           tokenizer.vocab_size(), " ids");
    slot = from_config;
  };
  take("boi_token_id", kImageOpenText, ids.image_open);
  take("image_token_id", kImageSoftText, ids.image_soft);
  take("eoi_token_id", kImageCloseText, ids.image_close);
  take("boa_token_id", kAudioOpenText, ids.audio_open);
  take("audio_token_id", kAudioSoftText, ids.audio_soft);
  take("eoa_token_index", kAudioCloseText, ids.audio_close);
  take("video_token_id", kVideoSoftText, ids.video_soft);
  take("eoa_token_id", kAudioCloseText, ids.audio_close);
  return ids;
}

ChatPrompt render_chat(const Tokenizer& tokenizer, const ChatTokenIds& ids,
                       std::span<const ChatMessage> messages, const ChatOptions& options) {
  ChatPrompt prompt;
  const PieceList rendered = render_pieces(messages, options);
  for (const Piece& p : rendered.pieces()) {
    switch (p.kind) {
      case Piece::Kind::kText: {
        const std::vector<int32_t> t = tokenizer.encode(p.text);
        prompt.ids.insert(prompt.ids.end(), t.begin(), t.end());
        break;
      }
      case Piece::Kind::kBos:
        prompt.ids.push_back(ids.bos);
        break;
      case Piece::Kind::kTurnOpen:
        prompt.ids.push_back(ids.turn_open);
        break;
      case Piece::Kind::kTurnClose:
        prompt.ids.push_back(ids.turn_close);
        break;
      case Piece::Kind::kThink:
        if (!ids.think)
          fail(tokenizer.source_path(),
               ": has no \"<|think|>\" token, so enable_thinking cannot "
               "be rendered for this model");
        prompt.ids.push_back(*ids.think);
        break;
      case Piece::Kind::kImage:
        if (!ids.image_open || !ids.image_soft || !ids.image_close)
          fail(tokenizer.source_path(),
               ": lacks the image markers <|image>, <|image|>, <image|> (and config.json gives no "
               "boi/image/eoi token ids), so image parts cannot be rendered");
        prompt.ids.push_back(*ids.image_open);
        prompt.images.push_back({prompt.ids.size(), p.image_tokens});
        prompt.ids.insert(prompt.ids.end(), static_cast<size_t>(p.image_tokens), *ids.image_soft);
        prompt.ids.push_back(*ids.image_close);
        break;
      case Piece::Kind::kAudio:
        if (!ids.audio_open || !ids.audio_soft || !ids.audio_close)
          fail(tokenizer.source_path(),
               ": lacks the audio markers <|audio>, <|audio|>, <audio|> (and config.json gives no "
               "boa/audio/eoa token ids), so audio parts cannot be rendered");
        prompt.ids.push_back(*ids.audio_open);
        prompt.ids.insert(prompt.ids.end(), static_cast<size_t>(p.image_tokens), *ids.audio_soft);
        prompt.ids.push_back(*ids.audio_close);
        break;
      case Piece::Kind::kVideoFrame:
        if (!ids.image_open || !ids.video_soft || !ids.image_close)
          fail(tokenizer.source_path(),
               ": lacks the video markers <|image>, <|video|>, <image|> (and config.json gives no "
               "boi/video/eoi token ids), so video parts cannot be rendered");
        prompt.ids.push_back(*ids.image_open);
        prompt.ids.insert(prompt.ids.end(), static_cast<size_t>(p.image_tokens), *ids.video_soft);
        prompt.ids.push_back(*ids.image_close);
        break;
    }
  }
  return prompt;
}

std::vector<int32_t> load_stop_token_ids(const Tokenizer& tokenizer, const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::vector<int32_t> ids;
  if (!model_dir.empty()) {
    const fs::path gen = fs::path(model_dir) / "generation_config.json";
    const fs::path cfg = fs::path(model_dir) / "config.json";
    if (fs::exists(gen)) {
      const json j = read_json(gen.string());
      if (j.is_object() && j.contains("eos_token_id"))
        append_ids(j["eos_token_id"], gen.string(), ids);
    }
    if (ids.empty() && fs::exists(cfg)) {
      const json j = read_json(cfg.string());
      if (j.is_object() && j.contains("eos_token_id"))
        append_ids(j["eos_token_id"], cfg.string(), ids);
      else if (j.is_object() && j.contains("text_config") && j["text_config"].is_object() &&
               j["text_config"].contains("eos_token_id"))
        append_ids(j["text_config"]["eos_token_id"], cfg.string(), ids);
    }
  }
  for (std::string_view name :
       {std::string_view("<eos>"), kTurnCloseText, std::string_view("<|tool_response>")})
    if (auto id = tokenizer.token_to_id(name)) ids.push_back(*id);
  for (const int32_t id : ids)
    if (id < 0 || static_cast<size_t>(id) >= tokenizer.vocab_size())
      fail(model_dir, ": eos_token_id ", id, " is outside the tokenizer's ", tokenizer.vocab_size(),
           " ids");
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

}  // namespace gemstage

// ---------------------------------------------------------------------------------------------
// The built-in Gemma 4 conversation renderer (tools, calls, results, reasoning).

namespace gemstage {

namespace {

using ojson = nlohmann::ordered_json;

[[noreturn]] void template_raise(const std::string& message) {
  throw Error(message);
}

// Keys in Jinja dictsort order: Python str.lower(), then code point; stable for ties.
std::vector<const std::pair<const std::string, ojson>*> sorted_items(const ojson& obj) {
  std::vector<std::pair<std::string, const std::pair<const std::string, ojson>*>> keyed;
  for (const auto& kv : obj.get_ref<const ojson::object_t&>())
    keyed.emplace_back(jinja::python_lower(kv.first), &kv);
  std::stable_sort(keyed.begin(), keyed.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<const std::pair<const std::string, ojson>*> out;
  for (const auto& k : keyed) out.push_back(k.second);
  return out;
}

std::string upper_ascii(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string python_str(const ojson& v);

// Python str() of a JSON value the way the template would print it ({{ value }}).
std::string python_repr(const ojson& v) {
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    const char q =
        s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, q);
    for (const char c : s) {
      if (c == '\\' || c == q) out += '\\';
      if (c == '\n') {
        out += "\\n";
        continue;
      }
      out += c;
    }
    return out + q;
  }
  return python_str(v);
}

std::string python_str(const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::null:
      return "None";
    case ojson::value_t::boolean:
      return v.get<bool>() ? "True" : "False";
    case ojson::value_t::number_integer:
      return std::to_string(v.get<int64_t>());
    case ojson::value_t::number_unsigned:
      return std::to_string(v.get<uint64_t>());
    case ojson::value_t::number_float:
      return jinja::python_float_repr(v.get<double>());
    case ojson::value_t::string:
      return v.get<std::string>();
    case ojson::value_t::array: {
      std::string out = "[";
      for (size_t k = 0; k < v.size(); ++k) out += (k ? ", " : "") + python_repr(v[k]);
      return out + "]";
    }
    case ojson::value_t::object: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.items()) {
        out += (first ? "" : ", ") + python_repr(ojson(k)) + ": " + python_repr(x);
        first = false;
      }
      return out + "}";
    }
    default:
      return "";
  }
}

// format_argument: values of calls, results, enums and items' extra keys.
void format_argument(std::string& out, const ojson& v, bool quote_keys, int depth = 0) {
  if (depth > 256) fail("chat template: a value is nested more than 256 levels deep");
  switch (v.type()) {
    case ojson::value_t::null:
      out += "null";
      return;
    case ojson::value_t::string:
      out += kToolStringQuote;
      out += v.get_ref<const std::string&>();
      out += kToolStringQuote;
      return;
    case ojson::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      return;
    case ojson::value_t::array:
      out += '[';
      for (size_t k = 0; k < v.size(); ++k) {
        if (k) out += ',';
        format_argument(out, v[k], quote_keys, depth + 1);
      }
      out += ']';
      return;
    case ojson::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto* kv : sorted_items(v)) {
        if (!first) out += ',';
        first = false;
        if (quote_keys) {
          out += kToolStringQuote;
          out += kv->first;
          out += kToolStringQuote;
        } else {
          out += kv->first;
        }
        out += ':';
        format_argument(out, kv->second, quote_keys, depth + 1);
      }
      out += '}';
      return;
    }
    default:
      out += python_str(v);
  }
}

const ojson* field(const ojson& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  const auto it = obj.find(key);
  return it == obj.end() ? nullptr : &*it;
}

bool truthy(const ojson* v) {
  if (!v || v->is_null()) return false;
  if (v->is_boolean()) return v->get<bool>();
  if (v->is_string()) return !v->get_ref<const std::string&>().empty();
  if (v->is_array() || v->is_object()) return !v->empty();
  if (v->is_number_float()) return v->get<double>() != 0;
  if (v->is_number()) return v->get<int64_t>() != 0;
  return true;
}

// str(type).upper(); a missing type is empty.
std::string type_text(const ojson& schema) {
  const ojson* t = field(schema, "type");
  return t ? upper_ascii(python_str(*t)) : std::string();
}

void quoted(std::string& out, std::string_view s) {
  out += kToolStringQuote;
  out += s;
  out += kToolStringQuote;
}

void render_properties(std::string& out, const ojson& props, int depth);

void render_items(std::string& out, const ojson& items, int depth) {
  bool first = true;
  for (const auto* kv : sorted_items(items)) {
    if (kv->second.is_null()) continue;
    if (!first) out += ',';
    first = false;
    const std::string& k = kv->first;
    if (k == "properties") {
      out += "properties:{";
      render_properties(out, kv->second, depth + 1);
      out += '}';
    } else if (k == "required") {
      out += "required:";
      format_argument(out, kv->second, true);
    } else if (k == "type") {
      out += "type:";
      if (kv->second.is_array()) {
        out += '[';
        for (size_t j = 0; j < kv->second.size(); ++j) {
          if (j) out += ',';
          quoted(out, upper_ascii(python_str(kv->second[j])));
        }
        out += ']';
      } else {
        quoted(out, type_text(items));
      }
    } else {
      out += k;
      out += ':';
      format_argument(out, kv->second, true);
    }
  }
}

void render_property(std::string& out, const ojson& schema, int depth) {
  if (depth > 64) fail("chat template: a tool schema is nested more than 64 levels deep");
  const std::string type = type_text(schema);
  std::vector<std::string> fields;
  if (const ojson* d = field(schema, "description"); truthy(d)) {
    std::string f = "description:";
    quoted(f, d->is_string() ? d->get<std::string>() : python_str(*d));
    fields.push_back(std::move(f));
  }
  if (type == "STRING") {
    if (const ojson* e = field(schema, "enum"); truthy(e)) {
      std::string f = "enum:";
      format_argument(f, *e, true);
      fields.push_back(std::move(f));
    }
  } else if (type == "ARRAY") {
    if (const ojson* it = field(schema, "items"); it && it->is_object() && !it->empty()) {
      std::string f = "items:{";
      render_items(f, *it, depth);
      f += '}';
      fields.push_back(std::move(f));
    }
  }
  if (truthy(field(schema, "nullable"))) fields.push_back("nullable:true");
  if (type == "OBJECT") {
    const ojson* props = field(schema, "properties");
    ojson leftover = ojson::object();
    if (!props || !props->is_object()) {
      if (schema.is_object())
        for (const auto& [k, v] : schema.items())
          if (k != "description" && k != "type" && k != "properties" && k != "required" &&
              k != "nullable")
            leftover[k] = v;
      props = &leftover;
    }
    if (!props->empty()) {
      std::string f = "properties:{";
      render_properties(f, *props, depth + 1);
      f += '}';
      fields.push_back(std::move(f));
    }
    if (const ojson* r = field(schema, "required"); truthy(r)) {
      std::string f = "required:";
      format_argument(f, *r, true);
      fields.push_back(std::move(f));
    }
  }
  std::string f = "type:";
  quoted(f, type);
  fields.push_back(std::move(f));
  for (size_t k = 0; k < fields.size(); ++k) {
    if (k) out += ',';
    out += fields[k];
  }
}

void render_properties(std::string& out, const ojson& props, int depth) {
  bool first = true;
  for (const auto* kv : sorted_items(props)) {
    if (!first) out += ',';
    first = false;
    out += kv->first;
    out += ":{";
    render_property(out, kv->second, depth);
    out += '}';
  }
}

void render_tool(std::string& out, const ojson& tool, size_t index) {
  const ojson* type = field(tool, "type");
  const ojson* fn = field(tool, "function");
  if (!type || !type->is_string() || *type != "function" || !fn || !fn->is_object())
    fail("tools[", index,
         "]: only {\"type\": \"function\", \"function\": {...}} tools can be rendered");
  const ojson* name = field(*fn, "name");
  if (!name || !name->is_string()) fail("tools[", index, "].function.name must be a string");
  out += "<|tool>declaration:";
  out += name->get<std::string>();
  out += "{description:";
  const ojson* desc = field(*fn, "description");
  quoted(out, desc && !desc->is_null()
                  ? (desc->is_string() ? desc->get<std::string>() : python_str(*desc))
                  : "");
  if (const ojson* params = field(*fn, "parameters"); truthy(params)) {
    if (!params->is_object()) fail("tools[", index, "].function.parameters must be an object");
    out += ",parameters:{";
    if (const ojson* props = field(*params, "properties"); truthy(props)) {
      if (!props->is_object())
        fail("tools[", index, "].function.parameters.properties must be an object");
      out += "properties:{";
      render_properties(out, *props, 0);
      out += "},";
    }
    if (const ojson* req = field(*params, "required"); truthy(req)) {
      out += "required:";
      format_argument(out, *req, true);
      out += ',';
    }
    if (field(*params, "type")) {
      out += "type:";
      quoted(out, type_text(*params));
      out += '}';
    }
  }
  if (const ojson* resp = field(*fn, "response")) {
    out += ",response:{";
    if (const ojson* d = field(*resp, "description"); truthy(d)) {
      out += "description:";
      quoted(out, d->is_string() ? d->get<std::string>() : python_str(*d));
      out += ',';
    }
    out += "type:";
    quoted(out, type_text(*resp));
    out += '}';
  }
  out += "}<tool|>";
}

const char* media_marker(const std::string& type) {
  if (type == "image" || type == "image_url" || type == "input_image") return "<|image|>";
  if (type == "audio" || type == "input_audio" || type == "audio_url") return "<|audio|>";
  if (type == "video" || type == "video_url") return "<|video|>";
  return nullptr;
}

std::string text_of(const ojson& v) {
  return v.is_string() ? v.get<std::string>() : python_str(v);
}

enum class ContentStyle { kTrim, kStripThinking, kSystemFirst };

// A message's content: strings trimmed (or stripped of thinking for the model), parts rendered
// one by one with media parts as placeholders.
void render_message_content(std::string& out, const ojson* content, ContentStyle style,
                            size_t index) {
  if (!content || content->is_null()) return;
  auto clean = [&](const std::string& s) {
    return style == ContentStyle::kStripThinking ? strip_thinking(s) : std::string(utf8::trim(s));
  };
  if (content->is_string()) {
    out += clean(content->get<std::string>());
    return;
  }
  if (!content->is_array())
    fail("messages[", index, "].content must be a string, a list of parts or null");
  for (const ojson& part : *content) {
    const ojson* type = field(part, "type");
    const ojson* text = field(part, "text");
    if (style == ContentStyle::kSystemFirst) {
      out += text && text->is_string() ? std::string(utf8::trim(text->get<std::string>())) : "";
      out += ' ';
      continue;
    }
    if (type && type->is_string() && *type == "text") {
      out += text ? clean(text_of(*text)) : "";
      continue;
    }
    if (type && type->is_string())
      if (const char* marker = media_marker(type->get<std::string>())) {
        out += marker;
        continue;
      }
    if (part.is_string()) {
      out += clean(part.get<std::string>());
      continue;
    }
  }
}

std::string role_of(const ojson& m, size_t index) {
  const ojson* r = field(m, "role");
  if (!r || !r->is_string()) fail("messages[", index, "].role must be a string");
  return r->get<std::string>();
}

// A call's {name, arguments}: OpenAI nests them under "function".
const ojson& call_function(const ojson& call) {
  const ojson* fn = field(call, "function");
  return fn && fn->is_object() ? *fn : call;
}

void render_call(std::string& out, const ojson& call) {
  const ojson& fn = call_function(call);
  const ojson* name = field(fn, "name");
  out += "<|tool_call>call:";
  out += name ? text_of(*name) : "";
  const ojson* args = field(fn, "arguments");
  if (args && args->is_string())
    template_raise(
        "chat_template: tool_calls[].function.arguments must be a JSON object (mapping), not a "
        "string. Deserialize arguments before passing to the template.");
  if (!args || args->is_null()) {
    out += "{}";
  } else if (args->is_object()) {
    format_argument(out, *args, false);
  } else {
    template_raise(
        "chat_template: tool_calls[].function.arguments must be a JSON object (mapping)");
  }
  out += "<tool_call|>";
}

// The name a tool result is filed under: the call with the same id (missing ids match each
// other; the last match wins), else the message's name, else "unknown".
std::string result_name(const ojson& result, const ojson& calls) {
  const ojson* id = field(result, "tool_call_id");
  std::optional<std::string> name;
  for (const ojson& call : calls) {
    const ojson* cid = field(call, "id");
    const bool same = (!id && !cid) || (id && cid && *id == *cid);
    if (same) {
      const ojson* n = field(call_function(call), "name");
      name = n ? text_of(*n) : "";
    }
  }
  if (name) return *name;
  if (const ojson* n = field(result, "name"); n && n->is_string()) return n->get<std::string>();
  return "unknown";
}

void render_result(std::string& out, const ojson& result, const std::string& name, size_t index) {
  out += "<|tool_response>response:";
  out += name;
  out += "{value:";
  const ojson* content = field(result, "content");
  std::string media;
  if (!content || content->is_null()) {
    out += "null";
  } else if (content->is_string()) {
    format_argument(out, *content, false);
  } else if (content->is_array()) {
    std::string text;
    for (const ojson& part : *content) {
      const ojson* type = field(part, "type");
      const std::string t = type && type->is_string() ? type->get<std::string>() : "";
      if (t == "text") {
        if (const ojson* tx = field(part, "text")) text += text_of(*tx);
      } else if (const char* marker = media_marker(t)) {
        media += marker;
      }
    }
    format_argument(out, ojson(text), false);
  } else if (content->is_object()) {
    template_raise(detail::concat(
        "messages[", index,
        "].content: a tool result must be a string or a list of parts, not a JSON object"));
  } else {
    format_argument(out, *content, false);
  }
  out += "}<tool_response|>";
  out += media;
}

}  // namespace

std::string render_conversation(const ojson& messages, const ojson& tools,
                                const ConversationOptions& options) {
  if (!messages.is_array()) fail("messages must be a list");
  if (!tools.is_null() && !tools.is_array()) fail("tools must be a list or null");
  const bool has_tools = tools.is_array() && !tools.empty();
  std::string out = "<bos>";
  size_t first = 0;
  const bool system_first = !messages.empty() && (role_of(messages[0], 0) == "system" ||
                                                  role_of(messages[0], 0) == "developer");
  if (options.enable_thinking || has_tools || system_first) {
    out += "<|turn>system\n";
    if (options.enable_thinking) out += "<|think|>\n";
    if (system_first) {
      render_message_content(out, field(messages[0], "content"), ContentStyle::kSystemFirst, 0);
      first = 1;
    }
    if (has_tools)
      for (size_t k = 0; k < tools.size(); ++k) render_tool(out, tools[k], k);
    out += "<turn|>\n";
  }
  size_t last_user = std::string::npos;
  for (size_t i = 0; i < messages.size(); ++i)
    if (role_of(messages[i], i) == "user") last_user = i;

  bool continuing = false;  // the previous assistant message left its model turn open for this one
  // What the last non-tool message ended with, for the generation prompt.
  enum class Ending { kText, kPendingCall, kResult } ending = Ending::kText;
  for (size_t i = first; i < messages.size(); ++i) {
    const ojson& m = messages[i];
    const std::string role = role_of(m, i);
    if (role == "tool") continue;  // folded into the assistant message before it, or dropped
    if (role != "assistant" && role != "model") {
      out += "<|turn>";
      out += role == "developer" ? "system" : role;
      out += '\n';
      render_message_content(out, field(m, "content"), ContentStyle::kTrim, i);
      out += "<turn|>\n";
      continuing = false;
      ending = Ending::kText;
      continue;
    }
    if (!continuing) out += "<|turn>model\n";
    continuing = false;
    const ojson* calls = field(m, "tool_calls");
    const bool has_calls = calls && calls->is_array() && !calls->empty();
    if (calls && !calls->is_null() && !calls->is_array())
      fail("messages[", i, "].tool_calls must be a list");
    const ojson* reasoning = field(m, "reasoning");
    if (!truthy(reasoning)) reasoning = field(m, "reasoning_content");
    const bool after_last_user = last_user == std::string::npos || i > last_user;
    if (truthy(reasoning) && (after_last_user || (options.preserve_thinking && has_calls))) {
      out += "<|channel>thought\n";
      out += text_of(*reasoning);
      out += "\n<channel|>";
    }
    if (has_calls)
      for (const ojson& call : *calls) render_call(out, call);
    size_t results = 0;
    size_t next = i + 1;
    if (has_calls) {
      for (; next < messages.size() && role_of(messages[next], next) == "tool"; ++next) {
        render_result(out, messages[next], result_name(messages[next], *calls), next);
        ++results;
      }
    }
    if (const ojson* legacy = field(m, "tool_responses"); legacy && legacy->is_array()) {
      for (const ojson& r : *legacy) {
        const ojson* n = field(r, "name");
        out += "<|tool_response>response:";
        out += n ? text_of(*n) : "unknown";
        const ojson* resp = field(r, "response");
        if (resp && resp->is_object()) {
          format_argument(out, *resp, false);
        } else {
          out += "{value:";
          format_argument(out, resp ? *resp : ojson(nullptr), false);
          out += '}';
        }
        out += "<tool_response|>";
        ++results;
      }
    }
    std::string content;
    render_message_content(content, field(m, "content"), ContentStyle::kStripThinking, i);
    out += content;
    while (next < messages.size() && role_of(messages[next], next) == "tool") ++next;
    const bool more = next < messages.size();
    const bool next_is_model = more && (role_of(messages[next], next) == "assistant" ||
                                        role_of(messages[next], next) == "model");
    if (has_calls && results == 0) {
      out += "<|tool_response>";
      ending = Ending::kPendingCall;
    } else if (next_is_model) {
      continuing = true;
      ending = results ? Ending::kResult : Ending::kText;
    } else if (results && content.empty() && !more) {
      ending = Ending::kResult;
    } else {
      out += "<turn|>\n";
      ending = results ? Ending::kResult : Ending::kText;
    }
  }
  if (options.add_generation_prompt) {
    if (ending == Ending::kText)
      out += "<|turn>model\n";
    else if (ending == Ending::kResult && options.enable_thinking)
      out += "<|channel>thought\n";
  }
  return out;
}

}  // namespace gemstage

namespace gemstage {

ConversationRenderer::ConversationRenderer() = default;

ConversationRenderer ConversationRenderer::from_template_source(std::string_view source,
                                                                std::string name) {
  ConversationRenderer r;
  try {
    r.template_ = std::make_shared<const jinja::Template>(source, name);
  } catch (const jinja::TemplateError& e) {
    fail(e.what());
  }
  r.source_ = std::move(name);
  return r;
}

ConversationRenderer ConversationRenderer::for_model_dir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path jinja_file = fs::path(dir) / "chat_template.jinja";
  const fs::path config_file = fs::path(dir) / "tokenizer_config.json";
  std::string bos = "<bos>";
  std::optional<std::string> source;
  std::string name;
  if (fs::exists(config_file)) {
    const json cfg = read_json(config_file.string());
    if (cfg.is_object()) {
      if (const auto it = cfg.find("bos_token"); it != cfg.end()) {
        if (it->is_string()) bos = it->get<std::string>();
        if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
          bos = (*it)["content"].get<std::string>();
      }
      if (const auto it = cfg.find("chat_template"); it != cfg.end()) {
        if (it->is_string()) {
          source = it->get<std::string>();
        } else if (it->is_array()) {
          // Named templates: [{"name": "default", "template": ...}, ...]
          for (const json& t : *it)
            if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
                t["template"].is_string())
              source = t["template"].get<std::string>();
        }
        name = config_file.string() + " chat_template";
      }
    }
  }
  if (fs::exists(jinja_file)) {
    source = read_text_file(jinja_file.string());
    name = jinja_file.string();
  }
  ConversationRenderer r = source ? from_template_source(*source, name) : ConversationRenderer();
  r.bos_token_ = bos;
  return r;
}

namespace {

// The rendered conversation cut right after the last message's text, so that text is left open
// (as vLLM does it: the template closes the turn, the cut reopens it).
std::string continue_final_message(std::string rendered, const nlohmann::ordered_json& messages) {
  if (!messages.is_array() || messages.empty() || !messages.back().is_object() ||
      messages.back().value("role", std::string()) != "assistant")
    fail("continue_final_message needs the last message to be the assistant's");
  const auto& last = messages.back();
  const nlohmann::ordered_json content =
      last.contains("content") ? last["content"] : nlohmann::ordered_json();
  std::string text;
  if (content.is_string()) {
    text = content.get<std::string>();
  } else if (content.is_array()) {
    for (const auto& part : content)
      if (part.is_object() && part.value("type", std::string()) == "text")
        text += part.value("text", std::string());
  }
  for (const std::string_view candidate : {std::string_view(text), utf8::trim(text)}) {
    if (candidate.empty()) continue;
    const size_t at = rendered.rfind(candidate);
    if (at != std::string::npos) {
      rendered.resize(at + candidate.size());
      return rendered;
    }
  }
  fail(
      "continue_final_message: the last assistant message has no text the chat template "
      "writes out, so there is nothing to continue");
}

}  // namespace

std::string ConversationRenderer::render(const nlohmann::ordered_json& messages,
                                         const nlohmann::ordered_json& tools,
                                         const ConversationOptions& options) const {
  if (options.continue_final_message) {
    if (options.add_generation_prompt)
      fail("continue_final_message and add_generation_prompt cannot both be true");
    ConversationOptions closed = options;
    closed.continue_final_message = false;
    return continue_final_message(render(messages, tools, closed), messages);
  }
  if (!template_) return render_conversation(messages, tools, options);
  const auto& t = *static_cast<const jinja::Template*>(template_.get());
  nlohmann::ordered_json ctx = {{"messages", messages},
                                {"tools", tools},
                                {"add_generation_prompt", options.add_generation_prompt},
                                {"enable_thinking", options.enable_thinking},
                                {"preserve_thinking", options.preserve_thinking},
                                {"bos_token", bos_token_},
                                {"eos_token", "<eos>"}};
  try {
    return t.render(ctx);
  } catch (const jinja::TemplateRaised& e) {
    throw Error(e.what());
  } catch (const jinja::TemplateError& e) {
    throw Error(e.what());
  }
}

}  // namespace gemstage
