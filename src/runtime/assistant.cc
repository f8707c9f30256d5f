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
                                           std::optional<KvType> kv_type) {
  auto model = Model::open(path);
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
  a->name_ = fs::path(path).lexically_normal().filename().string();
  if (a->name_.empty())
    a->name_ = fs::path(path).lexically_normal().parent_path().filename().string();
  if (static_cast<int64_t>(a->tok_.vocab_size()) > a->model_->config().text.vocab_size)
    fail(dir, ": tokenizer.json has ", a->tok_.vocab_size(),
         " tokens but the model's vocabulary is ", a->model_->config().text.vocab_size,
         "; the tokenizer does not belong to this model");
  return a;
}

PreparedPrompt Assistant::prepare_chat(ThreadPool& pool, const std::vector<ChatInput>& messages,
                                       const ChatOptions& options) const {
  std::vector<ChatMessage> rendered;
  std::vector<VisionInput> images;
  std::vector<AudioInput> clips;
  // gemma4_unified: patches and raw frames for its embedders (no towers).
  const UnifiedEmbedder* unified = model_->embeddings().unified();
  std::vector<UnifiedImageInput> unified_images;
  std::vector<UnifiedAudioInput> unified_clips;
  for (const ChatInput& m : messages) {
    ChatMessage cm{m.role, {}};
    for (const ChatInputPart& p : m.parts) {
      if (unified && (p.audio || p.image)) {
        if (p.audio) {
          if (!unified->has_audio())
            fail(model_->path(), ": this model has no audio_config, so it cannot take audio");
          unified_clips.push_back(
              unified_audio_frames(p.audio->samples, unified->audio_config().frame_samples));
          cm.parts.push_back(ChatPart::Audio(
              static_cast<int32_t>(unified->num_audio_soft_tokens(unified_clips.back()))));
        } else {
          if (!unified->has_vision())
            fail(model_->path(), ": this model has no vision_config, so it cannot take images");
          const UnifiedPatches up = preprocess_unified_image(*p.image, image_cfg_);
          unified_images.push_back({up.max_soft_tokens, up.pixel_values, up.position_ids});
          cm.parts.push_back(ChatPart::Image(up.num_soft_tokens));
        }
        continue;
      }
      if (p.audio) {
        if (!model_->audio())
          fail(model_->path(),
               ": this model has no audio tower (no audio_config), so it cannot "
               "take audio");
        const LogMelFeatures f = log_mel_features(
            p.audio->samples, ("audio clip " + std::to_string(clips.size() + 1)).c_str());
        clips.push_back({f.frames, f.values, f.mask});
        cm.parts.push_back(ChatPart::Audio(
            static_cast<int32_t>(model_->audio()->num_soft_tokens(clips.back().mask))));
        continue;
      }
      if (!p.image) {
        cm.parts.push_back(ChatPart::Text(p.text));
        continue;
      }
      if (!model_->vision())
        fail(model_->path(), ": this model has no vision tower, so it cannot take images");
      const ProcessedImage pi = preprocess_image(*p.image, image_cfg_);
      images.push_back({pi.max_patches, pi.pixel_values, pi.position_ids});
      cm.parts.push_back(ChatPart::Image(pi.num_soft_tokens));
    }
    rendered.push_back(std::move(cm));
  }
  PreparedPrompt out;
  out.ids = render_chat(tok_, chat_ids_, rendered, options).ids;
  out.images = static_cast<int>(images.size() + unified_images.size());
  out.audios = static_cast<int>(clips.size() + unified_clips.size());
  FloatTensor image_soft, audio_soft;
  if (!images.empty()) image_soft = model_->embeddings().encode_images(pool, images, nullptr);
  if (!clips.empty()) audio_soft = model_->embeddings().encode_audio(pool, clips, nullptr);
  if (!unified_images.empty()) image_soft = unified->encode_images(pool, unified_images, nullptr);
  if (!unified_clips.empty()) audio_soft = unified->encode_audio(pool, unified_clips, nullptr);
  out.soft_tokens =
      merge_soft_tokens(model_->config(), out.ids, image_soft.data.empty() ? nullptr : &image_soft,
                        audio_soft.data.empty() ? nullptr : &audio_soft);
  return out;
}

std::unique_ptr<Sequence> Assistant::new_sequence() const {
  return std::make_unique<Sequence>(model_, max_context_, kv_type_);
}

PreparedPrompt Assistant::prepare_conversation(const nlohmann::ordered_json& messages,
                                               const nlohmann::ordered_json& tools,
                                               const ConversationOptions& options) const {
  for (const auto& m : messages)
    if (m.is_object() && m.contains("content") && m["content"].is_array())
      for (const auto& part : m["content"])
        if (part.is_object() && part.value("type", "") != "text")
          fail("media parts together with tool calling are not supported yet; send text only");
  const std::string text = renderer_.render(messages, tools, options);
  PreparedPrompt out;
  // The rendered text writes <bos> itself; special-token strings in it become their ids.
  out.ids = tok_.encode(text, /*add_special=*/false, /*parse_special=*/true);
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
