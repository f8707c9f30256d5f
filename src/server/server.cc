#include "server/server.h"

#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>
#include <thread>

#include "core/platform.h"
#include "gemma4/multimodal.h"
#include "io/mapped_file.h"
#include "runtime/engine.h"
#include "runtime/speculative.h"
#include "server/chat_page.h"
#include "server/llama_api.h"
#include "server/messages_api.h"
#include "server/responses_api.h"
#include "server/server_impl.h"
#include "stage/bundle.h"
#include "stage/call_pipeline.h"
#include "trace/taps.h"

namespace gemstage::server {

namespace {

using json = nlohmann::json;
using Clock = std::chrono::steady_clock;

// How often a waiting HTTP thread looks at its client's socket: short enough that a vanished
// client frees its slot within a token or two, long enough to cost nothing.
constexpr auto kPollInterval = std::chrono::milliseconds(50);

// "host:port" of a socket address, formatted the way cpp-httplib formats Request::remote_addr.
bool numeric_address(const sockaddr_storage& ss, socklen_t len, std::string& host, int& port) {
  char h[NI_MAXHOST], s[NI_MAXSERV];
  if (getnameinfo(reinterpret_cast<const sockaddr*>(&ss), len, h, sizeof(h), s, sizeof(s),
                  NI_NUMERICHOST | NI_NUMERICSERV) != 0)
    return false;
  host = h;
  port = std::atoi(s);
  return true;
}

// Calls fn(fd) for every socket among this process's open descriptors; fn returns false to stop.
template <typename Fn>
void for_each_socket_fd(Fn fn) {
  platform::for_each_open_fd([&](int fd) {
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return true;
    return fn(fd);
  });
}

// The accepted socket behind a request. cpp-httplib 0.11 gives handlers no way to ask whether the
// client is still there (later versions added Request::is_connection_closed), so the socket is
// found once by its address pair among this process's descriptors. That is sound for the life of
// the handler: the library closes the connection, and so frees the descriptor for reuse, only
// after the handler and its content provider have returned.
class ClientSocket {
 public:
  explicit ClientSocket(const httplib::Request& req) {
    for_each_socket_fd([&](int fd) {
      if (!matches(fd, req)) return true;
      fd_ = fd;
      return false;
    });
  }

  // False once the client closed or reset its end. Unknown (socket not found) counts as alive:
  // then a failed write is what notices a vanished client.
  bool alive() const { return fd_ < 0 || !platform::socket_peer_closed(fd_); }

 private:
  static bool matches(int fd, const httplib::Request& req) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    std::string host;
    int port = -1;
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
        !numeric_address(ss, len, host, port) || port != req.remote_port || host != req.remote_addr)
      return false;
    len = sizeof(ss);
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
        !numeric_address(ss, len, host, port))
      return false;
    return port == req.local_port && host == req.local_addr;
  }

  int fd_ = -1;
};

// Constant-time comparison, so response timing does not leak how much of a guessed key matched.
bool same_key(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

// The routes behind the API key and the loading / draining checks: the /v1 API and llama-server's
// endpoints; the page, /health and /metrics stay open.
bool is_api_path(const std::string& path) {
  static constexpr std::array<std::string_view, 10> kLlama = {
      "/completion", "/completions", "/chat/completions", "/responses", "/models",
      "/tokenize",   "/detokenize",  "/apply-template",   "/props",     "/slots"};
  return path.rfind("/v1/", 0) == 0 ||
         std::find(kLlama.begin(), kLlama.end(), path) != kLlama.end();
}

// --cors: "*" allows every origin, else a comma-separated list of exact origins.
// The entries of --cors, trimmed.
std::vector<std::string> cors_entries(const std::string& origins) {
  std::vector<std::string> out;
  size_t at = 0;
  while (at <= origins.size() && !origins.empty()) {
    size_t comma = origins.find(',', at);
    if (comma == std::string::npos) comma = origins.size();
    std::string one = origins.substr(at, comma - at);
    while (!one.empty() && one.front() == ' ') one.erase(0, 1);
    while (!one.empty() && one.back() == ' ') one.pop_back();
    out.push_back(std::move(one));
    at = comma + 1;
  }
  return out;
}

// Whether an Origin header is a page on this machine: http(s) on localhost, 127.0.0.1 or [::1],
// any port (llama-server's "localhost" entry).
bool loopback_origin(const std::string& origin) {
  for (const char* scheme : {"http://", "https://"}) {
    if (origin.rfind(scheme, 0) != 0) continue;
    const std::string rest = origin.substr(std::string(scheme).size());
    for (const char* host : {"localhost", "127.0.0.1", "[::1]"}) {
      const std::string h = host;
      if (rest == h) return true;
      if (rest.rfind(h + ":", 0) == 0 && rest.size() > h.size() + 1 &&
          rest.find_first_not_of("0123456789", h.size() + 1) == std::string::npos)
        return true;
    }
  }
  return false;
}

bool cors_allows(const std::string& origins, const std::string& origin) {
  for (const std::string& one : cors_entries(origins))
    if (one == "*" || one == origin || (one == "localhost" && loopback_origin(origin))) return true;
  return false;
}

// --cors entries are origins as browsers send them (scheme://host[:port], no path), "*" or
// "localhost"; anything else would silently match nothing, so it stops the server at start.
void check_cors_origins(const std::string& origins) {
  for (const std::string& one : cors_entries(origins)) {
    if (one == "*" || one == "localhost") continue;
    const size_t sep = one.find("://");
    const std::string scheme = sep == std::string::npos ? "" : one.substr(0, sep);
    const std::string host = sep == std::string::npos ? "" : one.substr(sep + 3);
    if ((scheme != "http" && scheme != "https") || host.empty() ||
        host.find_first_of("/?#@ ") != std::string::npos)
      fail("--cors: '", one,
           "' is not an origin; give comma-separated origins as browsers send them "
           "(http://host:port, no path), 'localhost' for any page on this machine, or '*'");
  }
}

}  // namespace

// The Messages routes answer in Anthropic's error shape, every other route in OpenAI's.
static bool is_messages_route(const std::string& path) {
  return path == "/v1/messages" || path.rfind("/v1/messages/", 0) == 0;
}

void set_error(const httplib::Request& req, httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  res.set_content(wire_json(is_messages_route(req.path) ? messages::error_json(e) : error_json(e)),
                  "application/json");
}

ApiError shutting_down_error() {
  return ApiError(503, "the server is shutting down", "server_error", {}, "server_shutting_down");
}

// ------------------------------------------------------------------------------------------
// Loading and the engine.

void Server::Impl::load() {
  try {
    if (opt.before_load) opt.before_load();
    const int total = opt.threads > 0 ? opt.threads : default_thread_count();
    assistant = Assistant::open(opt.model_path, opt.ctx, opt.kv_type, opt.models);
    const Assistant& a = *assistant;
    pool = std::make_unique<ThreadPool>(total);
    prepare_pool = std::make_unique<ThreadPool>(std::max(1, total / 2));
    EngineOptions eo;
    eo.slots = opt.parallel;
    eo.kv_budget = opt.ctx;
    eo.batch_rows = opt.batch;
    eo.ubatch_rows = opt.ubatch;
    eo.pipeline_depth = opt.pipeline_depth;
    eo.kv_type = opt.kv_type;
    eo.before_step = opt.before_step;
    eo.drafter = open_drafter();
    engine = std::make_unique<Engine>(assistant->shared_model(), &a.tokenizer(), *pool, eo);
    model_name = opt.alias.empty() ? a.model_name() : opt.alias;
    created = static_cast<int64_t>(std::time(nullptr));
    defaults = opt.defaults;
    defaults.stop_ids = opt.ignore_eos ? std::vector<int32_t>{} : a.stop_ids();
    defaults.sampling.suppress_tokens = a.suppress_tokens();
    defaults.cancel = nullptr;
    engine_thread = std::thread([this] { engine->run(); });
    ready.store(true);
  } catch (const std::exception& e) {
    engine.reset();
    std::lock_guard<std::mutex> lk(load_mu);
    load_error = e.what();
  }
  {
    std::lock_guard<std::mutex> lk(load_mu);
    load_finished = true;
  }
  load_cv.notify_all();
}

