// Speculative decoding with a Gemma 4 MTP drafter (docs/gemma4-mtp.md): the drafter
// proposes k tokens from the target's newest token and post-norm hidden state, reading the
// target's committed K/V; the target runs [x_P, d_1..d_k] as one call of k+1 rows, keeps the
// longest prefix of drafts it agrees with plus its own next token, and its caches are rolled back
// past the rejected rows (Sequence::truncate; sliding rings keep kRollbackSlack rows for this).
//
// Greedy: the output is the target's own greedy output. Sampling: the standard speculative
// acceptance rule for a deterministic drafter (q is a point mass on the draft d): accept d with
// probability p(d); on a rejection draw from p with d removed, renormalized; after k accepted
// drafts draw the extra token from the last row's p. Each emitted token is then distributed as
// the target's sampler would draw it.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/thread_pool.h"
#include "gemma4/assistant_model.h"
#include "runtime/sampler.h"
#include "stage/sequence.h"

namespace gemstage {

struct SpeculativeOptions {
  int draft_max = 4;  // K: drafts per round at most
  int draft_min = 0;  // a round that would draft fewer runs a plain target step instead
  // Adapt k to the measured acceptance and switch drafting off while rounds produce tokens more
  // slowly than plain steps (probing again after a growing pause).
  bool adaptive = true;
  // Measurement hook (`bench --draft-agree`): called with each round's drafts after the drafter
  // made them (its cost paid) and before the target verifies them; may overwrite them. `emitted`
  // is how many tokens the decode has produced, so drafts[i] proposes output token emitted + i.
  std::function<void(int64_t emitted, std::span<int32_t> drafts)> replace_drafts;
};

// How many drafts each round makes. Adaptive: the first round drafts 2 (or --draft-min; a timed
// caller's first step is plain, to time it), k follows acceptance (+1 after a fully accepted
// round, -1 otherwise, up to --draft-max), and drafting switches off while rounds yield tokens
// more slowly than plain steps (when timed) or three rounds in a row accept nothing, probed again
// after a pause that doubles (16 ... 512 tokens) each time it does not pay. A caller that cannot
// time its rounds alone (a server step runs many sequences) passes negative seconds: then only
// acceptance decides.
class DraftControl {
 public:
  explicit DraftControl(const SpeculativeOptions& opt, bool timed = false);
  // Drafts for the next round, at most `limit` (what max_tokens and the context leave); 0: the
  // next step is a plain one.
  int64_t next_draft(int64_t limit) const;
  // True while the step after the next plain one is plain too (its hidden state is not needed).
  bool paused_beyond_next() const { return opt_.adaptive && pause_ > 1; }
  void plain_step(double seconds);
  void round(int64_t k, int64_t n, double seconds_per_token);

 private:
  SpeculativeOptions opt_;
  int64_t k_cur_;
  double plain_s_ = 0, round_tokens_s_ = 0;  // seconds per token: plain steps, drafting rounds
  int64_t pause_ = 0, pause_len_ = 16, zero_rounds_ = 0;
};

// One drafting round, as the fixtures' spec_round_* taps record it.
struct SpeculativeRound {
  int64_t position = 0;     // P
  int32_t input_token = 0;  // x_P
  std::vector<int32_t> drafts;
  int accepted = 0;
  std::vector<int32_t> target_ids;  // the target's choice at each verify row
};

struct SpeculativeStats {
  int64_t rounds = 0, drafted = 0, accepted = 0;
  int64_t plain_steps = 0;  // target steps without drafts
  // Where a round's time goes (bench prints it): the drafter's steps, and the target's verify
  // calls with their rows (k + 1 each).
  int64_t draft_steps = 0, verify_rows = 0;
  double draft_seconds = 0, verify_seconds = 0;
  double acceptance() const {
    return drafted > 0 ? static_cast<double>(accepted) / static_cast<double>(drafted) : 0.0;
  }
};

// Generates n_new tokens after `prompt`, which is run on `target` from its current n_past()
// (usually a fresh sequence). sampler null: greedy. on_token returning false stops early.
// Rounds are appended to *rounds when given. Returns the new ids.
std::vector<int32_t> speculative_generate(ThreadPool& pool, Sequence& target,
                                          const AssistantModel& drafter,
                                          std::span<const int32_t> prompt, int64_t n_new,
                                          Sampler* sampler, const SpeculativeOptions& opt,
                                          SpeculativeStats* stats = nullptr,
                                          std::vector<SpeculativeRound>* rounds = nullptr,
                                          const std::function<bool(int32_t)>& on_token = {});
// The same for a prompt with images or audio: soft_tokens [N, D] fill its placeholder rows in
// order (as Sequence::prefill takes them), and the prompt runs in chunks of `chunk` rows (<= 0:
// one pass) that never split an image. Decoding after the prompt is text, so the drafter needs
// nothing else: it reads the image rows through the target's caches.
std::vector<int32_t> speculative_generate(
    ThreadPool& pool, Sequence& target, const AssistantModel& drafter,
    std::span<const int32_t> prompt, const FloatTensor* soft_tokens, int64_t chunk, int64_t n_new,
    Sampler* sampler, const SpeculativeOptions& opt, SpeculativeStats* stats = nullptr,
    std::vector<SpeculativeRound>* rounds = nullptr,
    const std::function<bool(int32_t)>& on_token = {});

// The drafter's view of `target` at `position`: the target's embedding table and the donor
// layers' K/V caches. Fails, naming it, when the embedding table or a donor layer's cache is not
// held in this process.
DraftContext draft_context(const Sequence& target, const AssistantDonors& donors, int64_t position);

// One round's verify rows [x, d_1..d_k]: up to k drafts from x and `h`, the target's hidden state
// of the row before x, without touching the target's caches. Ends before a draft that
// `stop_before` rejects.
std::vector<int32_t> draft_round(ThreadPool& pool, const AssistantModel& drafter,
                                 const DraftContext& ctx, int32_t x, std::vector<float> h,
                                 int64_t k, const std::function<bool(int32_t)>& stop_before = {});

// One verify call's outcome: the target ran [x_P, d_1..d_k] as k+1 rows (logits [k+1, vocab]).
struct VerifyOutcome {
  int accepted = 0;                 // n: the leading drafts the target agreed with
  int32_t next = 0;                 // the target's own token after them
  std::vector<int32_t> target_ids;  // its choice at each row it decided (greedy: every row)
};

// Decides a verify call: sampler null is greedy (argmax, first index on ties); otherwise the
// acceptance rule below over the sampler's distribution of each row (its repetition penalty sees
// `history`, the ids up to and including x_P, plus the drafts accepted so far; `history` is as it
// was on return). Every speculative decoder (speculative_generate, the server's batched engine
// through TokenStream::next_verified) decides its rounds here.
VerifyOutcome speculative_verify(const float* logits, int64_t vocab,
                                 std::span<const int32_t> drafts, Sampler* sampler,
                                 std::vector<int32_t>& history);

// The acceptance rule for one verify row: given the target's weights `prob` over `ids` (as
// Sampler::distribution returns them, summing to `total`) and the draft d, returns d if accepted
// (u < p(d)), else a token drawn from p with d removed using u2. Exposed for tests.
int32_t speculative_accept_or_resample(std::span<const int32_t> ids, std::span<const double> prob,
                                       double total, int32_t draft, double u, double u2,
                                       bool* accepted);

}  // namespace gemstage
