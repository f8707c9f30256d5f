// The per-token half of generation: what to generate (GenerationOptions), how each next id is
// chosen from the logits and when generation ends (TokenStream: stop ids, stop strings,
// max_tokens, the context limit, cancellation), and the streamed UTF-8-complete text. The engine
// (runtime/engine.h) runs the model and drives one TokenStream per request.
#pragma once

#include <atomic>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/thread_pool.h"
#include "runtime/json_constraint.h"
#include "runtime/sampler.h"
#include "stage/sequence.h"
#include "tokenizer/tokenizer.h"

namespace gemstage {

struct GenerationOptions {
  int max_tokens = 256;
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;
  std::vector<std::string> stop_strings;
  int64_t chunk = 512;  // prefill chunk size
  // Checked before every decoded token: when it turns true the generation ends as "cancelled".
  // The text callback alone cannot do this, since tokens that decode to no text (a partial UTF-8
  // sequence, an unnamed id) never reach it; a server uses this to drop a vanished client.
  const std::atomic<bool>* cancel = nullptr;
  // Keep special tokens (<|tool_call>, <|channel>, <|"|>, ...) in the text: the tool-call and
  // reasoning parser (tokenizer/chat_output.h) needs them as markers.
  bool keep_special_text = false;
  // Constrained decoding (runtime/json_constraint.h): the text is one JSON value of this
  // grammar, then a stop id. Null: free text.
  std::shared_ptr<const JsonGrammar> json_grammar;
  // Forced tool calls (tool_choice required / a named function); at most one of the two.
  std::shared_ptr<const ToolCallGrammar> tool_call_grammar;
  // Ids never sampled (tool_choice "none" bans <|tool_call>).
  std::vector<int32_t> banned_ids;
  // Record each generated token's log-probability and this many most likely alternatives
  // (OpenAI's logprobs / top_logprobs); -1: off.
  int top_logprobs = -1;
};

// A generated token's log-probability under the model's own distribution (the softmax of its
// logits, before temperature, penalties or constraints), and the most likely alternatives.
struct TokenLogprob {
  int32_t id = 0;
  float logprob = 0;
  std::vector<std::pair<int32_t, float>> top;  // most likely first
};

// The log-softmax of `logits` at `id`, and the `top` most likely ids.
TokenLogprob token_logprob(const float* logits, int64_t vocab, int32_t id, int top);

struct GenerationResult {
  std::vector<int32_t> tokens;         // generated ids, without the stop id
  std::vector<TokenLogprob> logprobs;  // one per token when GenerationOptions::top_logprobs >= 0
  std::string text;                    // decoded, cut before a stop string
  std::string finish_reason;           // "stop", "length", "context" (context limit) or "cancelled"
  std::string stop_string;  // the stop string that ended it (of those found first in the text)
  int64_t prompt_tokens = 0, reused_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;
};

// Called with each new piece of text; return false to cancel the generation.
using TextCallback = std::function<bool(std::string_view piece)>;

// The per-token half of a generation, for a caller that runs the model itself (a server that
// steps many sequences in one batched call): samples each next id from logits, ends on stop ids,
// stop strings, max_tokens, the context limit or cancellation, and streams UTF-8-complete text.
// The engine (runtime/engine.h) drives one of these per request, for every front end.
class TokenStream {
 public:
  // prompt: the ids the sequence holds before the first generated token (the sampler's history).
  // tokenizer null: ids only (no text, no stop strings or constraints), e.g. `bench` on a
  // checkpoint that ships no tokenizer.
  TokenStream(const Tokenizer* tokenizer, const std::vector<int32_t>& prompt,
              const GenerationOptions& opt);
  // Samples from `logits` (vocab values). Returns the id the caller feeds next, or nullopt when
  // the generation ended (see result()). has_room: the sequence can take one more row.
  std::optional<int32_t> next(const float* logits, int64_t vocab, bool has_room,
                              const TextCallback& on_text = {});
  // Speculative decoding (runtime/speculative.h): `logits` are the k+1 rows ([k+1, vocab]) the
  // sequence ran for [x, d_1..d_k], x the id this stream returned last. speculative_verify
  // decides the round with this stream's sampler; the accepted drafts, then the target's own
  // token, are taken one by one as next() takes a sampled id (stop ids, stop strings,
  // max_tokens, logprobs of each row's own logits), so a generation that ends inside the round
  // drops the rest. has_room(j): the sequence can take a row after the j-th token taken (0-based).
  // *accepted: the drafts accepted (the caller keeps rows x, d_1..d_n). Fails under a JSON
  // or tool-call constraint: drafts are not constrained.
  std::optional<int32_t> next_verified(const float* logits, int64_t vocab,
                                       std::span<const int32_t> drafts,
                                       const std::function<bool(int64_t)>& has_room,
                                       const TextCallback& on_text, int* accepted);
  // Drafts can be verified: no JSON or tool-call constraint (drafts are not constrained).
  bool can_verify() const { return !constraint_; }
  // Generated tokens so far.
  int steps() const { return step_; }
  const GenerationOptions& options() const { return opt_; }
  // Ends the generation early (e.g. "cancelled"); text held back is dropped for "cancelled".
  void end(const std::string& reason, const TextCallback& on_text = {});
  bool done() const { return done_; }
  // tokens, text and finish_reason; the prompt and timing fields are the caller's.
  const GenerationResult& result() const { return res_; }

 private:
  bool emit_until(size_t end, const TextCallback& on_text);
  // Takes `id` (drawn from raw_logits, before any mask) as the next generated token.
  std::optional<int32_t> take(int32_t id, const float* raw_logits, int64_t vocab, bool has_room,
                              const TextCallback& on_text);
  // `rows` rows of logits with the banned ids masked in each (raw_logits itself when none are
  // banned).
  const float* without_banned(const float* raw_logits, int64_t rows, int64_t vocab);
  void finish(const std::string& reason, bool flush, const TextCallback& on_text);

  const Tokenizer* tok_;
  GenerationOptions opt_;
  Sampler sampler_;
  std::optional<TokenConstraint> constraint_;
  std::vector<float> masked_;  // the logits with the constraint applied
  std::optional<StreamDecoder> decoder_;
  std::vector<int32_t> history_;
  GenerationResult res_;
  size_t emitted_ = 0;
  int step_ = 0;
  bool done_ = false;
};

}  // namespace gemstage
