// The server's insides, shared by the files that make it up: server.cc (lifecycle, the engine
// glue and the OpenAI / Anthropic routes) and llama_routes.cc (llama-server's own endpoints).
// Not part of the server room's interface: only its own .cc files include it.
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "io/mapped_file.h"
#include "runtime/engine.h"
#include "server/server.h"

namespace gemstage::server {

// Which API a generation request came in through; it decides the reply's shape.
// kNative: llama-server's own /completion (its reply shape, `timings`, completion_probabilities).
enum class Route { kChat, kCompletion, kMessages, kResponses, kNative };

// One request on its way: what its API asked for, the prompt and options it was prepared into,
// and, once submitted, the engine's handle of its generation (runtime/engine.h).
struct Job {
  bool chat = true;
  std::vector<ChatInput> messages;          // chat
  std::optional<ToolRequest> tool_request;  // chat with tools / tool history (api.h)
  nlohmann::json response_echo;             // /v1/responses: request fields the reply repeats
  std::string prompt_text;                  // completion
  std::optional<std::vector<int32_t>> prompt_ids;  // completion sent as token ids
  SamplingOverrides sampling;

  // Rendered before the request queues (Impl::prepare).
  PreparedPrompt prompt;
  GenerationOptions gen;
  std::optional<SpeculativeOptions> draft;  // this request's drafting; nullopt: plain decoding
  std::shared_ptr<Generation> generation;   // the engine's handle, once submitted
  // Native /completion: n_probs (top alternatives per token; 0: no completion_probabilities)
  // and return_tokens (the generated ids in `tokens`).
  int n_probs = 0;
  bool return_tokens = false;
};

// The error reply for a route: Anthropic's shape on /v1/messages*, OpenAI's elsewhere.
void set_error(const httplib::Request& req, httplib::Response& res, const ApiError& e);
ApiError shutting_down_error();

struct Server::Impl {
  explicit Impl(ServerOptions o) : opt(std::move(o)), seed_rng(std::random_device{}()) {}

  ServerOptions opt;
  httplib::Server http;

  // The access log (ServerOptions::access_log_*): what a request's line says beyond its method,
  // path and status, kept from routing to the library's logger under the library's Request
  // object (one per connection thread, reused: routing replaces what an earlier one left).
  struct AccessRecord {
    std::chrono::steady_clock::time_point start;
    int64_t prompt_tokens = -1, cached_tokens = -1, generated_tokens = -1;
    double ttft_ms = -1, tokens_per_second = -1;
  };
  std::mutex access_mu;
  std::unordered_map<const httplib::Request*, AccessRecord> access_records;
  std::unique_ptr<std::ofstream> access_file;
  void open_access_log();  // --log-file; throws when it cannot be opened
  void access_begin(const httplib::Request& req);
  // generated: the tokens the reply holds when it is more than r's (choices of `n`).
  void access_generation(const httplib::Request& req, const Generation::Result& r,
                         int64_t generated = -1);
  void access_log(const httplib::Request& req, const httplib::Response& res);
  std::thread listener, loader;
  int port = -1;
  int listen_fd = -1;  // the library's listening socket, seen as it is created

  std::atomic<bool> ready{false}, draining{false}, listener_done{false};
  std::once_flag shutdown_once;

  mutable std::mutex load_mu;
  std::condition_variable load_cv;
  bool load_finished = false;
  std::string load_error;
  std::string model_name;
  int64_t created = 0;  // when the model was loaded, for /v1/models
  GenerationOptions defaults;

  std::unique_ptr<Assistant> assistant;  // the model and tokenizer every request shares
  std::string drafter_name;              // -md DIR, or the bundle and its drafter stage
  std::unique_ptr<ThreadPool> pool;      // all compute threads, the engine's alone
  // Renders chat prompts (the vision tower for their images) beside the engine.
  std::mutex prepare_mu;
  std::unique_ptr<ThreadPool> prepare_pool;
  // The scheduler every request goes through (runtime/engine.h), and the thread that steps it.
  std::unique_ptr<Engine> engine;
  std::thread engine_thread;
  std::atomic<int64_t> refused{0};  // requests whose prompt could not start

