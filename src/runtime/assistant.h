// Everything a chat front end needs around a model: the model (HF dir or bundle), its
// tokenizer, the chat-format marker ids, the stop ids and the image processor settings, plus
// turning a conversation with images into prompt ids and soft tokens. generate, chat and serve
// all go through here, so they build byte-identical prompts. An Assistant is read-only once
// open: serve loads one and gives each conversation its own Sequence.
#pragma once

#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "audio/audio_decode.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "stage/sequence.h"
#include "tokenizer/chat_format.h"
#include "tokenizer/tokenizer.h"
#include "video/video_processor.h"

namespace gemstage {

// A video as a front end receives it: a file, or the bytes of one (a data URL), and the sampling
// asked for (0: the model's video processor setting). Decoded when the prompt is prepared.
struct VideoSource {
  std::string path;                                   // a file, or
  std::shared_ptr<const std::vector<uint8_t>> bytes;  // its bytes
  std::string what;                                   // names it in errors (default: path)
  int num_frames = 0;                                 // --video-frames
  int max_soft_tokens = 0;                            // --video-budget: soft tokens per frame
};

struct ChatInputPart {
  std::string text;
  std::optional<RgbImage> image;   // set for an image part
  std::optional<AudioClip> audio;  // set for an audio part (mono 16 kHz)
  // A video part: decoded and preprocessed already (Assistant::load_video; chat keeps it across
  // turns), or its source, decoded when the prompt is prepared.
  std::shared_ptr<const ProcessedVideo> video;
  std::optional<VideoSource> video_source;
  bool is_video() const { return video || video_source; }
  bool is_media() const { return image || audio || is_video(); }
};

struct ChatInput {
  std::string role;  // system, user, assistant / model
  std::vector<ChatInputPart> parts;
};

struct PreparedPrompt {
  std::vector<int32_t> ids;
  FloatTensor soft_tokens;  // [N, D] for the prompt's placeholder rows (empty without media)
  int images = 0;
  int audios = 0;  // audio clips
  int videos = 0;
  // The soft tokens to splice, or null for a prompt without images or audio.
  const FloatTensor* soft() const { return soft_tokens.numel() ? &soft_tokens : nullptr; }
  // prepare_conversation: model-turn text the prompt already ends with (e.g. "<|channel>thought\n"
  // after a tool result with thinking on); the output parser reads it before the generated text.
  std::string generation_prefix;
};

class Assistant {
 public:
  // path: HF checkpoint dir or bundle; max_context 0: the model's maximum.
  // kv_type: the KV cache's row type of every sequence; nullopt keeps the model's default.
  // models: how the front end opens models (a bundle spread over MPI ranks; else whole).
  static std::unique_ptr<Assistant> open(const std::string& path, int64_t max_context = 0,
                                         std::optional<KvType> kv_type = std::nullopt,
                                         const ModelOpener& models = {});

  const Model& model() const { return *model_; }
  const std::shared_ptr<const Model>& shared_model() const { return model_; }
  // A new, empty conversation on this model (its own KV caches), sized for max_context().
  std::unique_ptr<Sequence> new_sequence() const;
  int64_t max_context() const { return max_context_; }
  const Tokenizer& tokenizer() const { return tok_; }
  const std::vector<int32_t>& stop_ids() const { return stop_ids_; }
  // generation_config.json suppress_tokens (SamplingParams::suppress_tokens).
  const std::vector<int32_t>& suppress_tokens() const { return suppress_tokens_; }
  const std::string& model_name() const { return name_; }
  // The chat template prepare_conversation renders with (llama-server's /apply-template, /props).
  const ConversationRenderer& renderer() const { return renderer_; }

  // Renders the Gemma 4 chat format (images decoded into soft tokens by the vision tower, audio
  // clips by the audio tower, each spliced at its own placeholder rows).
  PreparedPrompt prepare_chat(ThreadPool& pool, const std::vector<ChatInput>& messages,
                              const ChatOptions& options) const;
  // An OpenAI-style conversation (tools, tool calls, results, reasoning) rendered by the
  // checkpoint's chat template, or the built-in one, and tokenized as HF tokenizes a rendered
  // template. `media` holds the conversation's images and audio clips in the order their parts
  // ({"type": "image"} / {"type": "audio"}) appear in `messages`; each placeholder the template
  // writes is expanded as the processor expands it (<|image> + N x <|image|> + <image|>), so the
  // ids and soft tokens equal prepare_chat's for the same conversation. `pool` runs the towers
  // (needed only with media). A placeholder count that differs from `media` is a gemstage::Error.
  PreparedPrompt prepare_conversation(const nlohmann::ordered_json& messages,
                                      const nlohmann::ordered_json& tools,
                                      const ConversationOptions& options,
                                      std::span<const ChatInputPart> media = {},
                                      ThreadPool* pool = nullptr) const;
  // A raw prompt: <bos> (unless add_bos is false) + the tokenized text, no chat markers.
  PreparedPrompt prepare_raw(const std::string& text, bool add_bos = true) const;

  // The checkpoint's video processor settings (video_preprocessor_config.json or
  // processor_config.json's video_processor, else Gemma4VideoProcessor's defaults) with the
  // source's frame count and per-frame budget where it sets them. Throws when the video could take
  // more tokens than the context holds (frames x (budget + markers + timestamp)).
  VideoProcessorConfig video_config(const VideoSource& src) const;
  // Decodes, samples and preprocesses a video (docs/video.md); errors name src.what.
  std::shared_ptr<const ProcessedVideo> load_video(const VideoSource& src) const;

 private:
  struct MediaInputs;  // the towers' inputs of one prompt's images and clips
  Assistant(std::shared_ptr<const Model> m, Tokenizer t);
  // One image, audio or video part preprocessed into `in`; the part as the chat format renders
  // it.
  ChatPart add_media(const ChatInputPart& p, MediaInputs& in) const;
  // Replaces each <|video|> of a rendered conversation with its frames' text (parts: every
  // medium in order, as add_media rendered it).
  void expand_video_placeholders(std::string& text, const std::vector<ChatPart>& parts) const;
  // Runs the towers over `in` and splices their soft tokens at out.ids' placeholder rows.
  void encode_media(ThreadPool& pool, const MediaInputs& in, PreparedPrompt& out) const;
  std::shared_ptr<const Model> model_;
  int64_t max_context_ = 0;
  std::optional<KvType> kv_type_;
  Tokenizer tok_;
  ChatTokenIds chat_ids_;
  ConversationRenderer renderer_;
  std::vector<int32_t> stop_ids_;
  std::vector<int32_t> suppress_tokens_;
  ImageProcessorConfig image_cfg_;
  VideoProcessorConfig video_cfg_;
  std::string name_;
};

}  // namespace gemstage
