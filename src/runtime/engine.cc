#include "runtime/engine.h"

#include <algorithm>
#include <new>

#include "gemma4/multimodal.h"
#include "trace/taps.h"

namespace gemstage {

namespace {

using Clock = std::chrono::steady_clock;

// How long an idle run() sleeps before it looks again for queued requests cancelled meanwhile.
constexpr auto kIdlePoll = std::chrono::milliseconds(50);

double seconds_between(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Rows `held` and `prompt` share, leaving at least one prompt row to produce logits from. The
// shared run stops at the first image/audio placeholder: equal placeholder ids say nothing about
// whether the soft tokens behind them (the pictures) are the same.
size_t common_prefix(const std::vector<int32_t>& held, const std::vector<int32_t>& prompt,
                     const std::vector<int>& placeholders) {
  size_t n = 0;
  while (n < held.size() && n + 1 < prompt.size() && held[n] == prompt[n] &&
         std::find(placeholders.begin(), placeholders.end(), prompt[n]) == placeholders.end())
    ++n;
  return n;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// Generation: the handle a front end holds.

Generation::Progress Generation::take(std::chrono::milliseconds wait) {
  Progress p;
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_for(lk, wait, [&] { return !pending_.empty() || done_; });
  p.text.swap(pending_);
  const auto& all = result_.generation.logprobs;
  if (logprobs_taken_ < all.size()) {
    p.logprobs.assign(all.begin() + static_cast<std::ptrdiff_t>(logprobs_taken_), all.end());
    logprobs_taken_ = all.size();
  }
  const auto& ids = result_.generation.tokens;
  if (tokens_taken_ < ids.size()) {
    p.tokens.assign(ids.begin() + static_cast<std::ptrdiff_t>(tokens_taken_), ids.end());
    tokens_taken_ = ids.size();
  }
  p.started = started_;
  p.done = done_;
  p.error = result_.error;
  p.finish_reason = result_.generation.finish_reason;
  p.stop_string = result_.generation.stop_string;
  p.prompt_tokens = result_.prompt_tokens;
  p.cached_tokens = result_.cached_tokens;
  p.completion_tokens = static_cast<int64_t>(result_.generation.tokens.size());
  return p;
}

bool Generation::started() const {
  std::lock_guard<std::mutex> lk(mu_);
  return started_;
}

bool Generation::done() const {
  std::lock_guard<std::mutex> lk(mu_);
  return done_;
}

bool Generation::wait_started(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, wait, [&] { return started_ || done_; });
}

bool Generation::wait_done(std::chrono::milliseconds wait) {
  std::unique_lock<std::mutex> lk(mu_);
  return cv_.wait_for(lk, wait, [&] { return done_; });
}

Generation::Result Generation::wait() {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return done_; });
  return result_;
}

Generation::Result Generation::result() const {
  std::lock_guard<std::mutex> lk(mu_);
  return result_;
}

void Generation::mark_started(int64_t prompt_tokens, int64_t cached, int slot) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    started_ = true;
    started_at_ = Clock::now();
    result_.prompt_tokens = prompt_tokens;
    result_.cached_tokens = cached;
    result_.slot = slot;
    result_.queue_seconds = seconds_between(queued_at_, started_at_);
  }
  cv_.notify_all();
}

void Generation::append(std::string_view text) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    pending_.append(text);
  }
  cv_.notify_all();
}

void Generation::append_logprobs(const std::vector<TokenLogprob>& all) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& mine = result_.generation.logprobs;
  mine.insert(mine.end(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()), all.end());
}

// The ids generated so far (the stream's whole list; only the new tail is copied).
void Generation::append_tokens(const std::vector<int32_t>& all) {
  std::lock_guard<std::mutex> lk(mu_);
  auto& mine = result_.generation.tokens;
  if (all.size() > mine.size())
    mine.insert(mine.end(), all.begin() + static_cast<std::ptrdiff_t>(mine.size()), all.end());
}

void Generation::finish(const GenerationResult& r, const SpeculativeStats& draft) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    const Clock::time_point now = Clock::now();
    std::vector<TokenLogprob> logprobs = std::move(result_.generation.logprobs);
    result_.generation = r;
    // The stream's logprobs were appended as they came; keep the copy the readers index into.
    if (logprobs.size() > result_.generation.logprobs.size())
      result_.generation.logprobs = std::move(logprobs);
    result_.draft = draft;
    const Clock::time_point first = first_token_at_ == Clock::time_point{} ? now : first_token_at_;
    result_.prefill_seconds = seconds_between(started_at_, first);
    result_.decode_seconds = seconds_between(first, now);
    done_ = true;
  }
  cv_.notify_all();
}

