// `gemstage serve`: an OpenAI-compatible HTTP server over cpp-httplib.
//
// Design, in short:
//  - One Assistant (weights, tokenizer) shared by N slots (--parallel), each with its own
//    Sequence (KV caches) and compute thread pool, each driven by one worker thread. Requests wait in one FIFO queue and
//    the first free slot takes the oldest, so nobody is overtaken.
//  - HTTP threads never run the model: they parse and validate a request (decoding its images),
//    queue it, and then only move text from the job to the socket. A worker appends generated
//    text to its job under the job's own mutex and never touches a socket, so a slow or stalled
//    client delays nobody but itself, and no lock is held while writing.
//  - A client that goes away is noticed by a failed write or by polling its socket for a hang-up
//    (also while it waits in the queue or for a non-streamed reply); its job is cancelled at the
//    next token and its slot's caches are dropped.
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
  std::string host = "127.0.0.1";
  int port = 8080;                     // 0: any free port (port() says which)
  int parallel = 1;                    // slots: requests generated at the same time
  int64_t ctx = 0;                     // context per slot; 0: the model's maximum
  std::optional<KvType> kv_type;       // KV cache row type; nullopt: the pipeline's choice
  std::string api_key;                 // non-empty: /v1/* requires "Authorization: Bearer <key>"
  size_t max_body = size_t{32} << 20;  // request bodies over this get 413
  int threads = 0;                     // compute threads for all slots together; 0: all cores
  int http_threads = 0;  // connections served at once; 0: a default that fits the slots
  // Request defaults: max_tokens, sampling, stop strings, prefill chunk. stop_ids is ignored;
  // the model's stop ids are used unless ignore_eos.
  GenerationOptions defaults;
  bool ignore_eos = false;
  std::optional<uint64_t> seed;  // fixed sampler seed for requests without one (else random)
  bool think = false;            // render chat prompts with thinking enabled
  RequestLimits limits;
  double shutdown_grace_seconds = 5;  // how long shutdown() lets running generations finish
  // Run on the loader thread before the model is opened: lets a test hold the server in its
  // "loading" state.
  std::function<void()> before_load;
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
  };
  Stats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gemstage::server