// -md: the drafter, checked against the target. It reads the target's donor caches, so those
// layers must run in this process; a bundle's own drafter stage that cannot is left out with a
// note, an explicit -md is an error.
std::shared_ptr<const AssistantModel> Server::Impl::open_drafter() {
  if (opt.draft_max < 0 || opt.draft_max > kMaxDraftsPerRound || opt.draft_min < 0)
    fail("--draft-max must be 0-", kMaxDraftsPerRound, " and --draft-min at least 0");
  // -md DIR, else a bundle's drafter stage (export -md) unless turned off.
  const bool from_bundle = opt.model_draft.empty();
  std::shared_ptr<const AssistantModel> d;
  if (!from_bundle) {
    d = gemstage::open_drafter(opt.model_draft);
    drafter_name = opt.model_draft;
  } else if (opt.bundle_drafter && is_bundle_dir(opt.model_path)) {
    const BundleManifest m = read_bundle_manifest(opt.model_path);
    d = open_bundle_drafter(opt.model_path, m);
    if (d) drafter_name = opt.model_path + " (stage " + m.drafter->id + ")";
  }
  if (!d) return nullptr;
  const Model& target = assistant->model();
  check_assistant_matches(d->config(), target.config(), drafter_name, opt.model_path);
  // What each round's draft_context needs: the embedding table and the donor caches here.
  std::string missing;
  try {
    Sequence probe(assistant->shared_model(), 1, opt.kv_type);
    (void)draft_context(probe, assistant_donor_layers(target.config().text), 0);
  } catch (const Error& e) {
    missing = e.what();
  }
  if (!missing.empty()) {
    if (!from_bundle)
      fail("-md ", opt.model_draft, ": ", missing,
           "; serve without -md, or keep the last transformer stage in the server's process");
    std::cerr << "serve: decoding without the bundle's drafter stage: " << missing << "\n";
    drafter_name.clear();
    return nullptr;
  }
  return d;
}

namespace {
// The API's error for a request the engine could not finish.
ApiError api_error(const EngineError& e) {
  switch (e.kind) {
    case EngineError::Kind::kOutOfMemory:
      return ApiError(503, "out of memory while serving this request", "server_error", {},
                      "out_of_memory");
    case EngineError::Kind::kStageFailed:
      return ApiError(503, e.message, "server_error", {}, "stage_failed");
    case EngineError::Kind::kCancelled:
      return ApiError(499, "the client went away", "invalid_request_error");
    case EngineError::Kind::kShuttingDown:
      return shutting_down_error();
    case EngineError::Kind::kInternal:
      break;
  }
  return ApiError(500, e.message, "server_error");
}
}  // namespace

// The prompt as ids (and soft tokens), on the request's own HTTP thread, so neither a long
// prompt's tokenization nor its images' vision tower pauses the engine's running streams; a prompt
// that can never fit is refused here, at once, before it queues.
void Server::Impl::prepare(Job& job) {
  ensure_model_files_intact();
  if (job.tool_request) {
    // The tool path renders with the checkpoint's own chat template (or the built-in renderer)
    // and keeps special tokens in the text, which the output parser reads.
    const ToolRequest& t = *job.tool_request;
    ConversationOptions conv;
    conv.enable_thinking = t.enable_thinking.value_or(opt.think);
    conv.add_generation_prompt = t.add_generation_prompt;
    conv.continue_final_message = t.continue_final_message;
    if (t.media.empty()) {
      job.prompt = assistant->prepare_conversation(t.messages, t.tools, conv);
    } else {  // the towers run on the preparation pool, one conversation at a time
      std::lock_guard<std::mutex> lk(prepare_mu);
      job.prompt =
          assistant->prepare_conversation(t.messages, t.tools, conv, t.media, prepare_pool.get());
    }
  } else if (job.chat) {
    // One conversation at a time on the preparation pool (a pool runs one job at a time).
    std::lock_guard<std::mutex> lk(prepare_mu);
    job.prompt = assistant->prepare_chat(*prepare_pool, job.messages, {true, opt.think});
  } else if (job.prompt_ids) {
    job.prompt.ids = std::move(*job.prompt_ids);  // as sent: no <bos>, no tokenization
  } else {
    job.prompt = assistant->prepare_raw(job.prompt_text);
  }
  // What the engine refuses at submit, refused here with the API's field and code, so a prompt
  // that can never run is a 400 before it queues (and /v1/messages/count_tokens says so too).
  try {
    engine->validate(job.prompt.ids, job.prompt.soft_tokens);
  } catch (const RequestRejected& e) {
    const char* field = job.chat ? "messages" : "prompt";
    if (e.reason() == RequestRejected::Reason::kPromptTooLong)
      throw ApiError(400,
                     std::string(e.what()) +
                         "; shorten the conversation or start the server with a larger -c / "
                         "--ctx-size",
                     "invalid_request_error", field, "context_length_exceeded");
    throw ApiError(400,
                   job.chat
                       ? "the conversation holds an image / audio placeholder token in its "
                         "text, with no image or audio to fill it"
                       : std::string(e.what()) + "; send images and audio to /v1/chat/completions",
                   "invalid_request_error", field, "invalid_value");
  }
  job.gen = apply_overrides(defaults, job.sampling, opt.seed.value_or(random_u64()));
  // Against the model's vocabulary (it may hold ids the tokenizer does not name).
  const int64_t vocab = assistant->model().config().text.vocab_size;
  for (const auto& [id, bias] : job.gen.sampling.logit_bias)
    if (id < 0 || id >= vocab)
      throw ApiError(400,
                     "'logit_bias' names token " + std::to_string(id) +
                         ", outside this model's vocabulary of " + std::to_string(vocab) + " ids",
                     "invalid_request_error", "logit_bias", "invalid_value");
  if (job.sampling.ignore_eos)
    job.gen.stop_ids = *job.sampling.ignore_eos ? std::vector<int32_t>{} : assistant->stop_ids();
  job.gen.keep_special_text = job.tool_request.has_value();
  if (job.tool_request) {
    // tool_choice is enforced while sampling: required / a named function force a well-formed
    // call (arguments matched against the tool's parameters), none bans <|tool_call>.
    const ToolRequest& t = *job.tool_request;
    if (t.tool_choice == "required" || t.tool_choice == "function") {
      if (job.gen.json_grammar)
        throw ApiError(400,
                       "response_format json_object / json_schema cannot be combined with "
                       "tool_choice '" +
                           t.tool_choice + "'",
                       "invalid_request_error", "tool_choice", "invalid_value");
      // The forced call is Gemma 4's call format, spelled with these tokens; without them no
      // token could continue it (a model with another tokenizer).
      for (const char* marker : {"<|tool_call>", "<tool_call|>", "<|\"|>"})
        if (!assistant->tokenizer().token_to_id(marker))
          throw ApiError(400,
                         "tool_choice '" + t.tool_choice +
                             "' forces a tool call in Gemma 4's format, but this model's "
                             "tokenizer has no " +
                             marker + " token; use tool_choice 'auto' or 'none'",
                         "invalid_request_error", "tool_choice", "unsupported_value");
      try {
        // With thinking on the model may think first, then must call. The thought leaves the
        // last kCallReserveTokens of max_tokens to the call; with fewer, it has no room.
        constexpr int64_t kCallReserveTokens = 64;
        using Thought = ToolCallGrammar::Thought;
        const int64_t thought_budget = int64_t{job.gen.max_tokens} - kCallReserveTokens;
        const bool can_think = t.enable_thinking.value_or(opt.think) &&
                               assistant->tokenizer().token_to_id("<channel|>").has_value();
        const Thought thought = !can_think                              ? Thought::kNone
                                : !job.prompt.generation_prefix.empty() ? Thought::kOpen
                                : thought_budget > 0                    ? Thought::kMayOpen
                                                                        : Thought::kNone;
        job.gen.tool_call_grammar = ToolCallGrammar::from_tools(
            t.tools, t.tool_choice == "function" ? t.tool_choice_name : "", t.parallel_tool_calls,
            thought, thought_budget);
      } catch (const Error& e) {
        throw ApiError(400, e.what(), "invalid_request_error", "tools", "unsupported_schema");
      }
    } else if (t.tool_choice == "none") {
      if (const auto id = assistant->tokenizer().token_to_id("<|tool_call>"))
        job.gen.banned_ids.push_back(*id);
    }
  }
  for (const std::string& stop : job.gen.stop_strings)
    if (stop.empty())
      throw ApiError(400, "stop strings must not be empty", "invalid_request_error", "stop");
  // Speculative decoding: the request's speculative.n_max / n_min, else the server's.
  const SamplingOverrides& so = job.sampling;
  if (!engine->drafting()) {
    if (so.draft_max.value_or(0) > 0)
      throw ApiError(400,
                     "'speculative.n_max' asks for drafting, but the server was started without "
                     "a drafter (-md DIR)",
                     "invalid_request_error", "speculative.n_max", "invalid_value");
    return;
  }
  SpeculativeOptions draft;
  draft.draft_max = so.draft_max.value_or(opt.draft_max);
  draft.draft_min = so.draft_min.value_or(std::min(opt.draft_min, draft.draft_max));
  draft.adaptive = opt.draft_adapt;
  if (draft.draft_max > 0 && draft.draft_min > draft.draft_max)
    throw ApiError(400,
                   "'speculative.n_min' (" + std::to_string(draft.draft_min) +
                       ") must not exceed the drafts per round at most (" +
                       std::to_string(draft.draft_max) + ")",
                   "invalid_request_error", "speculative.n_min", "invalid_value");
  // Constrained output decodes plainly (the engine drafts only for unconstrained streams).
  if (draft.draft_max > 0) job.draft = draft;
}