void Generation::fail(EngineError e) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    result_.error = std::move(e);
    done_ = true;
  }
  cv_.notify_all();
}

// ------------------------------------------------------------------------------------------
// Slots and calls.

// A slot is one conversation at a time on the shared model: its own sequence (KV caches). Only
// the stepping thread touches a slot's sequence and generation state; `gen`, `state`, `rows`,
// `reserved` and `decoded` change under q_mu_ (stats() and the KV budget read them).
struct Engine::Slot {
  int id = 0;
  std::unique_ptr<Sequence> sequence;
  std::shared_ptr<Generation> gen;  // the running request; null when idle
  std::vector<int32_t> prompt;
  FloatTensor soft;      // soft tokens of the prompt rows not yet in the caches, in order
  int64_t soft_at = 0;   // of those, how many earlier steps consumed
  int64_t capacity = 0;  // rows this request may hold (its share of the KV budget)
  int max_tokens = 0;
  bool wants_logprobs = false;
  std::unique_ptr<TokenStream> stream;
  std::optional<int32_t> next_id;  // decoding: the id the next step feeds
  uint64_t admitted = 0;           // admission order: prompts are prefilled oldest first
  uint64_t last_used = 0;          // when it last ran, to evict the stalest held prefix first
  SlotState state = SlotState::kIdle;
  int64_t rows = 0;        // KV rows the sequence holds
  int64_t reserved = 0;    // budget rows counted for it: capacity while running, rows when idle
  int64_t decoded = 0;     // tokens generated for the running request, as of the last step
  bool in_flight = false;  // in a call the pipeline has not finished
  // Speculative decoding: the request's draft control and options, the target's
  // post-final-norm hidden of the row before next_id (the drafter's h; empty when not known),
  // this step's verify rows [next_id, d_1..d_k] (empty: a plain decode row), and its rounds.
  std::optional<DraftControl> draft;
  SpeculativeOptions draft_options;
  std::vector<float> draft_h;
  std::vector<int32_t> verify_ids;
  SpeculativeStats draft_stats;
};

// The calls in flight. With stages on other processes (MPI ranks) several are, each over its own
// slots, so every process computes at once (stage/call_pipeline.h).
struct Engine::CallInFlight {
  std::vector<Slot*> owners;
  std::vector<int64_t> soft_rows;  // soft tokens each entry consumed
  int64_t rows = 0;
  // With a drafter: the post-final-norm hidden of every head row (the drafter's h), each
  // entry's rows in turn (all of a verify's rows, the last row of any other entry).
  std::unique_ptr<TapRecorder> hidden;
};

const char* Engine::slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::kPrefill:
      return "prefill";
    case SlotState::kDecode:
      return "decode";
    default:
      return "idle";
  }
}

Engine::Engine(std::shared_ptr<const Model> model, const Tokenizer* tokenizer, ThreadPool& pool,
               EngineOptions options)
    : model_(std::move(model)), tok_(tokenizer), pool_(pool), opt_(std::move(options)) {
  if (opt_.slots < 1) fail("the engine needs at least one slot (--parallel), got ", opt_.slots);
  // -c is the KV budget of all sequences together, and also bounds a single one.
  const int64_t model_max = model_->max_context();
  kv_budget_ = opt_.kv_budget > 0 ? opt_.kv_budget : model_max;
  for (int i = 0; i < opt_.slots; ++i) {
    auto s = std::make_unique<Slot>();
    s->id = i;
    s->sequence = std::make_unique<Sequence>(model_, std::min(kv_budget_, model_max), opt_.kv_type);
    slots_.push_back(std::move(s));
  }
  max_context_ = slots_.front()->sequence->max_context();
  batch_rows_ = std::max(1, opt_.batch_rows);
  ubatch_rows_ = std::max(1, std::min(opt_.ubatch_rows, batch_rows_));
  placeholders_ = model_->config().placeholder_token_ids();
  pipeline_ = std::make_unique<CallPipeline>(pool_);
  pipeline_depth_ = CallPipeline::depth(*model_, opt_.pipeline_depth);
  if (opt_.drafter) {
    donors_ = assistant_donor_layers(model_->config().text);
    // What each round's draft_context needs: the embedding table and the donor caches here.
    (void)draft_context(*slots_.front()->sequence, donors_, 0);
    drafter_ = opt_.drafter;
  }
}

Engine::~Engine() = default;

