#include "runtime/generation.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>

#include "core/error.h"
#include "gemma4/multimodal.h"
#include "runtime/speculative.h"

namespace gemstage {

namespace {

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

TokenStream::TokenStream(const Tokenizer* tokenizer, const std::vector<int32_t>& prompt,
                         const GenerationOptions& opt)
    : tok_(tokenizer), opt_(opt), sampler_(opt.sampling), history_(prompt) {
  if (tok_) decoder_.emplace(*tok_, /*skip_special=*/!opt.keep_special_text);
  for (const std::string& s : opt_.stop_strings)
    if (s.empty()) fail("stop strings must not be empty");
  if (!tok_ && (!opt_.stop_strings.empty() || opt_.json_grammar || opt_.tool_call_grammar))
    fail("stop strings and output constraints need the model's tokenizer");
  res_.finish_reason = "length";
  if (opt_.json_grammar && opt_.tool_call_grammar)
    fail("a JSON output format and forced tool calls cannot be combined");
  if (opt_.json_grammar)
    constraint_.emplace(opt_.json_grammar, ConstraintVocabulary::of(*tok_), opt_.stop_ids);
  if (opt_.tool_call_grammar)
    constraint_.emplace(opt_.tool_call_grammar, ConstraintVocabulary::of(*tok_), opt_.stop_ids);
  if (opt_.max_tokens <= 0) finish("length", true, {});
}

bool TokenStream::emit_until(size_t end, const TextCallback& on_text) {
  if (end <= emitted_) return true;
  const bool go_on =
      !on_text || on_text(std::string_view(res_.text).substr(emitted_, end - emitted_));
  emitted_ = end;
  return go_on;
}

void TokenStream::finish(const std::string& reason, bool flush, const TextCallback& on_text) {
  res_.finish_reason = reason;
  done_ = true;
  // Text held back as a possible stop-string prefix is released once generation is over.
  if (flush) {
    if (decoder_) res_.text += decoder_->flush();
    emit_until(res_.text.size(), on_text);
  }
}

void TokenStream::end(const std::string& reason, const TextCallback& on_text) {
  if (!done_) finish(reason, reason != "cancelled", on_text);
}

std::optional<int32_t> TokenStream::next(const float* logits, int64_t vocab, bool has_room,
                                         const TextCallback& on_text) {
  if (done_) return std::nullopt;
  if (opt_.cancel && opt_.cancel->load(std::memory_order_relaxed)) {
    finish("cancelled", false, on_text);
    return std::nullopt;
  }
  const float* raw_logits = logits;
  logits = without_banned(raw_logits, 1, vocab);
  int32_t id = -1;
  if (!constraint_) {
    id = sampler_.sample(logits, vocab, history_);
  } else {
    if (constraint_->complete() && opt_.stop_ids.empty()) {
      // A closed value with no stop id to end on (--ignore-eos): it ends here.
      finish("stop", true, on_text);
      return std::nullopt;
    }
    // The unconstrained draw first, kept when the grammar allows it; otherwise a draw from the
    // masked logits. With plain temperature sampling this is exactly a draw from the masked
    // distribution (the allowed ids keep their relative weights); with top-k / top-p / min-p the
    // first draw's truncation sees the unmasked distribution. It spares most steps the scan of
    // the whole vocabulary that the mask costs.
    id = sampler_.sample(logits, vocab, history_);
    if (!constraint_->allows(id)) {
      if (logits != masked_.data()) masked_.assign(logits, logits + vocab);
      if (constraint_->mask(masked_.data(), vocab) == 0)
        fail("constrained decoding: no token of the vocabulary continues the JSON value");
      id = sampler_.sample(masked_.data(), vocab, history_);
    }
    constraint_->accept(id);
  }
  return take(id, raw_logits, vocab, has_room, on_text);
}

const float* TokenStream::without_banned(const float* raw_logits, int64_t rows, int64_t vocab) {
  if (opt_.banned_ids.empty()) return raw_logits;
  masked_.assign(raw_logits, raw_logits + rows * vocab);
  for (int64_t r = 0; r < rows; ++r)
    for (const int32_t b : opt_.banned_ids)
      if (b >= 0 && b < vocab)
        masked_[static_cast<size_t>(r * vocab + b)] = -std::numeric_limits<float>::infinity();
  return masked_.data();
}

std::optional<int32_t> TokenStream::next_verified(const float* logits, int64_t vocab,
                                                  std::span<const int32_t> drafts,
                                                  const std::function<bool(int64_t)>& has_room,
                                                  const TextCallback& on_text, int* accepted) {
  *accepted = 0;
  if (constraint_) fail("drafts cannot be verified under an output constraint");
  if (done_) return std::nullopt;
  if (opt_.cancel && opt_.cancel->load(std::memory_order_relaxed)) {
    finish("cancelled", false, on_text);
    return std::nullopt;
  }
  const auto rows = static_cast<int64_t>(drafts.size()) + 1;
  const float* decide = without_banned(logits, rows, vocab);
  const VerifyOutcome v = speculative_verify(decide, vocab, drafts, &sampler_, history_);
  *accepted = v.accepted;
  std::optional<int32_t> fed;
  for (int64_t j = 0; j <= v.accepted; ++j) {
    const int32_t id = j < v.accepted ? drafts[static_cast<size_t>(j)] : v.next;
    fed = take(id, logits + j * vocab, vocab, has_room(j), on_text);
    if (!fed) return std::nullopt;
  }
  return fed;
}

std::optional<int32_t> TokenStream::take(int32_t id, const float* raw_logits, int64_t vocab,
                                         bool has_room, const TextCallback& on_text) {
  if (std::find(opt_.stop_ids.begin(), opt_.stop_ids.end(), id) != opt_.stop_ids.end()) {
    finish("stop", true, on_text);
    return std::nullopt;
  }
  res_.tokens.push_back(id);
  if (opt_.top_logprobs >= 0)
    res_.logprobs.push_back(token_logprob(raw_logits, vocab, id, opt_.top_logprobs));
  history_.push_back(id);
  std::string& text = res_.text;
  // Ids the tokenizer does not name (padding rows of a larger model vocabulary) decode to
  // nothing, as HF's decode skips them.
  if (tok_ && tok_->has_id(id)) text += decoder_->push(id);
  size_t cut = std::string::npos;
  for (const std::string& s : opt_.stop_strings) {
    const size_t at = text.find(s);
    if (at < cut) res_.stop_string = s;
    cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    text.resize(cut);
    emit_until(text.size(), on_text);
    finish("stop", false, on_text);
    return std::nullopt;
  }
  if (!emit_until(text.size() - held_back(text, opt_.stop_strings), on_text)) {
    finish("cancelled", false, on_text);
    return std::nullopt;
  }
  if (++step_ >= opt_.max_tokens) {
    finish("length", true, on_text);
    return std::nullopt;
  }
  if (!has_room) {
    finish("context", true, on_text);
    return std::nullopt;
  }
  return id;
}

TokenLogprob token_logprob(const float* logits, int64_t vocab, int32_t id, int top) {
  TokenLogprob out;
  out.id = id;
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) mx = std::max(mx, logits[i]);
  double sum = 0;
  for (int64_t i = 0; i < vocab; ++i) sum += std::exp(static_cast<double>(logits[i]) - mx);
  const double log_z = static_cast<double>(mx) + std::log(sum);
  out.logprob = static_cast<float>(logits[id] - log_z);
  const auto k = static_cast<size_t>(std::min<int64_t>(std::max(top, 0), vocab));
  if (k == 0) return out;
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) idx[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(k), idx.end(),
                    [&](int32_t a, int32_t b) {
                      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
                    });
  for (size_t j = 0; j < k; ++j)
    out.top.emplace_back(idx[j], static_cast<float>(logits[idx[j]] - log_z));
  return out;
}

}  // namespace gemstage