// GET /metrics: Prometheus text exposition format, version 0.0.4.
std::string Server::Impl::metrics_text() {
  const Engine::Stats st = engine->stats();
  std::string out;
  auto metric = [&](const char* name, const char* type, const char* help) {
    out += std::string("# HELP ") + name + " " + help + "\n# TYPE " + name + " " + type + "\n";
  };
  auto value = [&](const std::string& series, double v) {
    std::ostringstream s;
    s << series << " " << v << "\n";
    out += s.str();
  };
  metric("gemstage_requests_total", "counter",
         "Generation requests ended, by outcome (refused: the prompt could not start, e.g. too "
         "long; failed: an error while it ran).");
  value("gemstage_requests_total{outcome=\"completed\"}", static_cast<double>(st.completed));
  value("gemstage_requests_total{outcome=\"cancelled\"}", static_cast<double>(st.cancelled));
  value("gemstage_requests_total{outcome=\"failed\"}", static_cast<double>(st.failed));
  value("gemstage_requests_total{outcome=\"refused\"}", static_cast<double>(refused.load()));
  metric("gemstage_prompt_tokens_total", "counter", "Prompt tokens of requests that started.");
  value("gemstage_prompt_tokens_total", static_cast<double>(st.prompt_tokens));
  metric("gemstage_prompt_tokens_reused_total", "counter",
         "Prompt tokens found in a slot's caches and not prefilled again.");
  value("gemstage_prompt_tokens_reused_total", static_cast<double>(st.cached_tokens));
  metric("gemstage_generated_tokens_total", "counter", "Tokens generated.");
  value("gemstage_generated_tokens_total", static_cast<double>(st.generated_tokens));
  metric("gemstage_draft_rounds_total", "counter",
         "Speculative rounds: drafts verified in one step of their sequence (-md).");
  value("gemstage_draft_rounds_total", static_cast<double>(st.draft_rounds));
  metric("gemstage_draft_tokens_total", "counter", "Tokens the drafter proposed.");
  value("gemstage_draft_tokens_total", static_cast<double>(st.drafted));
  metric("gemstage_draft_accepted_total", "counter", "Drafted tokens the target accepted.");
  value("gemstage_draft_accepted_total", static_cast<double>(st.draft_accepted));
  metric("gemstage_step_seconds", "histogram", "Wall time of one engine step (all its calls).");
  int64_t cumulative = 0;
  for (size_t b = 0; b < Engine::kStepBuckets.size(); ++b) {
    cumulative += st.step_counts[b];
    std::ostringstream le;
    le << Engine::kStepBuckets[b];
    value("gemstage_step_seconds_bucket{le=\"" + le.str() + "\"}", static_cast<double>(cumulative));
  }
  cumulative += st.step_counts.back();
  value("gemstage_step_seconds_bucket{le=\"+Inf\"}", static_cast<double>(cumulative));
  value("gemstage_step_seconds_sum", st.step_seconds_sum);
  value("gemstage_step_seconds_count", static_cast<double>(cumulative));
  metric("gemstage_step_rows_total", "counter", "Rows (decode and prompt) the engine ran.");
  value("gemstage_step_rows_total", static_cast<double>(st.step_rows_total));
  metric("gemstage_queue_depth", "gauge", "Requests waiting for a slot or KV rows.");
  value("gemstage_queue_depth", static_cast<double>(st.queued));
  metric("gemstage_slots", "gauge", "Slots (--parallel).");
  value("gemstage_slots", static_cast<double>(st.slots));
  metric("gemstage_slots_busy", "gauge", "Slots running a request.");
  value("gemstage_slots_busy", st.busy);
  metric("gemstage_kv_rows_budget", "gauge", "KV rows all sequences share (-c).");
  value("gemstage_kv_rows_budget", static_cast<double>(st.kv_budget));
  metric("gemstage_kv_rows_used", "gauge", "KV rows the slots' caches hold.");
  value("gemstage_kv_rows_used", static_cast<double>(st.kv_rows_used));
  metric("gemstage_kv_rows_free", "gauge",
         "KV rows of the budget not reserved by running requests or held by idle slots.");
  value("gemstage_kv_rows_free", static_cast<double>(st.kv_budget - st.kv_rows_reserved));
  return out;
}

// Hands the prepared request to the engine; the engine's refusals become the API's errors.
void Server::Impl::submit(Job& job) {
  if (draining.load()) throw shutting_down_error();
  EngineRequest r;
  r.ids = job.prompt.ids;
  r.soft_tokens = job.prompt.soft_tokens;
  r.gen = job.gen;
  r.draft = job.draft;
  try {
    job.generation = engine->submit(std::move(r));
  } catch (const RequestRejected& e) {
    if (e.reason() == RequestRejected::Reason::kShuttingDown) throw shutting_down_error();
    throw ApiError(400, e.what(), "invalid_request_error");
  }
}

// ------------------------------------------------------------------------------------------
// HTTP.