// ------------------------------------------------------------------------------------------
// Submitting and running.

void Engine::validate(std::span<const int32_t> ids, const FloatTensor& soft_tokens) const {
  const auto n = static_cast<int64_t>(ids.size());
  if (n == 0) fail("the prompt is empty");
  if (n >= max_context_)
    throw RequestRejected(RequestRejected::Reason::kPromptTooLong,
                          "the prompt is " + std::to_string(n) + " tokens but the context holds " +
                              std::to_string(max_context_) +
                              " (including room for at least one generated token)");
  // Each placeholder row takes an image's or clip's soft token. One the prompt brings by itself
  // (the text "<|image|>", or its id in a token-id prompt) has none to take: the step that
  // reached it would fail every request in its call.
  const int64_t soft_rows = soft_tokens.numel() > 0 ? soft_tokens.dim(0) : 0;
  if (count_placeholders(model_->config(), ids) != soft_rows) {
    const auto it =
        std::find_first_of(ids.begin(), ids.end(), placeholders_.begin(), placeholders_.end());
    const int64_t at = it == ids.end() ? -1 : it - ids.begin();
    throw RequestRejected(RequestRejected::Reason::kPlaceholderWithoutMedia,
                          at >= 0 ? "the prompt's token " + std::to_string(at) + " is " +
                                        std::to_string(*it) +
                                        ", an image / audio placeholder, with no image or audio "
                                        "to fill it"
                                  : "the prompt has " + std::to_string(soft_rows) +
                                        " soft-token rows but no placeholder rows for them",
                          at);
  }
}

std::shared_ptr<Generation> Engine::submit(EngineRequest request) {
  validate(request.ids, request.soft_tokens);
  const auto n = static_cast<int64_t>(request.ids.size());
  if (request.draft && request.draft->draft_max > 0 && !drafter_)
    throw RequestRejected(RequestRejected::Reason::kDraftingUnavailable,
                          "drafting was asked for, but the engine has no drafter (-md DIR)");
  Queued q;
  q.gen = std::make_shared<Generation>();
  q.capacity = std::min(max_context_, n + std::max(0, request.gen.max_tokens));
  q.request = std::move(request);
  std::shared_ptr<Generation> gen = q.gen;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    if (closed_)
      throw RequestRejected(RequestRejected::Reason::kShuttingDown, "the engine is shutting down");
    queue_.push_back(std::move(q));
    queue_changed_ = true;
  }
  q_cv_.notify_all();
  return gen;
}

void Engine::run_until_idle(const std::function<void()>& after_step) {
  for (;;) {
    {
      std::lock_guard<std::mutex> lk(q_mu_);
      if (busy_ == 0 && queue_.empty() && pipeline_->in_flight() == 0) return;
    }
    step_once();
    if (after_step) after_step();
  }
}

void Engine::run() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(q_mu_);
      if (stop_) return;
      if (busy_ == 0) {
        // Idle: wake for a new request, or now and then to drop queued ones cancelled meanwhile.
        q_cv_.wait_for(lk, kIdlePoll, [&] { return stop_ || queue_changed_; });
        if (stop_) return;
      }
    }
    step_once();
  }
}

void Engine::stop() {
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    stop_ = true;
  }
  q_cv_.notify_all();
}

void Engine::close_queue() {
  std::deque<Queued> dropped;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    closed_ = true;
    dropped.swap(queue_);
  }
  for (Queued& q : dropped)
    q.gen->fail({EngineError::Kind::kShuttingDown, "the server is shutting down"});
}

void Engine::cancel_running() {
  std::lock_guard<std::mutex> lk(q_mu_);
  for (auto& s : slots_)
    if (s->gen) s->gen->cancel();
}

bool Engine::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(q_mu_);
  return idle_cv_.wait_for(lk, timeout, [&] { return busy_ == 0; });
}

bool Engine::step_once() {
  std::vector<Queued> dropped;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    queue_changed_ = false;
    // A request cancelled while it queued: nobody is waiting for the answer.
    for (auto it = queue_.begin(); it != queue_.end();)
      if (it->gen->cancelled()) {
        dropped.push_back(std::move(*it));
        it = queue_.erase(it);
      } else {
        ++it;
      }
    if (!closed_) admit();
  }
  for (Queued& q : dropped) {
    ++cancelled_;
    q.gen->fail({EngineError::Kind::kCancelled, "cancelled while it waited in the queue"});
  }
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    if (busy_ == 0 && pipeline_->in_flight() == 0) return false;
  }
  if (opt_.before_step) opt_.before_step();
  try {
    run_step();
  } catch (const std::exception& e) {
    // Not expected (a failed batched call already ends only its own requests); ending every
    // running request keeps the engine serving the next ones.
    drop_calls_in_flight();
    for (auto& s : slots_)
      if (s->gen) end(*s, "", EngineError{EngineError::Kind::kInternal, e.what()});
  }
  return true;
}

