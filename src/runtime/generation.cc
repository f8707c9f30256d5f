#include "runtime/generation.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "gemma4/multimodal.h"

namespace gemstage {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Bytes at the end of `text` that could still grow into a stop string.
size_t held_back(const std::string& text, const std::vector<std::string>& stops) {
  size_t hold = 0;
  for (const std::string& s : stops)
    for (size_t k = std::min(s.size() - 1, text.size()); k > hold; --k)
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        hold = k;
        break;
      }
  return hold;
}
}  // namespace

GenerationSession::GenerationSession(Sequence& sequence, const Tokenizer& tokenizer)
    : seq_(sequence), tok_(tokenizer) {}

void GenerationSession::reset() {
  seq_.reset();
}

GenerationResult GenerationSession::generate(ThreadPool& pool, const std::vector<int32_t>& prompt,
                                             const FloatTensor* soft_tokens,
                                             const GenerationOptions& opt,
                                             const TextCallback& on_text) {
  GenerationResult res;
  res.prompt_tokens = static_cast<int64_t>(prompt.size());
  if (prompt.empty()) fail("the prompt is empty");
  if (static_cast<int64_t>(prompt.size()) >= seq_.max_context())
    fail("the prompt has ", prompt.size(), " tokens but the context holds ", seq_.max_context(),
         "; shorten the prompt or raise --ctx-size / -c");
  for (const std::string& s : opt.stop_strings)
    if (s.empty()) fail("stop strings must not be empty");

  // Reuse the cached prefix only if the caches hold exactly a prefix of this prompt (and leave at
  // least one new token to produce logits from).
  const std::vector<int32_t>& held = seq_.tokens();
  size_t common = 0;
  while (common < held.size() && common + 1 < prompt.size() && held[common] == prompt[common])
    ++common;
  // On the large models an image's rows see each other: the new part must not start inside one.
  const auto keep = static_cast<size_t>(
      chunk_end_keeping_images_whole(seq_.config(), prompt, 0, static_cast<int64_t>(common)));
  common = keep <= common ? keep : 0;
  if (common < held.size()) {
    // The new prompt diverges inside what is cached (e.g. a reply re-tokenized differently):
    // roll the caches back to the common prefix, or start over if they cannot go that far.
    if (common == 0 || !seq_.truncate(static_cast<int64_t>(common))) {
      reset();
      common = 0;
    }
  }
  res.reused_tokens = static_cast<int64_t>(common);
  const std::span<const int32_t> rest(prompt.data() + common, prompt.size() - common);
  FloatTensor soft_rest;
  const FloatTensor* soft = nullptr;
  if (soft_tokens && soft_tokens->numel() > 0) {
    const int64_t skip =
        count_placeholders(seq_.config(), std::span<const int32_t>(prompt.data(), common));
    const int64_t n = soft_tokens->dim(0) - skip;
    if (n > 0) {
      soft_rest = slice_rows(*soft_tokens, skip, n);
      soft = &soft_rest;
    }
  }
  const double t0 = now();
  FloatTensor logits = seq_.prefill(pool, rest, soft, opt.chunk, false, nullptr);
  res.prefill_seconds = now() - t0;

  Sampler sampler(opt.sampling);
  StreamDecoder decoder(tok_, /*skip_special=*/!opt.keep_special_text);
  std::string text;
  size_t emitted = 0;
  const int64_t V = seq_.config().text.vocab_size;
  std::vector<int32_t> history = prompt;
  const double t1 = now();
  auto emit_until = [&](size_t end) {
    if (end > emitted) {
      const bool go_on = !on_text || on_text(std::string_view(text).substr(emitted, end - emitted));
      emitted = end;
      return go_on;
    }
    return true;
  };
  res.finish_reason = "length";
  bool hit_stop_string = false;
  for (int step = 0; step < opt.max_tokens; ++step) {
    if (opt.cancel && opt.cancel->load(std::memory_order_relaxed)) {
      res.finish_reason = "cancelled";
      break;
    }
    const int32_t id = sampler.sample(logits.row(logits.dim(0) - 1), V, history);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), id) != opt.stop_ids.end()) {
      res.finish_reason = "stop";
      break;
    }
    res.tokens.push_back(id);
    history.push_back(id);
    // Ids the tokenizer does not name (padding rows of a larger model vocabulary) decode to
    // nothing, as HF's decode skips them.
    if (tok_.has_id(id)) text += decoder.push(id);
    size_t cut = std::string::npos;
    for (const std::string& s : opt.stop_strings) cut = std::min(cut, text.find(s));
    if (cut != std::string::npos) {
      text.resize(cut);
      emit_until(text.size());
      res.finish_reason = "stop";
      hit_stop_string = true;
      break;
    }
    if (!emit_until(text.size() - held_back(text, opt.stop_strings))) {
      res.finish_reason = "cancelled";
      break;
    }
    if (step + 1 == opt.max_tokens) break;
    if (seq_.n_past() + 1 > seq_.max_context()) {
      res.finish_reason = "context";
      break;
    }
    logits = seq_.forward(pool, std::span<const int32_t>(&id, 1), nullptr, false, nullptr);
  }
  // Text held back as a possible stop-string prefix is released once generation is over.
  if (!hit_stop_string && res.finish_reason != "cancelled") {
    text += decoder.flush();
    emit_until(text.size());
  }
  res.text = text;
  res.decode_seconds = now() - t1;
  return res;
}

}  // namespace gemstage