namespace {

// Waits until the generation started (or, with until_done, ended) while watching the client;
// false (and the generation cancelled) if the client went away.
bool wait_watching(Generation& g, const ClientSocket& client, bool until_done) {
  while (!(until_done ? g.wait_done(kPollInterval) : g.wait_started(kPollInterval)))
    if (!client.alive()) {
      g.cancel();
      return false;
    }
  return true;
}

// What a streamed reply's content provider needs between calls.
struct StreamState {
  std::shared_ptr<Job> job;
  ResponseMeta meta;
  bool chat = true, include_usage = false, sent_role = false;
  // llama-server's /completion stream: its last event (the whole reply's fields, content "").
  std::function<json(const Generation::Result&)> native_final;
  int n_probs = 0;
  // Runs once when the generation ended well (the server's timing totals).
  std::function<void(const Generation::Result&)> on_finished;
  std::unique_ptr<ClientSocket> client;
  const Tokenizer* tokenizer = nullptr;             // to name the logprobs' tokens
  std::function<void()> on_close;                   // the server's open-stream count
  std::unique_ptr<OutputStreamParser> tool_parser;  // tool path: raw text -> deltas
  std::function<std::string()> new_call_id;
  // A reply framed as named events (/v1/messages, /v1/responses): the dialect's writers.
  struct EventReply {
    std::function<std::string(int64_t prompt_tokens, int64_t cached_tokens)> begin;
    std::function<std::string(const OutputDelta&, const json& text_logprobs)> delta;
    std::function<std::string(const std::string& tool_finish, int64_t prompt, int64_t completion,
                              int64_t cached, const std::string& stop_sequence)>
        end;
    std::function<std::string(const ApiError&)> error;
  };
  std::optional<EventReply> events;
  // /v1/responses with logprobs: which tokens are output_text, and the logprobs of those whose
  // text the parser still holds back.
  std::optional<ReplyTextTokens> reply_tokens;
  json pending_text_logprobs = json::array();
  ~StreamState() {
    if (on_close) on_close();
  }
};

// What the engine produced since the last look, waiting briefly for it.
struct StreamProgress {
  std::string piece;
  bool done = false;
  std::optional<ApiError> error;
  std::string finish, stop_sequence;
  int64_t prompt_tokens = 0, cached_tokens = 0, completion_tokens = 0;
  std::vector<TokenLogprob> logprobs;  // of the tokens since the last look
  std::vector<int32_t> tokens;         // generated since the last look
};

StreamProgress take_progress(Job& j) {
  Generation::Progress g = j.generation->take(kPollInterval);
  StreamProgress p;
  p.piece = std::move(g.text);
  p.logprobs = std::move(g.logprobs);
  p.tokens = std::move(g.tokens);
  p.done = g.done;
  if (g.error) p.error = api_error(*g.error);
  p.finish = std::move(g.finish_reason);
  p.stop_sequence = std::move(g.stop_string);
  p.prompt_tokens = g.prompt_tokens;
  p.cached_tokens = g.cached_tokens;
  p.completion_tokens = g.completion_tokens;
  return p;
}

// A step's ways on: write an event (an empty one writes nothing), end because the client went
// away (its generation cancelled), go on while the client is there, or end after an error event
// (a generation cut short sends no final marker, so no client takes the partial reply as whole).
bool write_text(httplib::DataSink& sink, const std::string& text) {
  return text.empty() || sink.write(text.data(), text.size());
}
bool write_event(httplib::DataSink& sink, const json& chunk) {
  return write_text(sink, sse_event(chunk));
}
bool client_gone(StreamState& st) {
  st.job->generation->cancel();
  return false;
}
bool go_on(StreamState& st) {
  return st.client->alive() || client_gone(st);
}
bool end_with_error(httplib::DataSink& sink, const std::string& error_event) {
  write_text(sink, error_event);
  sink.done();
  return true;
}

// The /v1/messages and /v1/responses streams: the same progress, framed as the dialect's named
// events. They take the tool path, whose parser splits reasoning, text and tool calls.
bool event_stream_step(StreamState& st, httplib::DataSink& sink) {
  Job& j = *st.job;
  auto write = [&](const std::string& events) { return write_text(sink, events); };
  if (!st.sent_role) {
    st.sent_role = true;
    const Generation::Result started = j.generation->result();
    if (!write(st.events->begin(started.prompt_tokens, started.cached_tokens)))
      return client_gone(st);
  }
  StreamProgress p = take_progress(j);
  if (!st.reply_tokens) p.logprobs.clear();
  if (st.reply_tokens)
    for (json& e : st.reply_tokens->take_logprobs(p.logprobs))
      st.pending_text_logprobs.push_back(std::move(e));
  OutputDelta d;
  if (st.tool_parser) {
    d = st.tool_parser->feed(p.piece);
    if (p.done && !p.error && p.finish != "cancelled") {
      OutputDelta rest = st.tool_parser->finish();
      d.content += rest.content;
      d.reasoning += rest.reasoning;
      d.tool_calls.insert(d.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
    }
  } else {
    d.content = std::move(p.piece);
  }
  json text_logprobs = json::array();
  if (!d.content.empty() || p.done) std::swap(text_logprobs, st.pending_text_logprobs);
  if (!write(st.events->delta(d, text_logprobs))) return client_gone(st);
  if (!p.done) return go_on(st);
  if (p.error || p.finish == "cancelled")
    return end_with_error(sink, st.events->error(p.error ? *p.error : shutting_down_error()));
  std::string fr = openai_finish_reason(p.finish);
  if (st.tool_parser) {
    const std::string& raw = st.tool_parser->text();
    fr = tool_finish_reason(parse_model_output(raw), raw, p.finish == "stop");
  }
  if (st.on_finished) st.on_finished(j.generation->result());
  if (!write(st.events->end(fr, p.prompt_tokens, p.completion_tokens, p.cached_tokens,
                            p.stop_sequence)))
    return client_gone(st);
  sink.done();
  return true;
}

// llama-server's /completion stream: {"content", "stop": false, ...} per piece, then the whole
// reply's fields with "stop": true; no [DONE].
bool native_stream_step(StreamState& st, httplib::DataSink& sink) {
  Job& j = *st.job;
  StreamProgress p = take_progress(j);
  if (!p.piece.empty() || !p.tokens.empty()) {
    json tokens = json::array();
    for (int32_t id : p.tokens) tokens.push_back(id);
    json chunk = {{"index", 0},
                  {"content", p.piece},
                  {"tokens", std::move(tokens)},
                  {"stop", false},
                  {"id_slot", -1},
                  {"tokens_predicted", p.completion_tokens},
                  {"tokens_evaluated", p.prompt_tokens}};
    if (st.n_probs > 0)
      chunk["completion_probabilities"] = completion_probabilities_json(*st.tokenizer, p.logprobs);
    if (!write_event(sink, chunk)) return client_gone(st);
  }
  if (!p.done) return go_on(st);
  if (p.error || p.finish == "cancelled")
    return end_with_error(sink, sse_event(error_json(p.error ? *p.error : shutting_down_error())));
  const Generation::Result result = j.generation->result();
  if (st.on_finished) st.on_finished(result);
  if (!write_event(sink, st.native_final(result))) return client_gone(st);
  sink.done();
  return true;
}

// One call of a streamed reply's content provider: waits briefly for new text and writes it,
// with no lock held, so a slow reader only ever stalls its own thread. False ends the stream.
bool stream_step(StreamState& st, httplib::DataSink& sink) {
  Job& j = *st.job;
  auto write = [&](const json& chunk) { return write_event(sink, chunk); };
  if (st.events) return event_stream_step(st, sink);
  if (st.native_final) return native_stream_step(st, sink);
  if (!st.sent_role) {
    st.sent_role = true;
    // OpenAI's first chunk carries the role; clients key the message off it.
    if (st.chat &&
        !write(chat_chunk_json(st.meta, {{"role", "assistant"}, {"content", ""}}, std::nullopt)))
      return client_gone(st);
  }
  StreamProgress p = take_progress(j);
  if (!st.chat) p.logprobs.clear();
  const std::string& piece = p.piece;
  // The tokens' logprobs ride on this step's first chunk, or on an empty one of their own.
  std::optional<json> logprobs;
  if (!p.logprobs.empty()) logprobs = logprobs_json(*st.tokenizer, p.logprobs);
  auto with_logprobs = [&](json chunk) {
    if (logprobs) {
      chunk["choices"][0]["logprobs"] = std::move(*logprobs);
      logprobs.reset();
    }
    return chunk;
  };
  const bool done = p.done;
  const std::optional<ApiError>& error = p.error;
  const std::string& finish = p.finish;
  if (st.tool_parser) {
    OutputDelta d = st.tool_parser->feed(piece);
    if (done && !error && finish != "cancelled") {
      OutputDelta rest = st.tool_parser->finish();
      d.content += rest.content;
      d.reasoning += rest.reasoning;
      if (d.tool_calls.empty()) d.first_call_index = rest.first_call_index;
      d.tool_calls.insert(d.tool_calls.end(), rest.tool_calls.begin(), rest.tool_calls.end());
    }
    for (const json& chunk : chat_delta_chunks(st.meta, d, st.new_call_id))
      if (!write(with_logprobs(chunk))) return client_gone(st);
  } else if (!piece.empty()) {
    const json chunk = st.chat ? chat_chunk_json(st.meta, {{"content", piece}}, std::nullopt)
                               : text_completion_chunk_json(st.meta, piece, std::nullopt);
    if (!write(with_logprobs(chunk))) return client_gone(st);
  }
  if (logprobs && !write(with_logprobs(chat_chunk_json(st.meta, {{"content", ""}}, std::nullopt))))
    return client_gone(st);
  if (!done) return go_on(st);
  // Cut short (shutdown, or a fault after the 200 went out): an error event, and no [DONE].
  if (error || finish == "cancelled")
    return end_with_error(sink, sse_event(error_json(error ? *error : shutting_down_error())));
  std::string fr = openai_finish_reason(finish);
  if (st.tool_parser) {
    const std::string& raw = st.tool_parser->text();
    fr = tool_finish_reason(parse_model_output(raw), raw, finish == "stop");
  }
  json last = st.chat ? chat_chunk_json(st.meta, json::object(), fr)
                      : text_completion_chunk_json(st.meta, "", fr);
  const Generation::Result result = j.generation->result();
  if (st.on_finished) st.on_finished(result);
  last["timings"] = timings_json(result, p.completion_tokens);  // as llama-server adds them
  if (!write(last)) return client_gone(st);
  if (st.include_usage) {
    json usage = usage_chunk_json(st.meta, st.chat ? "chat.completion.chunk" : "text_completion",
                                  p.prompt_tokens, p.completion_tokens);
    usage["usage"]["prompt_tokens_details"] = {{"cached_tokens", p.cached_tokens}};
    if (!write(usage)) return client_gone(st);
  }
  static constexpr std::string_view kDone = "data: [DONE]\n\n";
  if (!sink.write(kDone.data(), kDone.size())) return client_gone(st);
  sink.done();
  return true;
}

}  // namespace

// A request body as a job, not yet prepared; `common` receives the streaming fields. A Messages
// or Responses body becomes the equivalent chat body first and always takes the tool path (images
// included), so its reply can be split into thinking, text and tool_use blocks.
std::shared_ptr<Job> Server::Impl::parse_job(const json& body, Route route,
                                             GenerationRequest& common) {
  auto job = std::make_shared<Job>();
  job->chat = route != Route::kCompletion && route != Route::kNative;
  // The Messages and Responses dialects arrive as the equivalent chat body.
  std::optional<messages::Request> m;
  std::optional<responses::Request> rs;
  if (route == Route::kMessages) m = messages::to_chat_body(body);
  if (route == Route::kResponses) {
    rs = responses::to_chat_body(body);
    job->response_echo = rs->echo;
  }
  const bool dialect = m || rs;
  const json& chat_body = m ? m->chat_body : rs ? rs->chat_body : body;
  if (route == Route::kCompletion || route == Route::kNative) {
    json native;  // llama-server's names translated to the completions parser's
    if (route == Route::kNative) {
      native = body;
      if (const json* n = member(body, "n_predict")) {
        if (!n->is_number_integer()) wrong_type("n_predict", "an integer", *n);
        const int64_t v = n->get<int64_t>();
        if (v == 0 || v < -1)
          bad_request("n_predict", "invalid_value",
                      "'n_predict' must be -1 (the server's default) or at least 1");
        if (v > 0 && !member(body, "max_tokens")) native["max_tokens"] = v;
      }
      if (const json* n = member(body, "n_probs")) {
        if (!n->is_number_integer() || n->get<int64_t>() < 0 || n->get<int64_t>() > 20)
          bad_request("n_probs", "invalid_value", "'n_probs' must be an integer from 0 to 20");
        job->n_probs = n->get<int>();
      }
      if (const json* c = member(body, "cache_prompt"); c && !c->is_boolean())
        wrong_type("cache_prompt", "a boolean", *c);
      // Fields that would change what the reply says, not implemented: refused, never ignored.
      if (const json* p = member(body, "post_sampling_probs"); p && *p != false)
        bad_request("post_sampling_probs", "unsupported_value",
                    "'post_sampling_probs' is not supported: completion_probabilities give each "
                    "token's log-probability under the model's own distribution");
      if (const json* f = member(body, "response_fields");
          f && !f->is_null() && !(f->is_array() && f->empty()))
        bad_request("response_fields", "unsupported_value",
                    "'response_fields' is not supported: the reply holds every field");
      if (const json* t = member(body, "return_tokens")) {
        if (!t->is_boolean()) wrong_type("return_tokens", "a boolean", *t);
        job->return_tokens = t->get<bool>();
      }
    }
    CompletionRequest r = parse_completion_request(
        route == Route::kNative ? native : body,
        {assistant->model().config().text.vocab_size, engine->max_context()});
    job->prompt_text = std::move(r.prompt);
    job->prompt_ids = std::move(r.prompt_ids);
    common = std::move(r);
  } else if (dialect || wants_tool_path(body)) {
    job->tool_request = parse_tool_request(chat_body, opt.limits);
    common = parse_generation_fields(chat_body);
  } else {
    ChatRequest r = parse_chat_request(chat_body, opt.limits);
    job->messages = std::move(r.messages);
    common = std::move(r);
  }
  job->sampling = common.sampling;
  if (job->n_probs > 0) job->sampling.top_logprobs = job->n_probs;
  if (dialect) common.stream = m ? m->stream : rs->stream;
  return job;
}

void Server::Impl::handle_count_tokens(const httplib::Request& req, httplib::Response& res,
                                       Route route) {
  json body = parse_json_body(req.body);
  // Counting needs no max_tokens; give the Messages parser its required field.
  if (route == Route::kMessages && !body.contains("max_tokens")) body["max_tokens"] = 1;
  // Nothing is generated, so nothing streams.
  if (body.contains("stream")) body.erase("stream");
  GenerationRequest common;
  const std::shared_ptr<Job> job = parse_job(body, route, common);
  prepare(*job);
  json out = {{"input_tokens", job->prompt.ids.size()}};
  if (route == Route::kResponses)
    out = {{"object", "response.input_tokens"}, {"input_tokens", job->prompt.ids.size()}};
  res.set_content(wire_json(out), "application/json");
}

void Server::Impl::handle_generation(const httplib::Request& req, httplib::Response& res,
                                     Route route) {
  const bool chat = route != Route::kCompletion && route != Route::kNative;
  GenerationRequest common;  // the shared part of every request, sliced off
  const std::shared_ptr<Job> job = parse_job(parse_json_body(req.body), route, common);
  const bool stream = common.stream, include_usage = common.include_usage;
  if (common.n > 1) {
    if (route != Route::kChat && route != Route::kCompletion)
      bad_request("n", "unsupported_value",
                  "'n' above 1 is answered on /v1/chat/completions and /v1/completions");
    if (stream)
      bad_request("n", "unsupported_value",
                  "'n' above 1 is answered with stream: false; send n streamed requests instead");
    if (common.n > opt.parallel)
      bad_request("n", "invalid_value",
                  "'n' (" + std::to_string(common.n) + ") must be at most the server's slots (" +
                      std::to_string(opt.parallel) + ", --parallel)");
  }
  try {
    prepare(*job);
  } catch (...) {
    ++refused;
    throw;
  }
  auto client = std::make_unique<ClientSocket>(req);
  submit(*job);
  // Non-streamed chat and text completions, one choice or `n` (a streamed `n` is refused above).
  if (!stream && (route == Route::kChat || route == Route::kCompletion)) {
    answer_completions(req, res, route, *job, common.n, [&client] { return client->alive(); });
    return;
  }
  Generation& gen = *job->generation;
  // Until the prompt is known to fit, the status is still open: a context overflow is a 400
  // even for a streamed request.
  if (!wait_watching(gen, *client, false)) return;
  if (const Generation::Result r = gen.result(); r.error && !gen.started())
    throw api_error(*r.error);
  const char* id_prefix = route == Route::kMessages    ? "msg_"
                          : route == Route::kResponses ? "resp_"
                          : chat                       ? "chatcmpl-"
                                                       : "cmpl-";
  const ResponseMeta meta{new_id(id_prefix), model_name, static_cast<int64_t>(std::time(nullptr))};
  const std::string& prefix = job->prompt.generation_prefix;
  if (!stream) {
    if (!wait_watching(gen, *client, true)) return;
    const Generation::Result r = gen.result();
    if (r.error) throw api_error(*r.error);
    const GenerationResult& g = r.generation;
    if (g.finish_reason == "cancelled") throw shutting_down_error();
    record_finished(r);
    access_generation(req, r);
    if (route == Route::kNative) {
      res.set_content(wire_json(native_completion_json(*job, r, g.text, false)),
                      "application/json");
      return;
    }
    // Messages and Responses here; chat and completions went to answer_completions.
    const std::string fr = openai_finish_reason(g.finish_reason);
    const auto completion_tokens = static_cast<int64_t>(g.tokens.size());
    const std::string raw = prefix + g.text;
    ParsedOutput parsed;
    std::string finish = fr;
    if (job->tool_request) {
      parsed = parse_model_output(raw);
      finish = tool_finish_reason(parsed, raw, g.finish_reason == "stop");
    } else if (!g.text.empty()) {
      parsed.content = g.text;
    }
    const json out =
        route == Route::kMessages
            ? messages::message_json(
                  meta, parsed, messages::stop_reason(finish, g.stop_string), r.prompt_tokens,
                  completion_tokens, [this] { return new_id("toolu_"); }, g.stop_string,
                  r.cached_tokens)
            : responses::response_json(
                  meta, job->response_echo, parsed, finish, r.prompt_tokens, completion_tokens,
                  [this](const char* p) { return new_id(p); },
                  job->gen.top_logprobs >= 0
                      ? ReplyTextTokens(assistant->tokenizer(), prefix).take_logprobs(g.logprobs)
                      : json::array(),
                  r.cached_tokens);
    res.set_content(wire_json(out), "application/json");
    return;
  }

  auto st = std::make_shared<StreamState>();
  st->job = job;
  st->meta = meta;
  st->chat = chat;
  if (route == Route::kNative)
    st->native_final = [this, job](const Generation::Result& r) {
      return native_completion_json(*job, r, "", true);
    };
  st->n_probs = job->n_probs;
  // Runs inside the content provider, while the library still holds `req`.
  st->on_finished = [this, &req](const Generation::Result& r) {
    record_finished(r);
    access_generation(req, r);
  };
  st->include_usage = include_usage;
  st->tokenizer = &assistant->tokenizer();
  st->client = std::move(client);
  if (job->tool_request) {
    st->tool_parser = std::make_unique<OutputStreamParser>(prefix);
    st->new_call_id = [this] { return new_id("call_"); };
  }
  if (route == Route::kMessages) {
    auto es = std::make_shared<messages::EventStream>(meta, [this] { return new_id("toolu_"); });
    st->events = StreamState::EventReply{
        [es](int64_t prompt, int64_t cached) { return es->begin(prompt, cached); },
        [es](const OutputDelta& d, const json&) { return es->delta(d); },
        [es](const std::string& finish, int64_t, int64_t completion, int64_t,
             const std::string& stop_sequence) {
          return es->end(messages::stop_reason(finish, stop_sequence), completion, stop_sequence);
        },
        [](const ApiError& e) { return messages::EventStream::error(e); }};
  } else if (route == Route::kResponses) {
    auto es = std::make_shared<responses::EventStream>(
        meta, job->response_echo, [this](const char* id_kind) { return new_id(id_kind); });
    st->events = StreamState::EventReply{
        [es](int64_t, int64_t) { return es->begin(); },
        [es](const OutputDelta& d, const json& text_logprobs) {
          return es->delta(d, text_logprobs);
        },
        [es](const std::string& finish, int64_t prompt, int64_t completion, int64_t cached,
             const std::string&) { return es->end(finish, prompt, completion, cached); },
        [es](const ApiError& e) { return es->error(e); }};
    if (job->gen.top_logprobs >= 0) st->reply_tokens.emplace(assistant->tokenizer(), prefix);
  }
  {
    std::lock_guard<std::mutex> lk(streams_mu);
    ++open_streams;
  }
  st->on_close = [this] {
    {
      std::lock_guard<std::mutex> lk(streams_mu);
      --open_streams;
    }
    streams_cv.notify_all();
  };
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      // Called again and again until sink.done().
      [st](size_t, httplib::DataSink& sink) {
        try {
          return stream_step(*st, sink);
        } catch (const std::exception&) {  // out of memory building a chunk: end this stream
          st->job->generation->cancel();
          return false;
        }
      },
      // Released with the response; success is false when the library gave up on the stream
      // (write error, or the server stopping), so the generation must not run on.
      [st](bool success) {
        if (!success) st->job->generation->cancel();
      });
}