// Under q_mu_. Oldest first and nobody overtakes: the front request waits until a slot is free
// and its rows fit the budget, evicting the prefixes idle slots hold (oldest first) if needed.
void Engine::admit() {
  while (!queue_.empty()) {
    const Queued& q = queue_.front();
    // The idle slot whose caches save the most prefill: the longest prefix of this prompt,
    // counted only where it saves at least as many rows as reusing the slot throws away (so an
    // unrelated prompt that shares just <bos> leaves a conversation's caches alone); then the
    // slot holding the fewest rows, then the stalest.
    Slot* best = nullptr;
    size_t best_gain = 0;
    for (auto& s : slots_) {
      if (s->gen) continue;
      const size_t held = s->sequence->tokens().size();
      const size_t common = common_prefix(s->sequence->tokens(), q.request.ids, placeholders_);
      const size_t gain = common >= held - common ? common : 0;
      if (!best || gain > best_gain ||
          (gain == best_gain &&
           (held < best->sequence->tokens().size() ||
            (held == best->sequence->tokens().size() && s->last_used < best->last_used)))) {
        best = s.get();
        best_gain = gain;
      }
    }
    if (!best) return;
    int64_t others = 0, evictable = 0;
    for (auto& s : slots_)
      if (s.get() != best) {
        others += s->reserved;
        if (!s->gen) evictable += s->reserved;
      }
    if (others + q.capacity > kv_budget_) {
      if (others - evictable + q.capacity > kv_budget_) return;  // waits for running ones
      std::vector<Slot*> idle;
      for (auto& s : slots_)
        if (s.get() != best && !s->gen && s->reserved > 0) idle.push_back(s.get());
      std::sort(idle.begin(), idle.end(),
                [](const Slot* x, const Slot* y) { return x->last_used < y->last_used; });
      for (Slot* s : idle) {
        if (others + q.capacity <= kv_budget_) break;
        s->sequence->reset();
        others -= s->reserved;
        s->rows = s->reserved = 0;
      }
    }
    Queued taken = std::move(queue_.front());
    queue_.pop_front();
    start(*best, std::move(taken));
  }
}

// Under q_mu_: the request takes the slot, reusing the prefix its caches hold.
void Engine::start(Slot& s, Queued q) {
  Sequence& seq = *s.sequence;
  const std::vector<int32_t>& ids = q.request.ids;
  size_t common = common_prefix(seq.tokens(), ids, placeholders_);
  if (common < seq.tokens().size()) {
    // The prompt diverges inside what is cached: roll back to the common prefix, or start over
    // if the caches cannot go that far.
    if (common == 0 || !seq.truncate(static_cast<int64_t>(common))) {
      seq.reset();
      common = 0;
    }
  }
  s.soft = FloatTensor();
  s.soft_at = 0;
  const FloatTensor& soft = q.request.soft_tokens;
  if (soft.numel() > 0) {  // image and audio soft tokens, in placeholder order
    const int64_t skip =
        count_placeholders(seq.config(), std::span<const int32_t>(ids.data(), common));
    if (soft.dim(0) > skip) s.soft = slice_rows(soft, skip, soft.dim(0) - skip);
  }
  s.capacity = q.capacity;
  s.max_tokens = q.request.gen.max_tokens;
  s.wants_logprobs = q.request.gen.top_logprobs >= 0;
  s.gen = q.gen;
  GenerationOptions gen = std::move(q.request.gen);
  gen.cancel = &s.gen->cancel_;
  s.stream = std::make_unique<TokenStream>(tok_, ids, gen);
  s.prompt = std::move(q.request.ids);
  s.next_id.reset();
  s.draft.reset();
  s.draft_h.clear();
  s.verify_ids.clear();
  s.draft_stats = SpeculativeStats{};
  // Constrained output decodes plainly (drafts are not constrained). Prompts with images or
  // audio draft like text ones: the prompt's rows are prefilled as usual, and the drafter reads
  // them through the target's caches.
  if (drafter_ && q.request.draft && q.request.draft->draft_max > 0 && s.stream->can_verify()) {
    s.draft_options = *q.request.draft;
    s.draft.emplace(s.draft_options);
  }
  s.admitted = ++admissions_;
  s.state = SlotState::kPrefill;
  s.rows = seq.n_past();
  s.reserved = s.capacity;
  s.decoded = 0;
  ++busy_;
  prompt_tokens_ += static_cast<int64_t>(s.prompt.size());
  cached_tokens_ += static_cast<int64_t>(common);
  s.gen->mark_started(static_cast<int64_t>(s.prompt.size()), static_cast<int64_t>(common), s.id);
}

