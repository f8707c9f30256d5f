#include "tokenizer/chat_format.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/mapped_file.h"
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
constexpr std::string_view kChannelOpenText = "<|channel>";
constexpr std::string_view kChannelCloseText = "<channel|>";

// One step of the rendered prompt: literal text, or a marker that is a single token.
struct Piece {
  enum class Kind { kText, kBos, kTurnOpen, kTurnClose, kThink, kImage, kAudio } kind;
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
