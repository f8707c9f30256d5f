#include "runtime/assistant.h"

#include <filesystem>

#include "audio/audio_features.h"
#include "core/error.h"
#include "gemma4/multimodal.h"
#include "image/unified_image.h"
#include "runtime/sampler.h"

namespace gemstage {

namespace fs = std::filesystem;

Assistant::Assistant(std::shared_ptr<const Model> m, Tokenizer t)
    : model_(std::move(m)), tok_(std::move(t)) {}

std::unique_ptr<Assistant> Assistant::open(const std::string& path, int64_t max_context,
                                           std::optional<KvType> kv_type,
                                           const ModelOpener& models) {
  auto model = models.open(path);
  // A sequence checks the context against the model's limits; make one now so a bad -c fails
  // at start rather than at the first request.
  const int64_t ctx = Sequence(model, max_context, kv_type).max_context();
  const std::string dir = model->assets_dir();
  if (!fs::exists(fs::path(dir) / "tokenizer.json"))
    fail(dir,
         " has no tokenizer.json; generate/chat/serve need the checkpoint's tokenizer (random "
         "checkpoints "
         "have none: use dump --ids instead)");
  std::unique_ptr<Assistant> a(new Assistant(std::move(model), Tokenizer::from_model_dir(dir)));
  a->max_context_ = ctx;
  a->kv_type_ = kv_type;
  const fs::path cfg = fs::path(dir) / "config.json";
  a->chat_ids_ = resolve_chat_token_ids(a->tok_, fs::exists(cfg) ? cfg.string() : std::string());
  a->stop_ids_ = load_stop_token_ids(a->tok_, dir);
  a->suppress_tokens_ = load_suppress_tokens(dir);
  a->renderer_ = ConversationRenderer::for_model_dir(dir);
  a->image_cfg_ = load_processor_config(dir);
  a->video_cfg_ = load_video_processor_config(dir);
  a->name_ = fs::path(path).lexically_normal().filename().string();
  if (a->name_.empty())
    a->name_ = fs::path(path).lexically_normal().parent_path().filename().string();
  if (static_cast<int64_t>(a->tok_.vocab_size()) > a->model_->config().text.vocab_size)
    fail(dir, ": tokenizer.json has ", a->tok_.vocab_size(),
         " tokens but the model's vocabulary is ", a->model_->config().text.vocab_size,
         "; the tokenizer does not belong to this model");
  return a;
}

struct Assistant::MediaInputs {
  std::vector<VisionInput> images;
  std::vector<AudioInput> clips;
  // gemma4_unified: patches and raw frames for its embedders (no towers).
  std::vector<UnifiedImageInput> unified_images;
  std::vector<UnifiedAudioInput> unified_clips;
  int videos = 0, video_frames = 0;  // video frames are `images` entries too, in prompt order
  int image_count() const {
    return static_cast<int>(images.size() + unified_images.size()) - video_frames;
  }
  int audio_count() const { return static_cast<int>(clips.size() + unified_clips.size()); }
};

VideoProcessorConfig Assistant::video_config(const VideoSource& src) const {
  VideoProcessorConfig c = video_cfg_;
  if (src.num_frames) c.num_frames = src.num_frames;
  if (src.max_soft_tokens) c.frame.max_soft_tokens = src.max_soft_tokens;
  const std::string what = src.what.empty() ? src.path : src.what;
  c.validate(what);
  const int64_t most = max_video_prompt_tokens(c);
  if (most >= max_context_)
    fail(what, ": ", c.num_frames, " frames of up to ", c.frame.max_soft_tokens,
         " soft tokens can take ", most, " prompt tokens but the context holds ", max_context_,
         "; sample fewer frames (--video-frames), a lower budget (--video-budget) or raise "
         "--ctx-size");
  return c;
}

std::shared_ptr<const ProcessedVideo> Assistant::load_video(const VideoSource& src) const {
  const VideoProcessorConfig c = video_config(src);
  std::unique_ptr<VideoDecoder> d;
  if (src.bytes)
    d = VideoDecoder::open_memory(*src.bytes, src.what.empty() ? "video" : src.what);
  else
    d = VideoDecoder::open_file(src.path);
  return std::make_shared<const ProcessedVideo>(process_video(*d, c));
}

ChatPart Assistant::add_media(const ChatInputPart& p, MediaInputs& in) const {
  if (p.is_video()) {
    // Frames go through the vision tower like images (docs/video.md, "Model").
    if (model_->embeddings().unified() || !model_->vision())
      fail(model_->path(), ": this model has no vision tower, so it cannot take video");
    const std::shared_ptr<const ProcessedVideo> v = p.video ? p.video : load_video(*p.video_source);
    const size_t frame_values = static_cast<size_t>(v->max_patches) * v->patch_dim;
    const size_t frame_positions = static_cast<size_t>(v->max_patches) * 2;
    std::vector<std::string> stamps;
    for (int f = 0; f < v->num_frames; ++f) {
      const auto values = v->pixel_values.begin() + static_cast<ptrdiff_t>(f * frame_values);
      const auto positions = v->position_ids.begin() + static_cast<ptrdiff_t>(f * frame_positions);
      in.images.push_back(
          {v->max_patches,
           std::vector<float>(values, values + static_cast<ptrdiff_t>(frame_values)),
           std::vector<int64_t>(positions, positions + static_cast<ptrdiff_t>(frame_positions))});
      stamps.push_back(format_timestamp(v->timestamps[static_cast<size_t>(f)]));
    }
    ++in.videos;
    in.video_frames += v->num_frames;
    return ChatPart::Video(v->num_soft_tokens_per_frame, std::move(stamps));
  }
  if (const UnifiedEmbedder* unified = model_->embeddings().unified()) {
    if (p.audio) {
      if (!unified->has_audio())
        fail(model_->path(), ": this model has no audio_config, so it cannot take audio");
      in.unified_clips.push_back(
          unified_audio_frames(p.audio->samples, unified->audio_config().frame_samples));
      return ChatPart::Audio(
          static_cast<int32_t>(unified->num_audio_soft_tokens(in.unified_clips.back())));
    }
    if (!unified->has_vision())
      fail(model_->path(), ": this model has no vision_config, so it cannot take images");
    const UnifiedPatches up = preprocess_unified_image(*p.image, image_cfg_);
    in.unified_images.push_back({up.max_soft_tokens, up.pixel_values, up.position_ids});
    return ChatPart::Image(up.num_soft_tokens);
  }
  if (p.audio) {
    if (!model_->audio())
      fail(model_->path(),
           ": this model has no audio tower (no audio_config), so it cannot "
           "take audio");
    const LogMelFeatures f = log_mel_features(
        p.audio->samples, ("audio clip " + std::to_string(in.clips.size() + 1)).c_str());
    in.clips.push_back({f.frames, f.values, f.mask});
    return ChatPart::Audio(
        static_cast<int32_t>(model_->audio()->num_soft_tokens(in.clips.back().mask)));
  }
  if (!model_->vision())
    fail(model_->path(), ": this model has no vision tower, so it cannot take images");
  const ProcessedImage pi = preprocess_image(*p.image, image_cfg_);
  in.images.push_back({pi.max_patches, pi.pixel_values, pi.position_ids});
  return ChatPart::Image(pi.num_soft_tokens);
}

void Assistant::encode_media(ThreadPool& pool, const MediaInputs& in, PreparedPrompt& out) const {
  out.images = in.image_count();
  out.audios = in.audio_count();
  out.videos = in.videos;
  FloatTensor image_soft, audio_soft;
  if (!in.images.empty()) image_soft = model_->embeddings().encode_images(pool, in.images, nullptr);
  if (!in.clips.empty()) audio_soft = model_->embeddings().encode_audio(pool, in.clips, nullptr);
  if (const UnifiedEmbedder* unified = model_->embeddings().unified()) {
    if (!in.unified_images.empty())
      image_soft = unified->encode_images(pool, in.unified_images, nullptr);
    if (!in.unified_clips.empty())
      audio_soft = unified->encode_audio(pool, in.unified_clips, nullptr);
  }
  out.soft_tokens =
      merge_soft_tokens(model_->config(), out.ids, image_soft.data.empty() ? nullptr : &image_soft,
                        audio_soft.data.empty() ? nullptr : &audio_soft);
}

PreparedPrompt Assistant::prepare_chat(ThreadPool& pool, const std::vector<ChatInput>& messages,
                                       const ChatOptions& options) const {
  std::vector<ChatMessage> rendered;
  MediaInputs media;
  for (const ChatInput& m : messages) {
    ChatMessage cm{m.role, {}};
    for (const ChatInputPart& p : m.parts)
      cm.parts.push_back(p.is_media() ? add_media(p, media) : ChatPart::Text(p.text));
    rendered.push_back(std::move(cm));
  }
  PreparedPrompt out;
  out.ids = render_chat(tok_, chat_ids_, rendered, options).ids;
  encode_media(pool, media, out);
  return out;
}

std::unique_ptr<Sequence> Assistant::new_sequence() const {
  return std::make_unique<Sequence>(model_, max_context_, kv_type_);
}

// Gemma4Processor replaces each <|video|> the template wrote with the frames' text (timestamps,
// markers, soft-token placeholders) before tokenizing, so the timestamps tokenize together with
// the text around them; this does the same. The placeholders must come in the order of `parts`.
void Assistant::expand_video_placeholders(std::string& text,
                                          const std::vector<ChatPart>& parts) const {
  static constexpr std::string_view kMarkers[] = {"<|image|>", "<|audio|>", "<|video|>"};
  static constexpr ChatPart::Kind kKinds[] = {ChatPart::Kind::kImage, ChatPart::Kind::kAudio,
                                              ChatPart::Kind::kVideo};
  if (!chat_ids_.image_open || !chat_ids_.image_close || !chat_ids_.video_soft)
    fail(tok_.source_path(),
         ": lacks the <|image>, <image|> or <|video|> tokens, so this model cannot take video");
  const std::string open = tok_.id_to_token(*chat_ids_.image_open);
  const std::string close = tok_.id_to_token(*chat_ids_.image_close);
  const std::string soft = tok_.id_to_token(*chat_ids_.video_soft);
  size_t pos = 0, next_part = 0;
  for (;;) {
    size_t at = std::string::npos, which = 0;
    for (size_t m = 0; m < 3; ++m) {
      const size_t f = text.find(kMarkers[m], pos);
      if (f < at) at = f, which = m;
    }
    if (at == std::string::npos) break;
    if (next_part >= parts.size() || parts[next_part].kind != kKinds[which])
      fail(
          "the chat template rendered the conversation's images, audio clips and videos in "
          "another order or number than its messages hold them (a placeholder typed in a "
          "message's text counts too)");
    const ChatPart& part = parts[next_part++];
    if (part.kind != ChatPart::Kind::kVideo) {
      pos = at + kMarkers[which].size();
      continue;
    }
    std::string frames;
    for (size_t f = 0; f < part.frame_timestamps.size(); ++f) {
      if (f) frames += ' ';
      frames += part.frame_timestamps[f] + " " + open;
      for (int32_t k = 0; k < part.image_tokens; ++k) frames += soft;
      frames += close;
    }
    text.replace(at, kMarkers[which].size(), frames);
    pos = at + frames.size();
  }
  if (next_part != parts.size())
    fail("the chat template rendered ", next_part,
         " image, audio and video placeholders but the "
         "conversation has ",
         parts.size(), " media parts");
}

PreparedPrompt Assistant::prepare_conversation(const nlohmann::ordered_json& messages,
                                               const nlohmann::ordered_json& tools,
                                               const ConversationOptions& options,
                                               std::span<const ChatInputPart> media,
                                               ThreadPool* pool) const {
  MediaInputs inputs;
  std::vector<ChatPart> parts;  // each medium as the chat format renders it, in order
  for (const ChatInputPart& p : media) {
    if (!p.is_media())
      fail("prepare_conversation: a media part holds no image, audio clip or video");
    parts.push_back(add_media(p, inputs));
  }
  std::string text = renderer_.render(messages, tools, options);
  if (inputs.videos) {
    expand_video_placeholders(text, parts);
    std::erase_if(parts, [](const ChatPart& p) { return p.kind == ChatPart::Kind::kVideo; });
  }
  PreparedPrompt out;
  // The rendered text writes <bos> itself; special-token strings in it become their ids. The
  // template writes one <|image|> / <|audio|> per media part; the processor then replaces each
  // with its open marker, N soft-token placeholders and its close marker
  // (docs/gemma4-chat-format.md 3.5), which is the same at the id level because the
  // tokenizer never merges a special token with its neighbours.
  const std::vector<int32_t> raw = tok_.encode(text, /*add_special=*/false, /*parse_special=*/true);
  const std::optional<int32_t> image_at = chat_ids_.image_soft, audio_at = chat_ids_.audio_soft;
  int images_given = 0, images_rendered = 0, audios_rendered = 0;
  for (const ChatPart& p : parts) images_given += p.kind == ChatPart::Kind::kImage;
  const int audios_given = static_cast<int>(parts.size()) - images_given;
  for (int32_t id : raw) {
    images_rendered += image_at && id == *image_at;
    audios_rendered += audio_at && id == *audio_at;
  }
  if (images_rendered != images_given || audios_rendered != audios_given)
    fail("the chat template rendered ", images_rendered, " image and ", audios_rendered,
         " audio placeholders (<|image|>, <|audio|>) but the conversation has ", images_given,
         " images and ", audios_given,
         " audio clips (a placeholder typed in a message's text counts too)");
  size_t next_part = 0;
  out.ids.reserve(raw.size());
  for (int32_t id : raw) {
    const bool is_image = image_at && id == *image_at;
    const bool is_audio = audio_at && id == *audio_at;
    if (!is_image && !is_audio) {
      out.ids.push_back(id);
      continue;
    }
    const ChatPart& part = parts[next_part++];
    if ((part.kind == ChatPart::Kind::kImage) != is_image)
      fail(
          "the chat template rendered the conversation's images and audio clips in another "
          "order than its messages hold them");
    const auto open = is_image ? chat_ids_.image_open : chat_ids_.audio_open;
    const auto close = is_image ? chat_ids_.image_close : chat_ids_.audio_close;
    if (!open || !close)
      fail(tok_.source_path(), ": lacks the ",
           is_image ? "<|image>, <image|>" : "<|audio>, <audio|>",
           " markers, so this model cannot take ", is_image ? "images" : "audio");
    out.ids.push_back(*open);
    out.ids.insert(out.ids.end(), is_image ? part.image_tokens : part.audio_tokens, id);
    out.ids.push_back(*close);
  }
  if (!parts.empty() || inputs.videos) {
    if (!pool) fail("prepare_conversation: media need a thread pool for the towers");
    encode_media(*pool, inputs, out);
  }
  static constexpr std::string_view kOpenThought = "<|channel>thought\n";
  if (text.size() >= kOpenThought.size() &&
      text.compare(text.size() - kOpenThought.size(), kOpenThought.size(), kOpenThought) == 0)
    out.generation_prefix = kOpenThought;
  return out;
}

PreparedPrompt Assistant::prepare_raw(const std::string& text, bool add_bos) const {
  PreparedPrompt out;
  if (add_bos) out.ids.push_back(chat_ids_.bos);
  const std::vector<int32_t> t = tok_.encode(text, false);
  out.ids.insert(out.ids.end(), t.begin(), t.end());
  return out;
}

}  // namespace gemstage
