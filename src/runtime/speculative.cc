#include "runtime/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
#include "stage/drafter_stage.h"
#include "trace/taps.h"

namespace gemstage {

namespace {

// Runs ids on the target and returns their logits ([rows, V], every row or the last) with the
// post-final-norm hidden of the same rows (the drafter's h), read off the final_hidden tap.
struct TargetRows {
  FloatTensor logits, hidden;
};

TargetRows run_target(ThreadPool& pool, Sequence& target, std::span<const int32_t> ids,
                      bool all_rows, bool want_hidden = true) {
  TargetRows r;
  if (!want_hidden) {
    r.logits = target.forward(pool, ids, nullptr, all_rows, nullptr);
    return r;
  }
  TapRecorder taps({"final_hidden"});
  r.logits = target.forward(pool, ids, nullptr, all_rows, &taps);
  r.hidden = taps.get("final_hidden");
  return r;
}

int32_t argmax_row(const FloatTensor& logits, int64_t row) {
  const int64_t V = logits.dim(1);
  const float* l = logits.row(row);
  return static_cast<int32_t>(std::max_element(l, l + V) - l);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int32_t speculative_accept_or_resample(std::span<const int32_t> ids, std::span<const double> prob,
                                       double total, int32_t draft, double u, double u2,
                                       bool* accepted) {
  if (ids.empty() || ids.size() != prob.size() || !(total > 0))
    fail("speculative acceptance: empty or inconsistent target distribution");
  double p_draft = 0;
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == draft) p_draft = prob[i];
  // q(d) = 1 (a deterministic drafter): accept with min(1, p(d) / q(d)) = p(d).
  if (u * total < p_draft) {
    *accepted = true;
    return draft;
  }
  *accepted = false;
  // The residual max(0, p - q) normalized: p without d.
  const double rest = total - p_draft;
  double r = u2 * rest;
  int32_t last = ids[0];
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] == draft) continue;
    last = ids[i];
    r -= prob[i];
    if (r < 0) return ids[i];
  }
  return last;
}

DraftControl::DraftControl(const SpeculativeOptions& opt, bool timed)
    : opt_(opt), k_cur_(std::max(std::min(opt.draft_max, 2), opt.draft_min)) {
  if (opt.draft_max < 0 || opt.draft_min < 0) fail("--draft-max and --draft-min must be >= 0");
  // The first rounds draft 2 (k grows by one per fully accepted round), so a drafter that never
  // agrees costs little before it is paused; a timed caller's first step is plain, so the first
  // round has a plain step to be compared with and such a drafter is paused after one round, not
  // two. Measured on 26B-A4B with a never-agreeing drafter (bench/RESULTS.md, 2026-12-06).
  if (opt_.adaptive && timed) pause_ = 1;
}

int64_t DraftControl::next_draft(int64_t limit) const {
  int64_t k = opt_.adaptive ? (pause_ > 0 ? 0 : k_cur_) : opt_.draft_max;
  k = std::min(k, limit);
  return k < std::max(opt_.draft_min, 1) ? 0 : k;
}

void DraftControl::plain_step(double seconds) {
  if (pause_ > 0) --pause_;
  if (seconds >= 0) plain_s_ = plain_s_ > 0 ? 0.8 * plain_s_ + 0.2 * seconds : seconds;
}

void DraftControl::round(int64_t k, int64_t n, double seconds_per_token) {
  if (seconds_per_token >= 0)
    round_tokens_s_ =
        round_tokens_s_ > 0 ? 0.7 * round_tokens_s_ + 0.3 * seconds_per_token : seconds_per_token;
  if (!opt_.adaptive) return;
  // k follows acceptance (+1 after a fully accepted round, -1 after a round with a rejection),
  // never below --draft-min, which would stop drafting for good.
  k_cur_ = n == k ? std::min<int64_t>(k_cur_ + 1, opt_.draft_max)
                  : std::max<int64_t>({k_cur_ - 1, 1, opt_.draft_min});
  // Three rounds in a row without an accepted draft also switch drafting off: such rounds cost
  // more than plain steps, and the plain-step time they are compared with may be stale.
  zero_rounds_ = n == 0 ? zero_rounds_ + 1 : 0;
  if ((plain_s_ > 0 && round_tokens_s_ > plain_s_) || zero_rounds_ >= 3) {
    pause_ = pause_len_;
    pause_len_ = std::min<int64_t>(pause_len_ * 2, 512);
    round_tokens_s_ = 0;
  } else if (n > 0 && (plain_s_ > 0 || seconds_per_token < 0)) {
    // Only a round that accepted drafts and beat plain steps restores short pauses: a round
    // without accepted drafts can only look cheaper through timing noise.
    pause_len_ = 16;
  }
}