// The request on `s` is over: its result (or error) goes to its Generation, the slot is free
// again. A cancelled or failed request's rows are dropped at once; a finished one's stay for
// prefix reuse until the budget needs them.
void Engine::end(Slot& s, const std::string& reason, const std::optional<EngineError>& error) {
  const std::shared_ptr<Generation> gen = s.gen;
  if (!error) s.stream->end(reason);
  const GenerationResult& r = s.stream->result();
  const bool drop = error || r.finish_reason == "cancelled";
  // The counters and the slot first, so a client that has its reply sees them updated.
  if (error)
    ++failed_;
  else if (r.finish_reason == "cancelled")
    ++cancelled_;
  else
    ++completed_;
  if (!error) generated_tokens_ += static_cast<int64_t>(r.tokens.size());
  if (drop) s.sequence->reset();
  s.last_used = steps_;
  {
    std::lock_guard<std::mutex> lk(q_mu_);
    s.gen.reset();
    s.state = SlotState::kIdle;
    s.rows = s.reserved = s.sequence->n_past();
    s.decoded = 0;
    --busy_;
  }
  idle_cv_.notify_all();
  if (error) {
    gen->fail(*error);
  } else {
    if (s.wants_logprobs) gen->append_logprobs(r.logprobs);
    gen->finish(r, s.draft_stats);
  }
  s.stream.reset();
  s.prompt.clear();
  s.soft = FloatTensor();
  s.draft.reset();
  s.draft_h.clear();
  s.verify_ids.clear();
}

// A drafting slot's round for this step: up to k drafts from next_id and the hidden state of the
// row before it, at the constant position P, reading the slot's own committed caches (it is in
// no call); verified in this step as the k+1 rows [next_id, d_1..d_k] of one sequence. Leaves
// verify_ids empty for a plain decode row. False when the drafter failed (the request ended).
bool Engine::draft(Slot& s) {
  s.verify_ids.clear();
  if (!s.draft || s.draft_h.empty()) return true;
  Sequence& seq = *s.sequence;
  const int64_t P = seq.n_past();
  // max_tokens leaves room for the drafts and the target's own token; the verify's rows fit the
  // request's reservation; one call takes them whole.
  const int64_t k = s.draft->next_draft(std::min({int64_t{s.max_tokens} - s.stream->steps() - 1,
                                                  s.capacity - P - 1, int64_t{ubatch_rows_} - 1}));
  if (k <= 0) return true;
  try {
    const auto t0 = Clock::now();
    // A drafted image/audio placeholder would be a row without its soft token, which a call
    // that also carries another request's image refuses: the round ends before it.
    s.verify_ids = draft_round(pool_, *drafter_, draft_context(seq, donors_, P), *s.next_id,
                               s.draft_h, k, [&](int32_t tok) {
                                 return std::find(placeholders_.begin(), placeholders_.end(),
                                                  tok) != placeholders_.end();
                               });
    s.draft_stats.draft_seconds += seconds_between(t0, Clock::now());
    s.draft_stats.draft_steps += static_cast<int64_t>(s.verify_ids.size()) - 1;
  } catch (const std::exception& e) {
    s.verify_ids.clear();
    end(s, "",
        EngineError{EngineError::Kind::kInternal, std::string("drafting failed: ") + e.what()});
    return false;
  }
  if (s.draft_options.replace_drafts && s.verify_ids.size() > 1)
    s.draft_options.replace_drafts(s.stream->steps(), std::span<int32_t>(s.verify_ids).subspan(1));
  if (s.verify_ids.size() == 1) s.verify_ids.clear();
  return true;
}