  // Streamed replies not yet fully written; the listener stays open until they are.
  std::mutex streams_mu;
  std::condition_variable streams_cv;
  int open_streams = 0;

  std::mutex seed_mu;
  std::mt19937_64 seed_rng;

  uint64_t random_u64() {
    std::lock_guard<std::mutex> lk(seed_mu);
    return seed_rng();
  }
  std::string new_id(const char* prefix) {
    static constexpr char kHex[] = "0123456789abcdef";
    std::string id = prefix;
    for (uint64_t v = random_u64(), i = 0; i < 16; ++i, v >>= 4) id += kHex[v & 15];
    return id;
  }

  // A weights file truncated or rewritten in place under the server (io/mapped_file.h). Every
  // generation is then refused with a 503 naming the file, before anything reads the damaged
  // mapping, and /health answers 503 with the same message so an orchestrator restarts the
  // server; the first detection is also logged.
  std::atomic<bool> files_change_logged{false};
  std::string model_files_changed() {
    try {
      check_mapped_files();
      return {};
    } catch (const Error& e) {
      if (!files_change_logged.exchange(true)) std::cerr << "serve: " << e.what() << "\n";
      return e.what();
    }
  }
  void ensure_model_files_intact() {
    const std::string changed = model_files_changed();
    if (!changed.empty()) throw ApiError(503, changed, "server_error", {}, "model_file_changed");
    const std::string down = stage_failure();
    if (!down.empty()) throw ApiError(503, down, "server_error", {}, "stage_failed");
  }
  // A stage on another rank of an MPI job that stopped answering (stage/remote_stage.h): every
  // request is then refused with a 503 naming the stage, rank and host, and /health says so, so a
  // supervisor restarts the job (docs/distributed.md, "Faults").
  std::string stage_failure() const {
    return ready.load() && assistant ? assistant->model().stage_failure() : std::string();
  }

  void setup_routes();
  // llama-server's endpoints (llama_routes.cc): /tokenize, /detokenize, /apply-template, /props,
  // /slots, /completion, and the unprefixed aliases of the OpenAI routes.
  void setup_llama_routes();
  // Runs fn, turning what it throws into the route's error reply.
  void answer(const httplib::Request& req, httplib::Response& res, const std::function<void()>& fn);
  httplib::Server::Handler generation_handler(Route route);
  // The generation settings llama-server reports (/props, /slots, a native reply).
  nlohmann::json generation_settings_json(const GenerationOptions& g) const;
  // A native /completion's final reply (also a stream's last event, without probabilities).
  nlohmann::json native_completion_json(const Job& job, const Generation::Result& r,
                                        const std::string& content, bool stream) const;
  std::string llama_metrics_text();
  // Paths this server answers and the methods each takes ("GET", "POST"), for 405 and OPTIONS.
  std::vector<std::pair<std::string, std::string>> route_methods;
  // Prefill and decode time of ended requests (llama.cpp's *_seconds_total metrics).
  std::mutex timing_mu;
  double prompt_seconds_total = 0, decode_seconds_total = 0;
  void record_finished(const Generation::Result& r);
  std::string models_reply() const;  // GET /v1/models and /models
  void load();
  std::shared_ptr<const AssistantModel> open_drafter();
  void prepare(Job& job);
  std::string metrics_text();
  void submit(Job& job);
  void handle_generation(const httplib::Request& req, httplib::Response& res, Route route);
  void answer_completions(const httplib::Request& req, httplib::Response& res, Route route,
                          const Job& job, int n, const std::function<bool()>& client_alive);
  // The prompt tokens a request would take, without running it: Anthropic's
  // /v1/messages/count_tokens, OpenAI's /v1/responses/input_tokens and llama-server's
  // /chat/completions/input_tokens.
  void handle_count_tokens(const httplib::Request& req, httplib::Response& res, Route route);
  std::shared_ptr<Job> parse_job(const nlohmann::json& body, Route route,
                                 GenerationRequest& common);
  void shutdown();
  void end_idle_connections();
};

}  // namespace gemstage::server