VerifyOutcome speculative_verify(const float* logits, int64_t vocab,
                                 std::span<const int32_t> drafts, Sampler* sampler,
                                 std::vector<int32_t>& history) {
  if (vocab <= 0) fail("speculative verify: empty vocabulary");
  const auto k = static_cast<int64_t>(drafts.size());
  auto row = [&](int64_t i) { return logits + i * vocab; };
  VerifyOutcome v;
  if (!sampler) {
    // Every row's choice is recorded (the fixtures' spec_round_target_ids); the first
    // disagreement ends the accepted prefix.
    for (int64_t j = 0; j <= k; ++j)
      v.target_ids.push_back(
          static_cast<int32_t>(std::max_element(row(j), row(j) + vocab) - row(j)));
    while (v.accepted < k &&
           v.target_ids[static_cast<size_t>(v.accepted)] == drafts[static_cast<size_t>(v.accepted)])
      ++v.accepted;
    v.next = v.target_ids[static_cast<size_t>(v.accepted)];
    return v;
  }
  std::vector<double> prob;
  for (int64_t i = 0; i <= k; ++i) {
    const double total = sampler->distribution(row(i), vocab, history, prob);
    const std::vector<int32_t> cand = sampler->candidates();
    if (i == k) {  // every draft accepted: the extra token from the last row
      double u = sampler->next_uniform() * total;
      v.next = cand.back();
      for (size_t j = 0; j < cand.size(); ++j)
        if ((u -= prob[j]) < 0) {
          v.next = cand[j];
          break;
        }
      v.target_ids.push_back(v.next);
      break;
    }
    bool accepted = false;
    const double u = sampler->next_uniform(), u2 = sampler->next_uniform();
    const int32_t t = speculative_accept_or_resample(
        cand, prob, total, drafts[static_cast<size_t>(i)], u, u2, &accepted);
    v.target_ids.push_back(t);
    if (accepted) {
      ++v.accepted;
      history.push_back(t);  // the next row's repetition penalty sees it
      continue;
    }
    v.next = t;
    break;
  }
  history.resize(history.size() - static_cast<size_t>(v.accepted));
  return v;
}

DraftContext draft_context(const Sequence& target, const AssistantDonors& donors,
                           int64_t position) {
  DraftContext ctx;
  ctx.target_embed = &target.embeddings_model().weights().embed_tokens;
  if (!ctx.target_embed->valid())
    fail("speculative decoding: the target's embedding table is not held");
  for (const int layer : {donors.sliding, donors.full})
    if (layer >= 0 && !target.layer_cache(layer))
      fail("speculative decoding: the drafter reads the KV cache of target layer ", layer,
           ", which runs in another process");
  ctx.sliding = donors.sliding >= 0 ? target.layer_cache(donors.sliding) : nullptr;
  ctx.full = donors.full >= 0 ? target.layer_cache(donors.full) : nullptr;
  ctx.position = position;
  return ctx;
}

std::vector<int32_t> draft_round(ThreadPool& pool, const AssistantModel& drafter,
                                 const DraftContext& ctx, int32_t x, std::vector<float> h,
                                 int64_t k, const std::function<bool(int32_t)>& stop_before) {
  std::vector<int32_t> ids{x};
  // Every step is a call of the drafter stage, checked against its contract; the hidden state
  // each step gives is the next step's input.
  const StageDecl decl = drafter_stage_decl(drafter);
  const HostTensor position({1}, std::vector<int32_t>{static_cast<int32_t>(ctx.position)});
  const int64_t width = static_cast<int64_t>(h.size());
  HostTensor hidden({width}, std::move(h));
  int32_t tok = x;
  for (int64_t i = 0; i < k; ++i) {
    TensorMap in;
    in["input_token"] = HostTensor({1}, std::vector<int32_t>{tok});
    in["target_hidden"] = std::move(hidden);
    in["position"] = position;
    TensorMap out = run_drafter_stage(pool, drafter, decl, ctx, std::move(in));
    tok = out.at("draft_token").values<int32_t>()[0];
    hidden = std::move(out.at("next_hidden"));
    if (stop_before && stop_before(tok)) break;
    ids.push_back(tok);
  }
  return ids;
}

std::vector<int32_t> speculative_generate(ThreadPool& pool, Sequence& target,
                                          const AssistantModel& drafter,
                                          std::span<const int32_t> prompt, int64_t n_new,
                                          Sampler* sampler, const SpeculativeOptions& opt,
                                          SpeculativeStats* stats,
                                          std::vector<SpeculativeRound>* rounds,
                                          const std::function<bool(int32_t)>& on_token) {
  return speculative_generate(pool, target, drafter, prompt, nullptr, 0, n_new, sampler, opt, stats,
                              rounds, on_token);
}

