// Gemma 4 E-series conversation format, following docs/gemma4-chat-format.md.
// Pinned to template revision B (the later upstream revision, which the DiffusionGemma test ids
// and gemma4-spec.md 5.2 agree with): `<|think|>\n` opens a thinking system turn, images are
// inlined with no surrounding newlines, consecutive assistant messages share one model turn, and
// with thinking off the generation prompt is just `<|turn>model\n`. Tool calls are not rendered.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace gemstage {

struct ChatPart {
  enum class Kind { kText, kImage, kAudio, kVideo };
  Kind kind = Kind::kText;
  std::string text;          // kText
  int32_t image_tokens = 0;  // kImage: N, the soft-token count of the image; kVideo: per frame
  int32_t audio_tokens = 0;  // kAudio: N, the soft-token count of the clip
  std::vector<std::string> frame_timestamps;  // kVideo: "MM:SS" of each sampled frame

  static ChatPart Text(std::string t) { return {Kind::kText, std::move(t), 0}; }
  static ChatPart Image(int32_t soft_tokens) { return {Kind::kImage, {}, soft_tokens}; }
  // Rendered <|audio> + N × <|audio|> + <audio|> (the processor's expansion of one <|audio|>).
  static ChatPart Audio(int32_t soft_tokens) { return {Kind::kAudio, {}, 0, soft_tokens}; }
  // Rendered as Gemma4Processor expands one <|video|>: per frame "MM:SS " + <|image> +
  // N × <|video|> + <image|>, frames joined by single spaces (docs/video.md). The timestamp text
  // joins the text around it before tokenization, as the processor's text replacement does.
  static ChatPart Video(int32_t soft_tokens_per_frame, std::vector<std::string> timestamps) {
    return {Kind::kVideo, {}, soft_tokens_per_frame, 0, std::move(timestamps)};
  }
};

struct ChatMessage {
  std::string role;  // system, developer (first message only), user, assistant or model
  std::vector<ChatPart> parts;
};

struct ChatOptions {
  bool add_generation_prompt = true;
  bool enable_thinking = false;
};

// The ids the format writes as markers, looked up by their strings in the loaded tokenizer;
// image ids come from config.json (boi_token_id, image_token_id, eoi_token_id, video_token_id)
// where it has them.
struct ChatTokenIds {
  int32_t bos = -1;
  int32_t turn_open = -1;              // <|turn>
  int32_t turn_close = -1;             // <turn|>
  std::optional<int32_t> think;        // <|think|>
  std::optional<int32_t> image_open;   // <|image>
  std::optional<int32_t> image_soft;   // <|image|>
  std::optional<int32_t> image_close;  // <image|>
  std::optional<int32_t> audio_open;   // <|audio>
  std::optional<int32_t> audio_soft;   // <|audio|>
  std::optional<int32_t> audio_close;  // <audio|>
  std::optional<int32_t> video_soft;   // <|video|> (config video_token_id)
};

// config_json_path may be empty (no config): then every id comes from the tokenizer.
ChatTokenIds resolve_chat_token_ids(const Tokenizer& tokenizer,
                                    const std::string& config_json_path = {});

// Where the soft tokens of one image sit in a rendered prompt.
struct ChatImageSpan {
  size_t first_soft_token;  // index into ChatPrompt::ids of the first <|image|>
  int32_t count;
};

struct ChatPrompt {
  std::vector<int32_t> ids;
  std::vector<ChatImageSpan> images;  // in message order
};

// The prompt as the HF template plus processor would produce it, as text (images expanded to
// <|image>, N x <|image|>, <image|>). Throws gemstage::Error on an unknown role or misplaced image.
std::string render_chat_text(std::span<const ChatMessage> messages, const ChatOptions& options);

// The same prompt as ids. Message text is tokenized as HF does after applying the template:
// special-token strings typed inside it are parsed as those tokens.
ChatPrompt render_chat(const Tokenizer& tokenizer, const ChatTokenIds& ids,
                       std::span<const ChatMessage> messages, const ChatOptions& options);

// What a stored assistant reply contributes to history: every <|channel>...<channel|> span (and an
// unclosed trailing <|channel>...) removed, then trimmed.
std::string strip_thinking(std::string_view text);

// ---------------------------------------------------------------------------------------------
// OpenAI-style conversations with tools, following docs/gemma4-tools.md: the
// built-in renderer for checkpoints that ship no chat template. It writes exactly what Google's
// E-series template (header "Published: 2026-07-09") writes: tool declarations, assistant
// tool_calls, role:"tool" results folded into the model turn, reasoning, system / developer
// turns, and one <|image|> / <|audio|> / <|video|> placeholder per media part (before the
// processor expands placeholders).
struct ConversationOptions {
  bool add_generation_prompt = true;
  // vLLM's and llama.cpp's continue_final_message: the last message (an assistant's) is left
  // open, so generation continues its text; needs add_generation_prompt false.
  bool continue_final_message = false;
  bool enable_thinking = false;
  bool preserve_thinking = false;
};

// messages: [{role, content (string, parts list or null), tool_calls, tool_call_id, name,
// reasoning / reasoning_content, tool_responses}]; tools: OpenAI tool list (or null). Throws
// gemstage::Error where the template raises (string tool-call arguments, a non-function tool,
// content of a type the template cannot print), with the template's message where it has one.
std::string render_conversation(const nlohmann::ordered_json& messages,
                                const nlohmann::ordered_json& tools,
                                const ConversationOptions& options);

// The conversation renderer of one checkpoint: its own chat template when it ships one
// (chat_template.jinja, else tokenizer_config.json's "chat_template"), run by the Jinja
// interpreter (template/jinja.h) the way transformers' apply_chat_template runs it; the built-in
// render_conversation otherwise. Errors, including the template's raise_exception, are
// gemstage::Error with the template's message.
class ConversationRenderer {
 public:
  ConversationRenderer();  // built-in
  static ConversationRenderer for_model_dir(const std::string& dir);
  static ConversationRenderer from_template_source(std::string_view source, std::string name);

  std::string render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                     const ConversationOptions& options) const;
  // "built-in", or the file the template came from.
  const std::string& source() const { return source_; }

 private:
  std::shared_ptr<const void> template_;  // a jinja::Template; null: built-in
  std::string source_ = "built-in";
  std::string bos_token_ = "<bos>";
};

// Generation stops on: generation_config.json eos_token_id if the model directory has one, else
// config.json's (top level or text_config), plus the tokenizer's <eos>, <turn|> and
// <|tool_response>, whichever exist. Sorted, no duplicates. model_dir may be empty.
std::vector<int32_t> load_stop_token_ids(const Tokenizer& tokenizer, const std::string& model_dir);

}  // namespace gemstage
