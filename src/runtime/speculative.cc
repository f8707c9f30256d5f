#include "runtime/speculative.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "core/error.h"
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

std::vector<int32_t> speculative_generate(ThreadPool& pool, Sequence& target,
                                          const AssistantModel& drafter,
                                          std::span<const int32_t> prompt, int64_t n_new,
                                          Sampler* sampler, const SpeculativeOptions& opt,
                                          SpeculativeStats* stats,
                                          std::vector<SpeculativeRound>* rounds,
                                          const std::function<bool(int32_t)>& on_token) {
  if (prompt.empty()) fail("speculative decoding needs a prompt of at least one token");
  if (opt.draft_max < 0 || opt.draft_min < 0) fail("--draft-max and --draft-min must be >= 0");
  SpeculativeStats local;
  SpeculativeStats& st = stats ? *stats : local;
  const TextConfig& tc = target.config().text;
  const AssistantDonors donors = assistant_donor_layers(tc);
  DraftContext ctx;
  ctx.target_embed = &target.embeddings_model().weights().embed_tokens;
  ctx.sliding = donors.sliding >= 0 ? target.layer_cache(donors.sliding) : nullptr;
  ctx.full = donors.full >= 0 ? target.layer_cache(donors.full) : nullptr;
  if (!ctx.target_embed->valid())
    fail("speculative decoding: the target's embedding table is not held");

  std::vector<int32_t> history(target.tokens());
  history.insert(history.end(), prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  std::vector<double> prob;
  auto choose = [&](const FloatTensor& logits, int64_t row) -> int32_t {
    if (!sampler) return argmax_row(logits, row);
    return sampler->sample(logits.row(row), logits.dim(1), history);
  };
  auto emit = [&](int32_t t) {
    out.push_back(t);
    history.push_back(t);
    return on_token ? on_token(t) : true;
  };

  TargetRows pre = run_target(pool, target, prompt, false);
  std::vector<float> h(pre.hidden.row(0), pre.hidden.row(0) + pre.hidden.dim(1));
  int32_t x = choose(pre.logits, 0);
  if (n_new <= 0) return out;
  if (!emit(x)) return out;

  // Adaptive control: k follows acceptance (+1 after a fully accepted round, -1 after a round
  // with a rejection); drafting switches off while rounds yield tokens more slowly than plain
  // steps, and is probed again after a pause that doubles each time it does not pay.
  int k_cur = std::max(opt.draft_max, 0);
  double plain_s = 0, round_tokens_s = 0;  // seconds per token: plain steps, drafting rounds
  int64_t pause = 0, pause_len = 16, zero_rounds = 0;

  while (static_cast<int64_t>(out.size()) < n_new) {
    const int64_t P = target.n_past();
    const int64_t remaining = n_new - static_cast<int64_t>(out.size());
    int64_t k = std::min<int64_t>(opt.adaptive ? k_cur : opt.draft_max, remaining - 1);
    if (opt.adaptive && pause > 0) k = 0;
    // The verify's k+1 rows must fit the context; the last row then is its last position.
    k = std::min<int64_t>(k, target.max_context() - P - 1);
    if (k < std::max(opt.draft_min, 1)) k = 0;
    const auto t0 = std::chrono::steady_clock::now();
    if (k == 0) {
      const int32_t in[1] = {x};
      // While paused for more than this step, the next step is plain too and needs no h.
      const bool want_hidden = !(opt.adaptive && pause > 1);
      TargetRows r = run_target(pool, target, in, false, want_hidden);
      if (want_hidden) h.assign(r.hidden.row(0), r.hidden.row(0) + r.hidden.dim(1));
      x = choose(r.logits, 0);
      // Recorded as a round without drafts, as the fixtures record the last step.
      if (rounds) rounds->push_back({P, in[0], {}, 0, {x}});
      ++st.plain_steps;
      if (pause > 0) --pause;
      const double dt = seconds_since(t0);
      plain_s = plain_s > 0 ? 0.8 * plain_s + 0.2 * dt : dt;
      if (!emit(x)) break;
      continue;
    }
    SpeculativeRound round;
    round.position = P;
    round.input_token = x;
    ctx.position = P;
    std::vector<int32_t> ids{x};
    std::vector<float> dh = h;
    int32_t tok = x;
    for (int64_t i = 0; i < k; ++i) {
      tok = drafter.step(pool, ctx, tok, dh);
      ids.push_back(tok);
    }
    round.drafts.assign(ids.begin() + 1, ids.end());
    TargetRows r = run_target(pool, target, ids, true);
    int n = 0;
    int32_t next = 0;
    for (int64_t i = 0; i <= k; ++i) {
      if (!sampler) {
        // Every row's choice is recorded (the fixtures' spec_round_target_ids); the first
        // disagreement ends the accepted prefix.
        for (int64_t j = 0; j <= k; ++j) round.target_ids.push_back(argmax_row(r.logits, j));
        while (n < k && round.target_ids[static_cast<size_t>(n)] == ids[static_cast<size_t>(n + 1)])
          ++n;
        next = round.target_ids[static_cast<size_t>(n)];
        break;
      }
      const double total = sampler->distribution(r.logits.row(i), r.logits.dim(1), history, prob);
      const std::vector<int32_t> cand = sampler->candidates();
      if (i == k) {  // every draft accepted: the extra token from the last row
        double u = sampler->next_uniform() * total;
        next = cand.back();
        for (size_t j = 0; j < cand.size(); ++j)
          if ((u -= prob[j]) < 0) {
            next = cand[j];
            break;
          }
        round.target_ids.push_back(next);
        break;
      }
      bool accepted = false;
      const double u = sampler->next_uniform(), u2 = sampler->next_uniform();
      const int32_t t = speculative_accept_or_resample(
          cand, prob, total, ids[static_cast<size_t>(i + 1)], u, u2, &accepted);
      round.target_ids.push_back(t);
      if (accepted) {
        ++n;
        history.push_back(t);  // the next row's repetition penalty sees it
        continue;
      }
      next = t;
      break;
    }
    if (sampler) history.resize(history.size() - static_cast<size_t>(n));
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
    round_tokens_s = round_tokens_s > 0 ? 0.7 * round_tokens_s + 0.3 * per_token : per_token;
    bool stop = false;
    for (int i = 0; i < n && !stop; ++i) stop = !emit(ids[static_cast<size_t>(i + 1)]);
    if (stop || !emit(next)) break;
    if (opt.adaptive) {
      k_cur = n == k ? std::min(k_cur + 1, opt.draft_max) : std::max(k_cur - 1, 1);
      // Three rounds in a row without an accepted draft also switch drafting off: such rounds
      // cost more than plain steps, and the plain-step time they are compared with may be stale.
      zero_rounds = n == 0 ? zero_rounds + 1 : 0;
      if ((plain_s > 0 && round_tokens_s > plain_s) || zero_rounds >= 3) {
        pause = pause_len;
        pause_len = std::min<int64_t>(pause_len * 2, 512);
        round_tokens_s = 0;
      } else if (plain_s > 0 && n > 0) {
        // Only a round that accepted drafts and beat plain steps restores short pauses: a
        // round without accepted drafts can only look cheaper through timing noise.
        pause_len = 16;
      } else if (plain_s == 0 && n == 0) {
        pause = 1;  // measure a plain step to compare against
      }
    }
  }
  return out;
}

}  // namespace gemstage