// A non-streamed chat or text completion with `n` choices (1 or more) of one prompt: the
// prepared job is the first, submitted; the others are the same prompt and options with the seed
// counted on, each on a slot of its own (the engine batches their steps, so the weights are read
// once for all of them; each slot prefills the prompt itself unless its caches already hold it).
// Choices keep their index; usage counts the prompt once and the tokens of every choice, as
// OpenAI's API does; llama-server's timings are the first choice's.
void Server::Impl::answer_completions(const httplib::Request& req, httplib::Response& res,
                                      Route route, const Job& job, int n,
                                      const std::function<bool()>& client_alive) {
  const bool chat = route == Route::kChat;
  const ResponseMeta meta{new_id(chat ? "chatcmpl-" : "cmpl-"), model_name,
                          static_cast<int64_t>(std::time(nullptr))};
  std::vector<std::shared_ptr<Generation>> gens{job.generation};
  // Whatever ends this reply early (an error, a vanished client) cancels every choice.
  struct CancelAll {
    std::vector<std::shared_ptr<Generation>>& gens;
    ~CancelAll() {
      for (auto& g : gens) g->cancel();
    }
  } cancel_all{gens};
  for (int i = 1; i < n; ++i) {
    Job choice;
    choice.prompt = job.prompt;
    choice.gen = job.gen;
    choice.gen.sampling.seed = job.gen.sampling.seed + static_cast<uint64_t>(i);
    choice.draft = job.draft;
    submit(choice);
    gens.push_back(choice.generation);
  }
  std::vector<Generation::Result> results;
  for (auto& g : gens) {
    while (!g->wait_done(kPollInterval))
      if (!client_alive()) return;  // every choice cancelled on the way out
    results.push_back(g->result());
    if (results.back().error) throw api_error(*results.back().error);
    if (results.back().generation.finish_reason == "cancelled") throw shutting_down_error();
  }
  const std::string& prefix = job.prompt.generation_prefix;
  json out, choices = json::array();
  int64_t completion_tokens = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const Generation::Result& r = results[i];
    record_finished(r);
    const GenerationResult& g = r.generation;
    const auto tokens = static_cast<int64_t>(g.tokens.size());
    completion_tokens += tokens;
    const std::string fr = openai_finish_reason(g.finish_reason);
    json one = job.tool_request ? chat_tool_completion_json(
                                      meta, prefix + g.text, g.finish_reason == "stop",
                                      r.prompt_tokens, tokens, [this] { return new_id("call_"); })
               : chat ? chat_completion_json(meta, g.text, fr, r.prompt_tokens, tokens)
                      : text_completion_json(meta, g.text, fr, r.prompt_tokens, tokens);
    if (i == 0) out = one;
    json c = std::move(one["choices"][0]);
    c["index"] = i;
    if (chat && job.gen.top_logprobs >= 0)
      c["logprobs"] = logprobs_json(assistant->tokenizer(), g.logprobs);
    choices.push_back(std::move(c));
  }
  const Generation::Result& first = results.front();
  access_generation(req, first, completion_tokens);
  out["choices"] = std::move(choices);
  out["usage"] = usage_json(first.prompt_tokens, completion_tokens);
  out["usage"]["prompt_tokens_details"] = {{"cached_tokens", first.cached_tokens}};
  out["timings"] = timings_json(first, static_cast<int64_t>(first.generation.tokens.size()));
  res.set_content(wire_json(out), "application/json");
}

