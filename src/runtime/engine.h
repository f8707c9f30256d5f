// The engine: the one scheduler every front end drives (serve, generate, chat, bench, rank 0 of
// an MPI job). It owns a fixed set of slots, each one conversation's Sequence (KV caches) on the
// shared Model, and turns queued requests into batched steps:
//
//  - Admission: requests wait in one FIFO queue; the oldest starts when a slot is free and its
//    rows (prompt + max_tokens) fit the KV budget all slots share, so nobody is overtaken. It
//    goes to the idle slot whose caches hold the longest prefix of its prompt (the next turn of a
//    conversation, a shared system prompt), which is then not prefilled again; idle slots' held
//    prefixes are evicted, stalest first, when the budget needs their rows.
//  - Continuous batching: each step is one batched pass with a decode row for every generating
//    request plus prompt chunks of the ones being prefilled (oldest first, at most batch_rows a
//    step, ubatch_rows a call, an image of the large models never split), so the weights are read
//    once for all; a request joins at the next step and leaves when done.
//  - Speculative decoding (a drafter): a drafting request's decode row becomes the k+1 verify
//    rows of a drafting round (runtime/speculative.h), verified in the same batched call.
//  - Pipelining: with stages in other processes (MPI ranks), the running requests are split over
//    several calls kept in flight together (stage/call_pipeline.h).
//  - Sampling, stop conditions, streaming and logprobs: each request's TokenStream
//    (runtime/generation.h), so every front end produces the same ids and text.
//  - Cancellation: Generation::cancel(); a cancelled request ends at the next step and its rows
//    are dropped (also in the middle of a prefill).
//
// Threading: submit(), cancel, stats() and the Generation handles are thread-safe. Steps run on
// one thread at a time: run() (a server's engine thread) or run_until_idle() (a CLI's own
// thread). The engine calls no front-end code except EngineOptions::before_step (tests), and never
// blocks on a reader: a Generation's progress is appended under its own mutex and read by
// whoever holds the handle.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/thread_pool.h"
#include "gemma4/assistant_model.h"
#include "runtime/generation.h"
#include "runtime/speculative.h"
#include "stage/call_pipeline.h"
#include "stage/sequence.h"
#include "tokenizer/tokenizer.h"

namespace gemstage {

struct EngineOptions {
  int slots = 1;                  // requests generated at the same time (--parallel)
  int64_t kv_budget = 0;          // KV rows all slots share (-c); 0: the model's max_context
  int batch_rows = 512;           // rows one step runs at most: decode rows plus prompt chunks (-b)
  int ubatch_rows = 512;          // rows one batched call runs at most (-ub)
  int pipeline_depth = 0;         // calls in flight over remote stages; 0: CallPipeline::depth
  std::optional<KvType> kv_type;  // every slot's KV row type; nullopt: the model's default
  // The MTP drafter every drafting request runs (null: no drafting). Its donor layers' caches must
  // be held in this process; the constructor fails, naming them, otherwise.
  std::shared_ptr<const AssistantModel> drafter;
  // Run before each step (tests hold requests mid-generation with it).
  std::function<void()> before_step;
};

// One request as the engine takes it: the prompt (ids and the soft tokens of its placeholder
// rows, in order), how to generate, and whether to draft.
struct EngineRequest {
  std::vector<int32_t> ids;
  FloatTensor soft_tokens;  // [N, D] for the prompt's N placeholder rows; empty without media
  GenerationOptions gen;
  // Speculative decoding for this request (needs EngineOptions::drafter); nullopt: plain.
  std::optional<SpeculativeOptions> draft;
};

// Why a request ended without a result.
struct EngineError {
  enum class Kind {
    kInternal,      // a fault while it ran (a bug, or a stage's error)
    kOutOfMemory,   // memory ran out while it ran
    kStageFailed,   // a stage in another process stopped answering (the service's failure)
    kCancelled,     // cancelled while it waited in the queue
    kShuttingDown,  // the engine stopped before it started
  };
  Kind kind = Kind::kInternal;
  std::string message;
};

// A request the engine refuses at submit(): it could never run.
class RequestRejected : public Error {
 public:
  enum class Reason {
    kPromptTooLong,            // the prompt leaves no room for one generated token
    kPlaceholderWithoutMedia,  // a placeholder id with no soft token to fill it (at `index`)
    kDraftingUnavailable,      // draft options without a drafter
    kShuttingDown,
  };
  RequestRejected(Reason reason, const std::string& message, int64_t index = -1)
      : Error(message), reason_(reason), index_(index) {}
  Reason reason() const { return reason_; }
  int64_t index() const { return index_; }  // the offending prompt row, when there is one