// One batched step: a decode row for every sequence that is generating, then prompt rows of the
// sequences being prefilled (oldest first) up to batch_rows in all, run as calls of at most
// ubatch_rows. With the model's stages in several processes, the running sequences are split
// over that many calls kept in flight together, and a step ends once one of them finished (its
// sequences then take part in the next step while the others still compute); otherwise every
// call finishes within its step.
void Engine::run_step() {
  ++steps_;
  const auto t0 = Clock::now();
  for (auto& s : slots_)
    if (s->gen && !s->in_flight && s->gen->cancelled()) end(*s, "cancelled");

  struct Piece {
    Slot* slot;
    int64_t begin, n;  // prompt rows [begin, begin + n); decode rows have n == 0
  };
  std::vector<Piece> pieces;
  int64_t room = batch_rows_;
  // Every generating sequence gets its row each step (none starves when slots exceed -b).
  for (auto& s : slots_)
    if (s->gen && !s->in_flight && s->next_id) {
      if (drafter_ && !draft(*s)) continue;
      pieces.push_back({s.get(), 0, 0});
      room -= std::max<int64_t>(1, static_cast<int64_t>(s->verify_ids.size()));
    }
  std::vector<Slot*> filling;
  for (auto& s : slots_)
    if (s->gen && !s->in_flight && s->state == SlotState::kPrefill) filling.push_back(s.get());
  std::sort(filling.begin(), filling.end(),
            [](const Slot* a, const Slot* b) { return a->admitted < b->admitted; });
  // At least one prompt row a step, so a prompt advances even when decode rows fill -b.
  room = std::max<int64_t>(room, 1);
  for (Slot* s : filling) {
    const int64_t at = s->sequence->n_past();
    int64_t n = std::min(room, static_cast<int64_t>(s->prompt.size()) - at);
    if (n <= 0) break;
    // On the large models an image's rows attend to each other within one call: a piece never
    // ends inside an image (it ends before it, or takes all of it when the image comes first).
    n = chunk_end_keeping_images_whole(s->sequence->config(), s->prompt, at, at + n) - at;
    pieces.push_back({s, at, n});
    room -= n;
  }
  if (pieces.empty() && pipeline_->in_flight() == 0) return;
  // Pipelined, a call takes its share of the running sequences.
  size_t max_entries = pieces.size() + 1;
  if (pipeline_depth_ > 1) {
    size_t running = 0;
    for (auto& s : slots_) running += s->gen ? 1 : 0;
    max_entries = std::max<size_t>(1, (running + pipeline_depth_ - 1) / pipeline_depth_);
  }

  int64_t rows_run = 0;
  size_t finished = 0;
  size_t next_piece = 0;
  int64_t piece_done = 0;  // rows of pieces[next_piece] already run
  while (next_piece < pieces.size()) {
    // One call: whole decode rows and prompt rows up to -ub, a piece split over calls if needed.
    std::vector<BatchEntry> batch;
    std::vector<Slot*> owners;
    std::vector<int64_t> soft_rows;  // each entry's placeholder rows
    int64_t call_rows = 0;
    while (next_piece < pieces.size() && call_rows < ubatch_rows_ && batch.size() < max_entries) {
      const Piece& p = pieces[next_piece];
      Slot& s = *p.slot;
      if (!s.gen) {  // ended by a failed call earlier in this step
        ++next_piece;
        piece_done = 0;
        continue;
      }
      if (std::find(owners.begin(), owners.end(), &s) != owners.end()) break;
      BatchEntry e;
      e.sequence = s.sequence.get();
      if (p.n == 0 && !s.verify_ids.empty()) {  // a speculative round: every row's logits
        e.ids = std::span<const int32_t>(s.verify_ids);
        e.all_logits = true;
        soft_rows.push_back(0);
        ++next_piece;
        call_rows += static_cast<int64_t>(s.verify_ids.size());
      } else if (p.n == 0) {
        e.ids = std::span<const int32_t>(&*s.next_id, 1);
        soft_rows.push_back(0);
        ++next_piece;
        call_rows += 1;
      } else {
        const int64_t from = p.begin + piece_done;
        const int64_t take = chunk_end_keeping_images_whole(
                                 s.sequence->config(), s.prompt, from,
                                 from + std::min(p.n - piece_done, ubatch_rows_ - call_rows)) -
                             from;
        e.ids = std::span<const int32_t>(s.prompt.data() + p.begin + piece_done,
                                         static_cast<size_t>(take));
        soft_rows.push_back(count_placeholders(s.sequence->config(), e.ids));
        piece_done += take;
        call_rows += take;
        if (piece_done == p.n) {
          ++next_piece;
          piece_done = 0;
        }
      }
      batch.push_back(e);
      owners.push_back(&s);
    }
    if (batch.empty()) continue;
    // A slot's rows go on from where its previous call left them: that call finishes first, as
    // do calls beyond the pipeline's depth.
    auto owner_in_flight = [&] {
      for (Slot* s : owners)
        if (s->in_flight) return true;
      return false;
    };
    while (pipeline_->in_flight() > 0 &&
           (pipeline_->in_flight() >= static_cast<size_t>(pipeline_depth_) || owner_in_flight())) {
      rows_run += finish_call();
      ++finished;
    }
    // Each entry's soft tokens follow those its slot's earlier calls consumed; an entry whose
    // request ended meanwhile leaves the call.
    CallInFlight call;
    std::vector<BatchEntry> live;
    std::vector<FloatTensor> softs;
    softs.reserve(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      Slot& s = *owners[i];
      if (!s.gen) continue;
      BatchEntry e = batch[i];
      if (soft_rows[i] > 0) {
        softs.push_back(slice_rows(s.soft, s.soft_at, soft_rows[i]));
        e.soft_tokens = &softs.back();
      }
      live.push_back(e);
      call.owners.push_back(&s);
      call.soft_rows.push_back(soft_rows[i]);
    }
    if (live.empty()) continue;
    batch = std::move(live);
    call.rows = call_rows;
    if (drafter_)
      call.hidden = std::make_unique<TapRecorder>(std::vector<std::string>{"final_hidden"});
    try {
      const uint64_t id = pipeline_->start(batch, call.hidden.get());
      for (Slot* s : call.owners) s->in_flight = true;
      calls_in_flight_.emplace(id, std::move(call));
    } catch (const std::exception& e) {
      for (Slot* s : call.owners)
        if (s->gen) end(*s, "", EngineError{EngineError::Kind::kInternal, e.what()});
    }
  }
  // Pipelined, the step ends once a call finished (the pipeline stays full); otherwise once all
  // did.
  while (pipeline_->in_flight() > 0 &&
         (pipeline_depth_ == 1 || finished == 0 ||
          pipeline_->in_flight() >= static_cast<size_t>(pipeline_depth_))) {
    rows_run += finish_call();
    ++finished;
  }
  const double secs = seconds_between(t0, Clock::now());
  std::lock_guard<std::mutex> lk(q_mu_);
  for (auto& s : slots_)
    if (s->gen) {
      s->rows = s->sequence->n_past();
      s->decoded = s->stream->steps();
    }
  size_t b = 0;
  while (b < kStepBuckets.size() && secs > kStepBuckets[b]) ++b;
  ++step_counts_[b];
  step_seconds_sum_ += secs;
  step_rows_total_ += rows_run;
}