httplib::Server::Handler Server::Impl::generation_handler(Route route) {
  return [this, route](const httplib::Request& req, httplib::Response& res) {
    answer(req, res, [&] {
      ensure_model_files_intact();
      if (req.path.ends_with("/count_tokens") || req.path.ends_with("/input_tokens"))
        handle_count_tokens(req, res, route);
      else
        handle_generation(req, res, route);
    });
  };
}

void Server::Impl::setup_routes() {
  using httplib::Request;
  using httplib::Response;
  using HR = httplib::Server::HandlerResponse;

  // Errors the library produces itself (unknown route, body too large, unparsable request) come
  // with an empty body; give them the OpenAI shape too. Our own error replies already have one.
  http.set_error_handler(
      httplib::Server::HandlerWithResponse([this](const Request& req, Response& res) {
        if (!res.body.empty()) return HR::Unhandled;
        std::string msg = "HTTP error " + std::to_string(res.status);
        std::string code;
        if (res.status == 404) {
          msg = "no such route: " + req.method + " " + req.path + " (this server has";
          for (size_t i = 0; i < route_methods.size(); ++i)
            msg += (i ? ", " : " ") + route_methods[i].second + " " + route_methods[i].first;
          msg += ")";
          code = "not_found";
        } else if (res.status == 413) {
          msg = "the request body is larger than this server's limit of " +
                std::to_string(opt.max_body) + " bytes (--max-body)";
          code = "request_too_large";
        } else if (res.status == 400) {
          msg = "malformed HTTP request";
        }
        set_error(req, res,
                  ApiError(res.status, msg,
                           res.status >= 500 ? "server_error" : "invalid_request_error", {}, code));
        return HR::Handled;
      }));
  http.set_exception_handler([](const Request& req, Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    set_error(req, res, ApiError(500, what, "server_error"));
  });
  // Every route and its methods: the 405 and OPTIONS replies, and the 404's list, read this.
  route_methods = {{"/", "GET"},
                   {"/health", "GET"},
                   {"/metrics", "GET"},
                   {"/v1/models", "GET"},
                   {"/v1/chat/completions", "POST"},
                   {"/v1/completions", "POST"},
                   {"/v1/responses", "POST"},
                   {"/v1/messages", "POST"},
                   {"/v1/messages/count_tokens", "POST"},
                   {"/v1/chat/completions/input_tokens", "POST"},
                   {"/v1/responses/input_tokens", "POST"},
                   {"/models", "GET"},
                   {"/chat/completions", "POST"},
                   {"/chat/completions/input_tokens", "POST"},
                   {"/responses", "POST"},
                   {"/completions", "POST"},
                   {"/completion", "POST"},
                   {"/tokenize", "POST"},
                   {"/detokenize", "POST"},
                   {"/apply-template", "POST"},
                   {"/props", "GET"},
                   {"/slots", "GET"}};
  if (opt.access_log_format != "off")
    http.set_logger([this](const Request& req, const Response& res) { access_log(req, res); });
  http.set_pre_routing_handler([this](const Request& req, Response& res) {
    access_begin(req);
    // CORS (--cors): an allowed Origin is echoed on every reply, and a preflight is answered
    // here, before the key check (browsers send preflights without credentials).
    const std::string origin = req.get_header_value("Origin");
    const bool cors = !origin.empty() && cors_allows(opt.cors_origins, origin);
    if (cors) {
      res.set_header("Access-Control-Allow-Origin", origin);
      res.set_header("Vary", "Origin");
    }
    if (req.method == "OPTIONS") {
      const auto route = std::find_if(route_methods.begin(), route_methods.end(),
                                      [&](const auto& r) { return r.first == req.path; });
      if (route == route_methods.end()) return HR::Unhandled;  // a 404
      const std::string allow = route->second + ", OPTIONS";
      res.status = 204;
      res.set_header("Allow", allow);
      if (cors) {
        res.set_header("Access-Control-Allow-Methods", allow);
        const std::string asked = req.get_header_value("Access-Control-Request-Headers");
        res.set_header("Access-Control-Allow-Headers",
                       asked.empty() ? "Authorization, Content-Type, x-api-key" : asked);
        res.set_header("Access-Control-Max-Age", "86400");
      }
      return HR::Handled;
    }
    if (!is_api_path(req.path)) return HR::Unhandled;
    if (!opt.api_key.empty()) {
      // OpenAI clients send the key as a bearer token, Anthropic clients as x-api-key.
      const std::string auth = req.get_header_value("Authorization");
      static constexpr std::string_view kBearer = "Bearer ";
      std::string key = req.get_header_value("x-api-key");
      if (key.empty() && auth.rfind(kBearer, 0) == 0) key = auth.substr(kBearer.size());
      if (key.empty()) {
        res.set_header("WWW-Authenticate", "Bearer");
        set_error(req, res,
                  ApiError(401,
                           "this server requires an API key: send it as 'Authorization: Bearer "
                           "<key>' or as an 'x-api-key' header",
                           "invalid_request_error", {}, "missing_api_key"));
        return HR::Handled;
      }
      if (!same_key(key, opt.api_key)) {
        res.set_header("WWW-Authenticate", "Bearer");
        set_error(req, res,
                  ApiError(401, "incorrect API key provided", "invalid_request_error", {},
                           "invalid_api_key"));
        return HR::Handled;
      }
    }
    if (draining.load()) {
      res.set_header("Connection", "close");
      set_error(req, res, shutting_down_error());
      return HR::Handled;
    }
    if (!ready.load()) {
      res.set_header("Retry-After", "1");
      set_error(req, res,
                ApiError(503, "the model is still loading; retry when GET /health says ok",
                         "server_error", {}, "model_loading"));
      return HR::Handled;
    }
    return HR::Unhandled;
  });

  http.Post("/v1/chat/completions", generation_handler(Route::kChat));
  http.Post("/v1/completions", generation_handler(Route::kCompletion));
  http.Post("/v1/messages", generation_handler(Route::kMessages));
  http.Post("/v1/messages/count_tokens", generation_handler(Route::kMessages));
  http.Post("/v1/chat/completions/input_tokens", generation_handler(Route::kChat));
  http.Post("/v1/responses", generation_handler(Route::kResponses));
  http.Post("/v1/responses/input_tokens", generation_handler(Route::kResponses));
  http.Get("/v1/models", [this](const Request&, Response& res) {
    res.set_content(models_reply(), "application/json");
  });
  http.Get("/health", [this](const Request&, Response& res) {
    json j;
    if (draining.load()) {
      res.status = 503;
      j = {{"status", "shutting_down"}};
    } else if (!ready.load()) {
      res.status = 503;
      j = {{"status", "loading"}};
    } else if (const std::string changed = model_files_changed(); !changed.empty()) {
      res.status = 503;
      j = {{"status", "model_file_changed"}, {"error", changed}};
    } else if (const std::string down = stage_failure(); !down.empty()) {
      res.status = 503;
      j = {{"status", "stage_failed"}, {"error", down}};
    } else {
      const Engine::Stats st = engine->stats();
      json states = json::array();
      for (const Engine::SlotInfo& s : st.slot_info)
        states.push_back(
            {{"id", s.id}, {"state", Engine::slot_state_name(s.state)}, {"rows", s.rows}});
      j = {{"status", "ok"},
           {"slots", st.slots},
           {"slots_busy", st.busy},
           {"queued", st.queued},
           {"kv_budget", st.kv_budget},
           {"kv_rows_reserved", st.kv_rows_reserved},
           {"pipeline_depth", engine->pipeline_depth()},
           {"slot_states", std::move(states)}};
      if (engine->drafting())
        j["speculative"] = {{"draft_model", drafter_name},  {"draft_max", opt.draft_max},
                            {"draft_min", opt.draft_min},   {"draft_adapt", opt.draft_adapt},
                            {"rounds", st.draft_rounds},    {"drafted", st.drafted},
                            {"accepted", st.draft_accepted}};
    }
    res.set_content(wire_json(j), "application/json");
  });
  http.Get("/metrics", [this](const Request&, Response& res) {
    if (!ready.load()) {
      res.status = 503;
      res.set_content("# the model is still loading\n", "text/plain; version=0.0.4");
      return;
    }
    res.set_content(metrics_text() + llama_metrics_text(), "text/plain; version=0.0.4");
  });
  http.Get("/", [](const Request&, Response& res) {
    res.set_content(std::string(chat_page_html()), "text/html; charset=utf-8");
  });

  // The wrong method on a known route is a 405 naming the right one, not a confusing 404.
  auto not_allowed = [](const char* allow) {
    return [allow](const Request& req, Response& res) {
      res.set_header("Allow", allow);
      set_error(req, res,
                ApiError(405, req.method + " is not allowed on " + req.path + "; use " + allow,
                         "invalid_request_error", {}, "method_not_allowed"));
    };
  };
  setup_llama_routes();
  for (const auto& [path, allow_str] : route_methods) {
    const char* allow = allow_str.c_str();  // route_methods lives as long as the server
    if (allow_str != "GET") http.Get(path, not_allowed(allow));
    if (allow_str != "POST") http.Post(path, not_allowed(allow));
    http.Put(path, not_allowed(allow));
    http.Patch(path, not_allowed(allow));
    http.Delete(path, not_allowed(allow));
  }
}