std::vector<int32_t> speculative_generate(
    ThreadPool& pool, Sequence& target, const AssistantModel& drafter,
    std::span<const int32_t> prompt, const FloatTensor* soft_tokens, int64_t chunk, int64_t n_new,
    Sampler* sampler, const SpeculativeOptions& opt, SpeculativeStats* stats,
    std::vector<SpeculativeRound>* rounds, const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) fail("speculative decoding needs a prompt of at least one token");
  if (opt.draft_max < 0 || opt.draft_min < 0) fail("--draft-max and --draft-min must be >= 0");
  SpeculativeStats local;
  SpeculativeStats& st = stats ? *stats : local;
  const TextConfig& tc = target.config().text;
  DraftContext ctx = draft_context(target, assistant_donor_layers(tc), 0);

  std::vector<int32_t> history(target.tokens());
  history.insert(history.end(), prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  auto choose = [&](const FloatTensor& logits, int64_t row) -> int32_t {
    if (!sampler) return argmax_row(logits, row);
    return sampler->sample(logits.row(row), logits.dim(1), history);
  };
  auto emit = [&](int32_t t) {
    out.push_back(t);
    history.push_back(t);
    return on_token ? on_token(t) : true;
  };

  // The prompt as plain decoding runs it (its images / audio in their placeholder rows, chunks
  // that keep an image whole); final_hidden gets the last row of each chunk, so the prompt's
  // last row is the tap's last.
  TapRecorder pre_taps({"final_hidden"});
  const FloatTensor pre_logits = target.prefill(pool, prompt, soft_tokens, chunk, false, &pre_taps);
  const FloatTensor pre_hidden = pre_taps.get("final_hidden");
  const float* last = pre_hidden.row(pre_hidden.dim(0) - 1);
  std::vector<float> h(last, last + pre_hidden.dim(1));
  int32_t x = choose(pre_logits, pre_logits.dim(0) - 1);
  if (n_new <= 0) return out;
  if (!emit(x)) return out;

  DraftControl control(opt, /*timed=*/true);
  while (static_cast<int64_t>(out.size()) < n_new) {
    const int64_t P = target.n_past();
    const int64_t remaining = n_new - static_cast<int64_t>(out.size());
    // The verify's k+1 rows must fit the context; the last row then is its last position.
    const int64_t k = control.next_draft(std::min(remaining - 1, target.max_context() - P - 1));
    const auto t0 = std::chrono::steady_clock::now();
    if (k == 0) {
      const int32_t in[1] = {x};
      // While paused for more than this step, the next step is plain too and needs no h.
      const bool want_hidden = !control.paused_beyond_next();
      TargetRows r = run_target(pool, target, in, false, want_hidden);
      if (want_hidden) h.assign(r.hidden.row(0), r.hidden.row(0) + r.hidden.dim(1));
      x = choose(r.logits, 0);
      // Recorded as a round without drafts, as the fixtures record the last step.
      if (rounds) rounds->push_back({P, in[0], {}, 0, {x}});
      ++st.plain_steps;
      control.plain_step(seconds_since(t0));
      if (!emit(x)) break;
      continue;
    }
    SpeculativeRound round;
    round.position = P;
    round.input_token = x;
    ctx.position = P;
    std::vector<int32_t> ids = draft_round(pool, drafter, ctx, x, h, k);
    st.draft_steps += k;
    st.draft_seconds += seconds_since(t0);
    if (opt.replace_drafts)
      opt.replace_drafts(static_cast<int64_t>(out.size()), std::span<int32_t>(ids).subspan(1));
    round.drafts.assign(ids.begin() + 1, ids.end());
    const auto t_verify = std::chrono::steady_clock::now();
    TargetRows r = run_target(pool, target, ids, true);
    st.verify_rows += static_cast<int64_t>(ids.size());
    st.verify_seconds += seconds_since(t_verify);
    VerifyOutcome v =
        speculative_verify(r.logits.row(0), r.logits.dim(1), round.drafts, sampler, history);
    const int n = v.accepted;
    const int32_t next = v.next;
    round.target_ids = std::move(v.target_ids);
    round.accepted = n;
    if (!target.truncate(P + n + 1))
      fail("speculative decoding: the target's KV cache cannot roll back to ", P + n + 1);
    h.assign(r.hidden.row(n), r.hidden.row(n) + r.hidden.dim(1));
    x = next;
    ++st.rounds;
    st.drafted += k;
    st.accepted += n;
    if (rounds) rounds->push_back(round);
    const double per_token = seconds_since(t0) / static_cast<double>(n + 1);
    bool stop = false;
    for (int i = 0; i < n && !stop; ++i) stop = !emit(ids[static_cast<size_t>(i + 1)]);
    if (stop || !emit(next)) break;
    control.round(k, n, per_token);
  }
  return out;
}

}  // namespace gemstage