// The next call of the pipeline to finish: its sequences sample their next ids (or their
// requests end with the call's error). Returns the rows it ran.
int64_t Engine::finish_call() {
  const auto t0 = Clock::now();
  CallPipeline::Finished f = pipeline_->next();
  const double call_seconds = seconds_between(t0, Clock::now());
  auto node = calls_in_flight_.extract(f.call);
  if (node.empty()) return 0;
  CallInFlight& call = node.mapped();
  for (Slot* s : call.owners) s->in_flight = false;
  if (f.error) {
    try {
      std::rethrow_exception(f.error);
    } catch (const std::bad_alloc&) {
      for (Slot* s : call.owners)
        if (s->gen)
          end(*s, "",
              EngineError{EngineError::Kind::kOutOfMemory,
                          "out of memory while running this request"});
    } catch (const std::exception& e) {
      // A stage on a rank that stopped answering is the service's failure, not the request's.
      const bool stage_down = !model_->stage_failure().empty();
      for (Slot* s : call.owners)
        if (s->gen)
          end(*s, "",
              EngineError{
                  stage_down ? EngineError::Kind::kStageFailed : EngineError::Kind::kInternal,
                  e.what()});
    }
    return 0;
  }
  const int64_t V = model_->config().text.vocab_size;
  // The drafter's h: the post-final-norm hidden of each head row, entry after entry.
  FloatTensor hidden;
  if (call.hidden && call.hidden->has("final_hidden")) hidden = call.hidden->get("final_hidden");
  int64_t head_row = 0;
  for (size_t i = 0; i < call.owners.size(); ++i) {
    Slot& s = *call.owners[i];
    const FloatTensor& l = f.logits[i];
    const int64_t row0 = head_row;
    head_row += l.dim(0);
    if (!s.gen) continue;
    s.soft_at += call.soft_rows[i];
    const bool prompt_done = s.state == SlotState::kDecode ||
                             s.sequence->n_past() == static_cast<int64_t>(s.prompt.size());
    if (!prompt_done) continue;
    const bool was_decoding = s.state == SlotState::kDecode;
    if (s.state == SlotState::kPrefill) {
      s.soft = FloatTensor();
      {
        std::lock_guard<std::mutex> lk(q_mu_);
        s.state = SlotState::kDecode;
      }
      std::lock_guard<std::mutex> lk(s.gen->mu_);
      s.gen->first_token_at_ = Clock::now();
    }
    Generation& gen = *s.gen;
    const TextCallback emit = [&gen](std::string_view piece) {
      gen.append(piece);
      return !gen.cancelled();
    };
    // The hidden state of this entry's head row r becomes the drafter's h.
    auto keep_hidden = [&](int64_t r) {
      if (!s.draft || row0 + r >= hidden.dim(0) || hidden.numel() == 0) {
        s.draft_h.clear();
        return;
      }
      s.draft_h.assign(hidden.row(row0 + r), hidden.row(row0 + r) + hidden.dim(1));
    };
    if (!s.verify_ids.empty()) {
      // A speculative round: the stream takes the accepted drafts and the target's own token
      // (each as a plain step would, so stop strings, max_tokens and logprobs stay exact), and
      // the sequence drops the rows past them.
      const int64_t k = static_cast<int64_t>(s.verify_ids.size()) - 1;
      const int64_t P = s.sequence->n_past() - k - 1;
      int n = 0;
      s.next_id = s.stream->next_verified(
          l.row(0), V, std::span<const int32_t>(s.verify_ids).subspan(1),
          [&](int64_t j) { return P + j + 2 <= s.capacity; }, emit, &n);
      s.verify_ids.clear();
      ++draft_rounds_;
      drafted_ += k;
      draft_accepted_ += n;
      ++s.draft_stats.rounds;
      s.draft_stats.drafted += k;
      s.draft_stats.accepted += n;
      s.draft_stats.verify_rows += k + 1;
      s.draft_stats.verify_seconds += call_seconds;
      s.draft->round(k, n, -1);
      if (!s.sequence->truncate(P + n + 1)) {
        if (s.next_id) {
          end(s, "",
              EngineError{EngineError::Kind::kInternal,
                          "speculative decoding: the KV cache cannot roll back to " +
                              std::to_string(P + n + 1) + " rows"});
          continue;
        }
        s.sequence->reset();
      }
      keep_hidden(n);
    } else {
      s.next_id =
          s.stream->next(l.row(l.dim(0) - 1), V, s.sequence->n_past() + 1 <= s.capacity, emit);
      if (s.draft && was_decoding) {
        s.draft->plain_step(-1);
        ++s.draft_stats.plain_steps;
      }
      keep_hidden(l.dim(0) - 1);
    }
    gen.append_tokens(s.stream->result().tokens);
    if (s.wants_logprobs) gen.append_logprobs(s.stream->result().logprobs);
    if (!s.next_id) end(s, s.stream->result().finish_reason);
  }
  return call.rows;
}