// The library's threads wait up to their keep-alive timeout (5 s) on an idle connection before
// they notice the server stopped, and it offers no way to end that wait. Shutting down the read
// side of every connection accepted on our port ends it at once: the waiting read sees EOF and
// the thread closes the socket, while anything still being written goes out unharmed. Runs after
// the listener closed and every reply was handed over, so nothing we still want to read is lost.
void Server::Impl::end_idle_connections() {
  for_each_socket_fd([&](int fd) {
    sockaddr_storage ss{};
    socklen_t len = sizeof(ss);
    std::string host;
    int local_port = -1;
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0 ||
        !numeric_address(ss, len, host, local_port) || local_port != port)
      return true;
    len = sizeof(ss);
    // Connected sockets only: the listening socket has no peer.
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0) ::shutdown(fd, SHUT_RD);
    return true;
  });
}

void Server::Impl::shutdown() {
  draining.store(true);
  if (loader.joinable()) loader.join();
  if (engine) {
    // Queued requests fail at once; running generations may finish within the grace period,
    // then they are cut short.
    engine->close_queue();
    const auto grace = std::chrono::duration_cast<std::chrono::milliseconds>(
        std::chrono::duration<double>(std::max(0.0, opt.shutdown_grace_seconds)));
    if (!engine->wait_idle(grace)) {
      engine->cancel_running();
      while (!engine->wait_idle(std::chrono::seconds(1))) {
      }
    }
  }
  {
    // Let the HTTP threads write out the ends of their streams. A client that stopped reading
    // holds this up for at most the library's write timeout, after which its write fails.
    std::unique_lock<std::mutex> lk(streams_mu);
    streams_cv.wait_for(lk, std::chrono::seconds(10), [&] { return open_streams == 0; });
  }
  http.stop();
  end_idle_connections();
  if (listener.joinable()) listener.join();
  if (engine) engine->stop();
  if (engine_thread.joinable()) engine_thread.join();
}