 private:
  Reason reason_;
  int64_t index_;
};

// One request's progress and result, written by the engine and read by whoever holds it.
class Generation {
 public:
  // What has happened since the last look (take()), and the state so far.
  struct Progress {
    std::string text;                    // new text since the last take()
    std::vector<TokenLogprob> logprobs;  // new logprobs since the last take()
    std::vector<int32_t> tokens;         // ids generated since the last take()
    bool started = false;                // admitted to a slot: it will run to a result
    bool done = false;
    std::optional<EngineError> error;
    std::string finish_reason;  // done without error: "stop", "length", "context", "cancelled"
    std::string stop_string;    // the stop string that ended it, if one did
    int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  };
  // The whole outcome, once done.
  struct Result {
    std::optional<EngineError> error;
    GenerationResult generation;  // tokens, logprobs, text, finish_reason, stop_string
    int64_t prompt_tokens = 0;
    int64_t cached_tokens = 0;  // prompt rows found in the slot's caches (not prefilled)
    // Seconds: queued until admitted, admitted until the first token was sampled (prefill),
    // and from then to the end (decode).
    double queue_seconds = 0, prefill_seconds = 0, decode_seconds = 0;
    SpeculativeStats draft;  // drafting rounds of this request
    int slot = -1;           // the slot that ran it
  };

  // Ends the request at the next step (a queued one never starts). Thread-safe, idempotent.
  void cancel() { cancel_.store(true); }
  bool cancelled() const { return cancel_.load(); }
  bool started() const;
  bool done() const;

  // Waits up to `wait` for new text or the end, then returns what is new since the last take().
  Progress take(std::chrono::milliseconds wait);
  // Waits up to `wait` until it started (or ended); true once it has.
  bool wait_started(std::chrono::milliseconds wait);
  // Waits up to `wait` until it ended; true once it has.
  bool wait_done(std::chrono::milliseconds wait);
  // Blocks until it ended and returns the outcome.
  Result wait();
  // The outcome so far (complete once done).
  Result result() const;

 private:
  friend class Engine;
  // Engine side, each under mu_.
  void mark_started(int64_t prompt_tokens, int64_t cached, int slot);
  void append(std::string_view text);
  void append_logprobs(const std::vector<TokenLogprob>& all);
  void append_tokens(const std::vector<int32_t>& all);
  void finish(const GenerationResult& r, const SpeculativeStats& draft);
  void fail(EngineError e);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> cancel_{false};
  bool started_ = false, done_ = false;
  std::string pending_;
  size_t logprobs_taken_ = 0, tokens_taken_ = 0;
  Result result_;
  std::chrono::steady_clock::time_point queued_at_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point started_at_, first_token_at_;
};

class Engine {
 public:
  // The model and tokenizer are shared read-only (tokenizer null: ids only, no text, as `bench`
  // runs a checkpoint without one); the pool is the engine's alone while a step runs. Fails when
  // the drafter's donor caches are not held in this process.
  Engine(std::shared_ptr<const Model> model, const Tokenizer* tokenizer, ThreadPool& pool,
         EngineOptions options);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const Model& model() const { return *model_; }
  // One request's context: the budget, or the model's maximum if less.
  int64_t max_context() const { return max_context_; }
  int64_t kv_budget() const { return kv_budget_; }
  bool drafting() const { return drafter_ != nullptr; }
  // Calls kept in flight over stages in other processes (1: every stage is here).
  int pipeline_depth() const { return pipeline_depth_; }
  // Throws RequestRejected, as submit() would, when this prompt could never run.
  void validate(std::span<const int32_t> ids, const FloatTensor& soft_tokens) const;

  // Queues a request (thread-safe). Throws RequestRejected when it could never run.
  std::shared_ptr<Generation> submit(EngineRequest request);

