// `gemstage serve`: an OpenAI-compatible HTTP server over cpp-httplib.
//
// Design, in short:
//  - One Assistant (weights, tokenizer) shared by N slots (--parallel), each with its own
//    Sequence (KV caches). One engine thread with one thread pool (all -t threads) runs them
//    together (continuous batching): each step is one batched pass with a decode row for every
//    generating request plus prompt chunks of new ones (at most -b rows a step, -ub a call), so
//    the weights are read once for all, and a request joins at the next step and leaves when
//    done. Requests wait in one FIFO queue; the oldest starts when a slot is free and its rows
//    (prompt + max_tokens) fit the KV budget -c shared by all slots, so nobody is overtaken; a
//    prompt that could never fit is refused at once. A new prompt goes to the idle slot whose
//    caches hold the longest prefix of it (the next turn of a conversation, a shared system
//    prompt), which is then not prefilled again.
//  - HTTP threads never run the text model: they parse and validate a request (decoding its
//    images), render its prompt (its images through the vision tower, one request at a time on a
//    pool of half the threads, so the engine's streams keep flowing meanwhile), refuse a prompt
//    that could never fit, queue it, and then only move text from the job to the socket. The
//    engine appends generated text to its job under the job's own mutex and never touches a
//    socket, so a slow or stalled client delays nobody but itself, and no lock is held while
//    writing.
//  - A client that goes away is noticed by a failed write or by polling its socket for a hang-up
//    (also while it waits in the queue or for a non-streamed reply); its job is cancelled at the
//    next step and its slot's rows are dropped (also in the middle of a prefill).
//  - The socket is bound before the model loads, so /health can say "loading" (503).
//  - shutdown(): new work is refused with 503, queued jobs are failed, running ones get a grace
//    period to finish and are then cancelled, and the listener closes once every reply is out.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "runtime/generation.h"
#include "server/api.h"

namespace gemstage::server {

struct ServerOptions {
  std::string model_path;  // HF checkpoint directory or gemstage bundle
  ModelOpener models;      // how model_path opens (under mpirun: across the ranks)
  int pipeline_depth = 0;  // calls kept in flight over remote stages; 0: CallPipeline::depth
  std::string host = "127.0.0.1";
  int port = 8080;   // 0: any free port (port() says which)
  int parallel = 1;  // slots: requests generated at the same time
  int64_t ctx = 0;   // KV rows all slots share (one request's context too); 0: the model's maximum
  int batch = 512;   // rows one engine step runs at most (decode rows + prompt chunks), -b
  int ubatch = 512;  // rows one batched call runs at most, -ub
  std::optional<KvType> kv_type;       // KV cache row type; nullopt: the pipeline's choice
  std::string api_key;                 // non-empty: /v1/* requires "Authorization: Bearer <key>"
  size_t max_body = size_t{32} << 20;  // request bodies over this get 413
  int threads = 0;                     // the engine's compute threads; 0: all cores
  int http_threads = 0;  // connections served at once; 0: a default that fits the slots
  // Request defaults: max_tokens, sampling, stop strings, prefill chunk. stop_ids is ignored;
  // the model's stop ids are used unless ignore_eos.
  GenerationOptions defaults;
  bool ignore_eos = false;
  std::optional<uint64_t> seed;  // fixed sampler seed for requests without one (else random)
  bool think = false;            // render chat prompts with thinking enabled
  RequestLimits limits;
  // Speculative decoding with a gemma4_assistant (MTP) drafter, -md DIR (or a bundle's drafter
  // stage): every request drafts unless it sends "speculative.n_max": 0 (or has images / audio
  // or an output constraint, which decode plainly). draft_max / draft_min: a request's defaults
  // (--draft-max / --draft-min).
  std::string model_draft;
  int draft_max = 4, draft_min = 0;
  // Adapt each request's draft length to its acceptance (runtime/speculative.h DraftControl);
  // false keeps k = draft_max (--no-draft-adapt).
  bool draft_adapt = true;
  // Without model_draft, a bundle's drafter stage (export -md) drafts, unless this is false
  // (--no-bundle-drafter).
  bool bundle_drafter = true;
  // llama-server's switches: the model's name in replies and /v1/models (-a / --alias; empty: the
  // checkpoint's name), GET /slots (--slots), browser origins allowed to call the API (--cors:
  // comma-separated origins or "*"; empty: no CORS headers), and the seconds a connection may
  // wait on a read or write (-to / --timeout; 0: the library's default).
  std::string alias;
  bool slots_endpoint = false;
  std::string cors_origins;
  int io_timeout_seconds = 0;
  // The access log: one line per request once its reply went out (time, client, method, path,
  // status, the prompt / cached / generated tokens, time to first token, decode tokens/s, the
  // error code), as "text" or one JSON object a line ("json"); "off" writes none. To
  // access_log_path (appended; --log-file), or stderr when that is empty.
  std::string access_log_format = "text";
  std::string access_log_path;
  double shutdown_grace_seconds = 5;  // how long shutdown() lets running generations finish
  // Run on the loader thread before the model is opened: lets a test hold the server in its
  // "loading" state.
  std::function<void()> before_load;
  // Run on the engine thread before each batched step: lets a test hold running requests in the
  // middle of their generation, however fast the model is.
  std::function<void()> before_step;
};

class Server {
 public:
  explicit Server(ServerOptions options);
  ~Server();  // shutdown()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and starts serving (/health answers "loading"), then loads the model in the
  // background. Throws gemstage::Error if the address cannot be bound.
  void start();
  int port() const;
  // Blocks until the model is loaded (true) or failed to load (false; see load_error()).
  bool wait_loaded();
  enum class LoadState { kLoading, kReady, kFailed };
  LoadState load_state() const;
  std::string load_error() const;
  // Graceful stop, see above; idempotent, returns once everything is closed.
  void shutdown();

  struct Stats {
    int slots = 0, busy = 0, queued = 0;
    int64_t completed = 0, cancelled = 0;
    // KV rows: the budget (-c), one request's context, rows the slots hold, and rows counted
    // against the budget (a running request's whole share, an idle slot's held prefix).
    int64_t kv_budget = 0, max_context = 0, kv_rows_used = 0, kv_rows_reserved = 0;
    // Speculative decoding: verify rounds, drafts made and drafts the target accepted.
    int64_t draft_rounds = 0, drafted = 0, draft_accepted = 0;
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemstage::server