// ------------------------------------------------------------------------------------------

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->opt.parallel < 1) fail("--parallel must be at least 1");
  if (impl_->opt.max_body == 0) fail("--max-body must be at least 1 byte");
  const std::string& log_format = impl_->opt.access_log_format;
  if (log_format != "text" && log_format != "json" && log_format != "off")
    fail("--log-format must be text or json (or off), not '", log_format, "'");
  impl_->open_access_log();
}

Server::~Server() {
  shutdown();
}

void Server::start() {
  Impl& m = *impl_;
  check_cors_origins(m.opt.cors_origins);
  const int http_threads =
      m.opt.http_threads > 0 ? m.opt.http_threads : std::max(64, 4 * m.opt.parallel + 16);
  // Each connection holds one library thread while it is open (a waiting or streaming client
  // included), so there are many more of them than slots; they sleep while they wait.
  m.http.new_task_queue = [http_threads] { return new httplib::ThreadPool(http_threads); };
  m.http.set_payload_max_length(m.opt.max_body);
  if (m.opt.io_timeout_seconds > 0) {
    m.http.set_read_timeout(m.opt.io_timeout_seconds, 0);
    m.http.set_write_timeout(m.opt.io_timeout_seconds, 0);
  }
  m.http.set_tcp_nodelay(true);  // stream chunks are small; send each at once
  m.setup_routes();
  // The library's default socket options set SO_REUSEPORT, which lets a second server bind the
  // same port and silently take half of its connections. SO_REUSEADDR alone still allows a quick
  // restart over connections in TIME_WAIT. The callback also hands us the listening socket.
  m.http.set_socket_options([&m](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
    if (m.listen_fd < 0) m.listen_fd = sock;
  });
  if (m.opt.port == 0) {
    m.port = m.http.bind_to_any_port(m.opt.host);
  } else {
    m.port = m.http.bind_to_port(m.opt.host, m.opt.port) ? m.opt.port : -1;
  }
  if (m.port < 0)
    fail("cannot listen on ", m.opt.host, ":", m.opt.port,
         " (address in use, not an address of this machine, or a privileged port)");
  // The library listens with a compiled-in backlog of 5: a burst of clients connecting at once
  // overflows it and the kernel drops SYNs, which costs each unlucky client a 1 s retransmit.
  // Listening again on the bound socket raises the backlog (Linux updates it in place).
  if (m.listen_fd >= 0) ::listen(m.listen_fd, SOMAXCONN);
  m.listener = std::thread([&m] {
    m.http.listen_after_bind();
    m.listener_done.store(true);
  });
  // The library's stop() does nothing until its accept loop has started, so a shutdown() right
  // after start() would be lost and leave the listener running; start() returns once it runs.
  while (!m.http.is_running() && !m.listener_done.load())
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  m.loader = std::thread([&m] { m.load(); });
}

int Server::port() const {
  return impl_->port;
}

bool Server::wait_loaded() {
  std::unique_lock<std::mutex> lk(impl_->load_mu);
  impl_->load_cv.wait(lk, [&] { return impl_->load_finished; });
  return impl_->load_error.empty();
}

Server::LoadState Server::load_state() const {
  std::lock_guard<std::mutex> lk(impl_->load_mu);
  if (!impl_->load_finished) return LoadState::kLoading;
  return impl_->load_error.empty() ? LoadState::kReady : LoadState::kFailed;
}

std::string Server::load_error() const {
  std::lock_guard<std::mutex> lk(impl_->load_mu);
  return impl_->load_error;
}

void Server::shutdown() {
  std::call_once(impl_->shutdown_once, [this] { impl_->shutdown(); });
}

Server::Stats Server::stats() const {
  // The loader makes the engine before it sets `ready`; before that there is nothing to count.
  if (!impl_->ready.load()) return Stats{};
  const Engine::Stats e = impl_->engine->stats();
  Stats st{e.slots, e.busy, e.queued, e.completed, e.cancelled};
  st.draft_rounds = e.draft_rounds;
  st.drafted = e.drafted;
  st.draft_accepted = e.draft_accepted;
  st.kv_budget = e.kv_budget;
  st.max_context = e.max_context;
  st.kv_rows_used = e.kv_rows_used;
  st.kv_rows_reserved = e.kv_rows_reserved;
  return st;
}

}  // namespace gemstage::server