// Abandons every call in flight: their sequences stay as they were before each call.
void Engine::drop_calls_in_flight() {
  pipeline_ = std::make_unique<CallPipeline>(pool_);
  calls_in_flight_.clear();
  for (auto& s : slots_) {
    s->in_flight = false;
    s->verify_ids.clear();
  }
}

Engine::Stats Engine::stats() const {
  Stats st;
  st.completed = completed_.load();
  st.cancelled = cancelled_.load();
  st.failed = failed_.load();
  st.prompt_tokens = prompt_tokens_.load();
  st.cached_tokens = cached_tokens_.load();
  st.generated_tokens = generated_tokens_.load();
  st.draft_rounds = draft_rounds_.load();
  st.drafted = drafted_.load();
  st.draft_accepted = draft_accepted_.load();
  st.kv_budget = kv_budget_;
  st.max_context = max_context_;
  std::lock_guard<std::mutex> lk(q_mu_);
  st.slots = static_cast<int>(slots_.size());
  st.busy = busy_;
  st.queued = static_cast<int>(queue_.size());
  for (const auto& s : slots_) {
    st.kv_rows_used += s->rows;
    st.kv_rows_reserved += s->reserved;
    st.slot_info.push_back({s->id, s->state, s->rows, s->reserved, s->decoded,
                            s->gen ? s->max_tokens - s->decoded : -1});
  }
  st.step_counts.assign(step_counts_.begin(), step_counts_.end());
  st.step_seconds_sum = step_seconds_sum_;
  st.step_rows_total = step_rows_total_;
  return st;
}

}  // namespace gemstage