  // Runs steps on this thread until every request submitted so far has ended; after_step (if
  // set) runs after each step, e.g. to print the text a CLI's request made meanwhile.
  void run_until_idle(const std::function<void()>& after_step = {});
  // Runs steps on this thread while there is work, sleeping while idle, until stop().
  void run();
  // Makes run() return after its current step; queued and running requests stay as they are.
  void stop();
  // Stops admitting: queued requests fail with kShuttingDown (now and when submitted later).
  void close_queue();
  // Cancels every running request (they end at the next step as "cancelled").
  void cancel_running();
  // Blocks until no slot runs a request, or the timeout passed; true if none does.
  bool wait_idle(std::chrono::milliseconds timeout);

  // What a slot is doing, as /health reports it.
  enum class SlotState { kIdle, kPrefill, kDecode };
  static const char* slot_state_name(SlotState s);

  struct SlotInfo {
    int id = 0;
    SlotState state = SlotState::kIdle;
    int64_t rows = 0;        // KV rows the sequence holds
    int64_t reserved = 0;    // budget rows counted for it
    int64_t decoded = 0;     // tokens generated for the running request (0 when idle)
    int64_t remaining = -1;  // tokens it may still generate (max_tokens - decoded); -1 when idle
  };
  struct Stats {
    int slots = 0, busy = 0, queued = 0;
    int64_t completed = 0, cancelled = 0, failed = 0;
    int64_t prompt_tokens = 0, cached_tokens = 0, generated_tokens = 0;
    int64_t draft_rounds = 0, drafted = 0, draft_accepted = 0;
    int64_t kv_budget = 0, max_context = 0, kv_rows_used = 0, kv_rows_reserved = 0;
    // Step latency as a histogram over kStepBuckets (seconds), the last count past them all.
    std::vector<int64_t> step_counts;
    double step_seconds_sum = 0;
    int64_t step_rows_total = 0;
    std::vector<SlotInfo> slot_info;
  };
  static constexpr std::array<double, 10> kStepBuckets = {0.005, 0.01, 0.025, 0.05, 0.1,
                                                          0.25,  0.5,  1,     2.5,  10};
  Stats stats() const;

 private:
  struct Slot;
  struct CallInFlight;
  struct Queued {
    std::shared_ptr<Generation> gen;
    EngineRequest request;
    int64_t capacity = 0;  // KV rows it may need: prompt + max_tokens, at most max_context
  };

  // One step: drops cancelled queued requests, admits, runs one batched step. False when there
  // was nothing to run.
  bool step_once();
  void admit();  // under q_mu_
  void start(Slot& s, Queued q);
  bool draft(Slot& s);
  void run_step();
  int64_t finish_call();
  void drop_calls_in_flight();
  void end(Slot& s, const std::string& reason, const std::optional<EngineError>& error = {});

  std::shared_ptr<const Model> model_;
  const Tokenizer* tok_;
  ThreadPool& pool_;
  EngineOptions opt_;
  std::shared_ptr<const AssistantModel> drafter_;
  AssistantDonors donors_;
  int64_t max_context_ = 0, kv_budget_ = 0;
  int batch_rows_ = 1, ubatch_rows_ = 1;
  int pipeline_depth_ = 1;
  std::vector<int> placeholders_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::unique_ptr<CallPipeline> pipeline_;
  std::map<uint64_t, CallInFlight> calls_in_flight_;

  mutable std::mutex q_mu_;
  std::condition_variable q_cv_, idle_cv_;
  std::deque<Queued> queue_;
  bool queue_changed_ = false, closed_ = false, stop_ = false;
  int busy_ = 0;
  uint64_t steps_ = 0, admissions_ = 0;  // step thread only
  std::atomic<int64_t> completed_{0}, cancelled_{0}, failed_{0};
  std::atomic<int64_t> prompt_tokens_{0}, cached_tokens_{0}, generated_tokens_{0};
  std::atomic<int64_t> draft_rounds_{0}, drafted_{0}, draft_accepted_{0};
  std::array<int64_t, kStepBuckets.size() + 1> step_counts_{};  // under q_mu_
  double step_seconds_sum_ = 0;                                 // under q_mu_
  int64_t step_rows_total_ = 0;                                 // under q_mu_
};

}  // namespace gemstage
