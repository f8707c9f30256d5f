#include "server/server.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
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

#include "gemma4/multimodal.h"
#include "io/mapped_file.h"
#include "runtime/speculative.h"
#include "server/chat_page.h"
#include "server/messages_api.h"
#include "server/responses_api.h"
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
  DIR* dir = opendir("/proc/self/fd");
  if (!dir) return;
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0') continue;
    struct stat st;
    if (fstat(static_cast<int>(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    if (!fn(static_cast<int>(fd))) break;
  }
  closedir(dir);
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
  bool alive() const {
    if (fd_ < 0) return true;
    pollfd p{fd_, POLLRDHUP, 0};
    if (poll(&p, 1, 0) < 0) return true;
    return (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) == 0;
  }

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

enum class CancelReason : int { kNone = 0, kClientGone, kShutdown };

// Which API a generation request came in through; it decides the reply's shape.
enum class Route { kChat, kCompletion, kMessages, kResponses };

// One request on its way through the queue and a slot. The engine fills in the progress fields
// under `mu`; the request's HTTP thread drains them. Neither holds `mu` while doing real work.
struct Job {
  bool chat = true;
  std::vector<ChatInput> messages;          // chat
  std::optional<ToolRequest> tool_request;  // chat with tools / tool history (api.h)
  std::string generation_prefix;            // tool path: what the prompt's model turn began with
  nlohmann::json response_echo;             // /v1/responses: request fields the reply repeats
  std::string prompt_text;                  // completion
  std::optional<std::vector<int32_t>> prompt_ids;  // completion sent as token ids
  SamplingOverrides sampling;

  std::atomic<bool> cancel{false};
  std::atomic<int> cancel_reason{static_cast<int>(CancelReason::kNone)};
  void request_cancel(CancelReason r) {
    int none = static_cast<int>(CancelReason::kNone);
    cancel_reason.compare_exchange_strong(none, static_cast<int>(r));
    cancel.store(true);
  }
  CancelReason reason() const { return static_cast<CancelReason>(cancel_reason.load()); }

  std::mutex mu;
  std::condition_variable cv;
  bool started = false;  // the prompt is prepared and fits: the reply is a 200 from here on
  bool done = false;
  std::optional<ApiError> error;
  std::string pending;                 // generated text the HTTP thread has not taken yet
  std::vector<TokenLogprob> logprobs;  // every generated token's, when the request asked
  std::string text;                    // the whole reply, once done
  int64_t prompt_tokens = 0, completion_tokens = 0;
  std::string finish_reason;
  std::string stop_sequence;  // the stop string that ended the reply, if one did

  // Rendered before the request queues (Impl::prepare).
  PreparedPrompt prompt;
  GenerationOptions gen;
  int64_t capacity = 0;  // KV rows it may need: prompt + max_tokens, at most a sequence's context
  // Speculative decoding for this request (Impl::prepare): drafts per round at most (0: plain
  // decoding) and at least.
  int draft_max = 0, draft_min = 0;
};

// What a slot is doing, as /health reports it.
enum class SlotState { kIdle, kPrefill, kDecode };

const char* slot_state_name(SlotState s) {
  switch (s) {
    case SlotState::kPrefill:
      return "prefill";
    case SlotState::kDecode:
      return "decode";
    default:
      return "idle";
  }
}

// A slot is one conversation at a time on the shared model: its own sequence (KV caches). All
// slots step together in the engine's batched calls. Only the engine thread touches a slot's
// sequence and generation state; `job` changes under Impl::q_mu, and `state`, `rows` and
// `reserved` are copies kept under Impl::q_mu for /health, /metrics and the KV budget.
struct Slot {
  int id = 0;
  std::unique_ptr<Sequence> sequence;
  std::shared_ptr<Job> job;  // the running request; null when idle
  std::vector<int32_t> prompt;
  FloatTensor soft;      // soft tokens of the prompt rows not yet in the caches, in order
  int64_t soft_at = 0;   // of those, how many earlier steps consumed
  int64_t capacity = 0;  // rows this request may hold (its share of the KV budget)
  std::unique_ptr<TokenStream> stream;
  std::optional<int32_t> next_id;  // decoding: the id the next step feeds
  uint64_t admitted = 0;           // admission order: prompts are prefilled oldest first
  uint64_t last_used = 0;          // when it last ran, to evict the stalest held prefix first
  SlotState state = SlotState::kIdle;
  int64_t rows = 0;        // KV rows the sequence holds
  int64_t reserved = 0;    // budget rows counted for it: capacity while running, rows when idle
  bool in_flight = false;  // in a call the pipeline has not finished (engine thread only)
  // Speculative decoding (engine thread only): the request's draft control, the target's
  // post-final-norm hidden of the row before next_id (the drafter's h; empty when not known),
  // and this step's verify rows [next_id, d_1..d_k] (empty: a plain decode row).
  std::optional<DraftControl> draft;
  std::vector<float> draft_h;
  std::vector<int32_t> verify_ids;
};

// The Messages routes answer in Anthropic's error shape, every other route in OpenAI's.
bool is_messages_route(const std::string& path) {
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

// Constant-time comparison, so response timing does not leak how much of a guessed key matched.
bool same_key(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size(); ++i)
    diff |= static_cast<unsigned char>(a[i] ^ (i < b.size() ? b[i] : 0));
  return diff == 0;
}

}  // namespace

struct Server::Impl {
  explicit Impl(ServerOptions o) : opt(std::move(o)), seed_rng(std::random_device{}()) {}

  ServerOptions opt;
  httplib::Server http;
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
  int64_t max_context = 0;  // one sequence's context: the budget, or the model's maximum if less
  int64_t kv_budget = 0;    // KV rows all sequences hold together (-c)
  int batch_rows = 0, ubatch_rows = 0;  // rows per step (-b) and per batched call (-ub)
  std::vector<int> placeholders;        // the model's image/audio/video placeholder ids
  int64_t created = 0;                  // when the model was loaded, for /v1/models
  GenerationOptions defaults;

  std::unique_ptr<Assistant> assistant;     // the model and tokenizer every slot shares
  std::unique_ptr<AssistantModel> drafter;  // -md: the MTP drafter every drafting slot runs
  AssistantDonors draft_donors;             // the target layers whose K/V the drafter reads
  std::string drafter_name;                 // -md DIR, or the bundle and its drafter stage
  std::atomic<int64_t> draft_rounds_total{0}, drafted_total{0}, draft_accepted_total{0};
  std::unique_ptr<ThreadPool> pool;  // all compute threads, the engine's alone
  // Renders chat prompts (the vision tower for their images) beside the engine.
  std::mutex prepare_mu;
  std::unique_ptr<ThreadPool> prepare_pool;
  std::vector<std::unique_ptr<Slot>> slots;
  // The engine's calls in flight. With stages on other processes (MPI ranks) several are, each
  // over its own slots, so every process computes at once (stage/call_pipeline.h).
  struct CallInFlight {
    std::vector<Slot*> owners;
    std::vector<int64_t> soft_rows;  // soft tokens each entry consumed
    int64_t rows = 0;
    // With a drafter: the post-final-norm hidden of every head row (the drafter's h), each
    // entry's rows in turn (all of a verify's rows, the last row of any other entry).
    std::unique_ptr<TapRecorder> hidden;
  };
  int pipeline_depth = 1;
  std::unique_ptr<CallPipeline> pipeline;
  std::map<uint64_t, CallInFlight> calls_in_flight;
  std::thread engine_thread;
  mutable std::mutex q_mu;
  std::condition_variable q_cv, idle_cv;
  std::deque<std::shared_ptr<Job>> queue;  // FIFO: the engine admits from the front only
  bool queue_changed = false;
  int busy = 0;  // slots running a request
  bool engine_stop = false;
  uint64_t steps = 0, admissions = 0;  // engine thread only
  std::atomic<int64_t> completed{0}, cancelled{0}, failed{0}, refused{0};
  std::atomic<int64_t> prompt_tokens_total{0}, reused_tokens_total{0}, generated_tokens_total{0};
  // Step latency as a Prometheus histogram (upper bounds in seconds), under q_mu.
  static constexpr std::array<double, 10> kStepBuckets = {0.005, 0.01, 0.025, 0.05, 0.1,
                                                          0.25,  0.5,  1,     2.5,  10};
  std::array<int64_t, kStepBuckets.size() + 1> step_counts{};
  double step_seconds_sum = 0;
  int64_t step_rows_total = 0;

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
  void load();
  void open_drafter();
  void engine();
  void prepare(Job& job);
  void admit();
  void start_job(Slot& s, const std::shared_ptr<Job>& job);
  bool draft(Slot& s);
  void step();
  int64_t finish_call();
  void drop_calls_in_flight();
  void end_job(Slot& s, const std::string& reason, const std::optional<ApiError>& error = {});
  std::string metrics_text();
  void submit(const std::shared_ptr<Job>& job);
  void handle_generation(const httplib::Request& req, httplib::Response& res, Route route);
  void handle_count_tokens(const httplib::Request& req, httplib::Response& res);
  std::shared_ptr<Job> parse_job(const nlohmann::json& body, Route route,
                                 GenerationRequest& common);
  void shutdown();
  void end_idle_connections();
};

// ------------------------------------------------------------------------------------------
// Loading and the engine.

void Server::Impl::load() {
  try {
    if (opt.before_load) opt.before_load();
    const int total = opt.threads > 0 ? opt.threads : default_thread_count();
    // -c is the KV budget of all sequences together, and also bounds a single one.
    assistant = Assistant::open(opt.model_path, opt.ctx, opt.kv_type);
    const Assistant& a = *assistant;
    kv_budget = opt.ctx > 0 ? opt.ctx : a.max_context();
    max_context = std::min(kv_budget, a.max_context());
    batch_rows = std::max(1, opt.batch);
    ubatch_rows = std::max(1, std::min(opt.ubatch, batch_rows));
    placeholders = a.model().config().placeholder_token_ids();
    pool = std::make_unique<ThreadPool>(total);
    pipeline = std::make_unique<CallPipeline>(*pool);
    pipeline_depth = CallPipeline::depth(a.model());
    prepare_pool = std::make_unique<ThreadPool>(std::max(1, total / 2));
    for (int i = 0; i < opt.parallel; ++i) {
      auto s = std::make_unique<Slot>();
      s->id = i;
      s->sequence = assistant->new_sequence();
      slots.push_back(std::move(s));
    }
    open_drafter();
    model_name = a.model_name();
    created = static_cast<int64_t>(std::time(nullptr));
    defaults = opt.defaults;
    defaults.stop_ids = opt.ignore_eos ? std::vector<int32_t>{} : a.stop_ids();
    defaults.sampling.suppress_tokens = a.suppress_tokens();
    defaults.cancel = nullptr;
    engine_thread = std::thread([this] { engine(); });
    ready.store(true);
  } catch (const std::exception& e) {
    slots.clear();
    std::lock_guard<std::mutex> lk(load_mu);
    load_error = e.what();
  }
  {
    std::lock_guard<std::mutex> lk(load_mu);
    load_finished = true;
  }
  load_cv.notify_all();
}

// -md: the drafter, checked against the target. It reads the target's donor caches through each
// slot's own sequence, so those layers must run in this process.
void Server::Impl::open_drafter() {
  if (opt.draft_max < 0 || opt.draft_max > kMaxDraftsPerRound || opt.draft_min < 0)
    fail("--draft-max must be 0-", kMaxDraftsPerRound, " and --draft-min at least 0");
  // -md DIR, else a bundle's drafter stage (export -md) unless turned off.
  const bool from_bundle = opt.model_draft.empty();
  std::unique_ptr<AssistantModel> d;
  if (!from_bundle) {
    d = gemstage::open_drafter(opt.model_draft);
    drafter_name = opt.model_draft;
  } else if (opt.bundle_drafter && is_bundle_dir(opt.model_path)) {
    const BundleManifest m = read_bundle_manifest(opt.model_path);
    d = open_bundle_drafter(opt.model_path, m);
    if (d) drafter_name = opt.model_path + " (stage " + m.drafter->id + ")";
  }
  if (!d) return;
  const Model& target = assistant->model();
  check_assistant_matches(d->config(), target.config(), drafter_name, opt.model_path);
  draft_donors = assistant_donor_layers(target.config().text);
  // What each round's draft_context needs: the embedding table and the donor caches here.
  std::string missing;
  try {
    (void)draft_context(*slots.front()->sequence, draft_donors, 0);
  } catch (const Error& e) {
    missing = e.what();
  }
  if (!missing.empty()) {
    if (!from_bundle)
      fail("-md ", opt.model_draft, ": ", missing,
           "; serve without -md, or keep the last transformer stage in the server's process");
    std::cerr << "serve: decoding without the bundle's drafter stage: " << missing << "\n";
    return;
  }
  drafter = std::move(d);
}

namespace {
void fail_job(Job& job, const ApiError& e) {
  {
    std::lock_guard<std::mutex> lk(job.mu);
    job.error = e;
    job.done = true;
  }
  job.cv.notify_all();
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

// One thread runs the model for every request: each step it takes new requests off the queue
// while slots and the KV budget allow, then runs one batched step over all running ones.
void Server::Impl::engine() {
  std::vector<std::shared_ptr<Job>> waiting;
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(q_mu);
      if (busy == 0) {
        // Idle: wake for a new request, or now and then to drop queued ones whose client left.
        q_cv.wait_for(lk, kPollInterval, [&] { return engine_stop || queue_changed; });
        if (engine_stop) return;
      }
      queue_changed = false;
      waiting.assign(queue.begin(), queue.end());
    }
    std::vector<const Job*> dropped;
    for (const auto& job : waiting) {
      if (job->cancel.load()) {
        // Its client left while it queued: nobody is waiting for the answer.
        ++cancelled;
        fail_job(*job, ApiError(499, "the client went away", "invalid_request_error"));
        dropped.push_back(job.get());
      }
    }
    waiting.clear();
    {
      std::lock_guard<std::mutex> lk(q_mu);
      std::erase_if(queue, [&](const std::shared_ptr<Job>& j) {
        return std::find(dropped.begin(), dropped.end(), j.get()) != dropped.end();
      });
      admit();
      if (busy == 0) continue;
    }
    if (opt.before_step) opt.before_step();
    try {
      step();
    } catch (const std::exception& e) {
      // Not expected (a failed batched call already ends only its own requests); ending every
      // running request keeps the engine serving the next ones.
      drop_calls_in_flight();
      for (auto& s : slots)
        if (s->job) end_job(*s, "", ApiError(500, e.what(), "server_error"));
    }
  }
}

// The prompt as ids (and soft tokens), on the request's own HTTP thread, so neither a long
// prompt's tokenization nor its images' vision tower pauses the engine's running streams; a prompt
// that can never fit is refused here, at once, before it queues.
void Server::Impl::prepare(Job& job) {
  ensure_model_files_intact();
  if (job.tool_request) {
    // The tool path renders with the checkpoint's own chat template (or the built-in renderer)
    // and keeps special tokens in the text, which the output parser reads.
    ConversationOptions conv;
    conv.enable_thinking = job.tool_request->enable_thinking.value_or(opt.think);
    const ToolRequest& t = *job.tool_request;
    if (t.media.empty()) {
      job.prompt = assistant->prepare_conversation(t.messages, t.tools, conv);
    } else {  // the towers run on the preparation pool, one conversation at a time
      std::lock_guard<std::mutex> lk(prepare_mu);
      job.prompt =
          assistant->prepare_conversation(t.messages, t.tools, conv, t.media, prepare_pool.get());
    }
    std::lock_guard<std::mutex> lk(job.mu);
    job.generation_prefix = job.prompt.generation_prefix;
  } else if (job.chat) {
    // One conversation at a time on the preparation pool (a pool runs one job at a time).
    std::lock_guard<std::mutex> lk(prepare_mu);
    job.prompt = assistant->prepare_chat(*prepare_pool, job.messages, {true, opt.think});
  } else if (job.prompt_ids) {
    job.prompt.ids = std::move(*job.prompt_ids);  // as sent: no <bos>, no tokenization
  } else {
    job.prompt = assistant->prepare_raw(job.prompt_text);
  }
  const auto n = static_cast<int64_t>(job.prompt.ids.size());
  if (n >= max_context)
    throw ApiError(400,
                   "the prompt is " + std::to_string(n) + " tokens but the context holds " +
                       std::to_string(max_context) +
                       " (including room for at least one generated token); shorten the "
                       "conversation or start the server with a larger -c / --ctx-size",
                   "invalid_request_error", job.chat ? "messages" : "prompt",
                   "context_length_exceeded");
  // Each placeholder row takes an image's or clip's soft token. One the prompt brings by itself
  // (the text "<|image|>", or its id in a token-id prompt) has none to take: the engine step that
  // reached it would fail and end every running request.
  const int64_t soft_rows = job.prompt.soft_tokens.numel() > 0 ? job.prompt.soft_tokens.dim(0) : 0;
  const ModelConfig& config = assistant->model().config();
  if (count_placeholders(config, job.prompt.ids) != soft_rows) {
    const std::vector<int> ph = config.placeholder_token_ids();
    const auto it =
        std::find_first_of(job.prompt.ids.begin(), job.prompt.ids.end(), ph.begin(), ph.end());
    const auto at = it - job.prompt.ids.begin();
    throw ApiError(400,
                   job.chat
                       ? "the conversation holds an image / audio placeholder token in its "
                         "text, with no image or audio to fill it"
                       : "the prompt's token " + std::to_string(at) + " is " + std::to_string(*it) +
                             ", an image / audio placeholder, with no image or audio to "
                             "fill it; send images and audio to /v1/chat/completions",
                   "invalid_request_error", job.chat ? "messages" : "prompt", "invalid_value");
  }
  job.gen = apply_overrides(defaults, job.sampling, opt.seed.value_or(random_u64()));
  job.gen.cancel = &job.cancel;
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
  job.capacity = std::min(max_context, n + std::max(0, job.gen.max_tokens));
  // Speculative decoding: the request's speculative.n_max / n_min, else the server's.
  const SamplingOverrides& so = job.sampling;
  if (!drafter) {
    if (so.draft_max.value_or(0) > 0)
      throw ApiError(400,
                     "'speculative.n_max' asks for drafting, but the server was started without "
                     "a drafter (-md DIR)",
                     "invalid_request_error", "speculative.n_max", "invalid_value");
    return;
  }
  job.draft_max = so.draft_max.value_or(opt.draft_max);
  job.draft_min = so.draft_min.value_or(std::min(opt.draft_min, job.draft_max));
  if (job.draft_max > 0 && job.draft_min > job.draft_max)
    throw ApiError(400,
                   "'speculative.n_min' (" + std::to_string(job.draft_min) +
                       ") must not exceed the drafts per round at most (" +
                       std::to_string(job.draft_max) + ")",
                   "invalid_request_error", "speculative.n_min", "invalid_value");
  // Constrained output decodes plainly (drafts are not constrained). Prompts with images or
  // audio draft like text ones: the prompt's rows are prefilled as usual, and the drafter reads
  // them through the target's caches.
  if (job.gen.json_grammar || job.gen.tool_call_grammar) job.draft_max = 0;
}

// Under q_mu. Oldest first and nobody overtakes: the front request waits until a slot is free
// and its rows fit the budget, evicting the prefixes idle slots hold (oldest first) if needed.
void Server::Impl::admit() {
  while (!queue.empty() && !draining.load()) {
    const std::shared_ptr<Job> job = queue.front();
    // The idle slot whose caches save the most prefill: the longest prefix of this prompt, counted
    // only where it saves at least as many rows as reusing the slot throws away (so an unrelated
    // prompt that shares just <bos> leaves a conversation's caches alone); then the slot holding
    // the fewest rows, then the stalest.
    Slot* best = nullptr;
    size_t best_gain = 0;
    for (auto& s : slots) {
      if (s->job) continue;
      const size_t held = s->sequence->tokens().size();
      const size_t common = common_prefix(s->sequence->tokens(), job->prompt.ids, placeholders);
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
    for (auto& s : slots)
      if (s.get() != best) {
        others += s->reserved;
        if (!s->job) evictable += s->reserved;
      }
    if (others + job->capacity > kv_budget) {
      if (others - evictable + job->capacity > kv_budget) return;  // waits for running ones
      std::vector<Slot*> idle;
      for (auto& s : slots)
        if (s.get() != best && !s->job && s->reserved > 0) idle.push_back(s.get());
      std::sort(idle.begin(), idle.end(),
                [](const Slot* x, const Slot* y) { return x->last_used < y->last_used; });
      for (Slot* s : idle) {
        if (others + job->capacity <= kv_budget) break;
        s->sequence->reset();
        others -= s->reserved;
        s->rows = s->reserved = 0;
      }
    }
    queue.pop_front();
    start_job(*best, job);
  }
}

// Under q_mu: the request takes the slot, reusing the prefix its caches hold.
void Server::Impl::start_job(Slot& s, const std::shared_ptr<Job>& job) {
  Sequence& seq = *s.sequence;
  const std::vector<int32_t>& ids = job->prompt.ids;
  size_t common = common_prefix(seq.tokens(), ids, placeholders);
  if (common < seq.tokens().size()) {
    // The prompt diverges inside what is cached: roll back to the common prefix, or start over
    // if the caches cannot go that far.
    if (common == 0 || !seq.truncate(static_cast<int64_t>(common))) {
      seq.reset();
      common = 0;
    }
  }
  s.prompt = ids;
  s.soft = FloatTensor();
  s.soft_at = 0;
  const FloatTensor& soft = job->prompt.soft_tokens;
  if (soft.numel() > 0) {  // image and audio soft tokens, in placeholder order
    const int64_t skip =
        count_placeholders(seq.config(), std::span<const int32_t>(ids.data(), common));
    if (soft.dim(0) > skip) s.soft = slice_rows(soft, skip, soft.dim(0) - skip);
  }
  s.capacity = job->capacity;
  s.stream = std::make_unique<TokenStream>(assistant->tokenizer(), ids, job->gen);
  s.next_id.reset();
  s.draft.reset();
  s.draft_h.clear();
  s.verify_ids.clear();
  if (job->draft_max > 0) {
    SpeculativeOptions so;
    so.draft_max = job->draft_max;
    so.draft_min = job->draft_min;
    so.adaptive = opt.draft_adapt;
    s.draft.emplace(so);
  }
  s.admitted = ++admissions;
  s.job = job;
  s.state = SlotState::kPrefill;
  s.rows = seq.n_past();
  s.reserved = s.capacity;
  ++busy;
  prompt_tokens_total += static_cast<int64_t>(ids.size());
  reused_tokens_total += static_cast<int64_t>(common);
  {
    std::lock_guard<std::mutex> lk(job->mu);
    job->started = true;
    job->prompt_tokens = static_cast<int64_t>(ids.size());
  }
  job->cv.notify_all();
}

// The request on `s` is over: its reply (or error) goes to the job, the slot is free again. A
// cancelled or failed request's rows are dropped at once; a finished one's stay for prefix reuse
// until the budget needs them.
void Server::Impl::end_job(Slot& s, const std::string& reason,
                           const std::optional<ApiError>& error) {
  const std::shared_ptr<Job> job = s.job;
  if (!error) s.stream->end(reason);
  const GenerationResult& r = s.stream->result();
  const bool drop = error || r.finish_reason == "cancelled";
  // The counters and the slot first, so a client that has its reply sees them updated.
  if (error)
    ++failed;
  else if (r.finish_reason == "cancelled")
    ++cancelled;
  else
    ++completed;
  if (!error) generated_tokens_total += static_cast<int64_t>(r.tokens.size());
  if (drop) s.sequence->reset();
  s.last_used = steps;
  {
    std::lock_guard<std::mutex> lk(q_mu);
    s.job.reset();
    s.state = SlotState::kIdle;
    s.rows = s.reserved = s.sequence->n_past();
    --busy;
  }
  idle_cv.notify_all();
  if (error) {
    fail_job(*job, *error);
  } else {
    {
      std::lock_guard<std::mutex> lk(job->mu);
      job->done = true;
      job->text = r.text;
      job->completion_tokens = static_cast<int64_t>(r.tokens.size());
      job->finish_reason = r.finish_reason;
      job->stop_sequence = r.stop_string;
    }
    job->cv.notify_all();
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
bool Server::Impl::draft(Slot& s) {
  s.verify_ids.clear();
  if (!s.draft || s.draft_h.empty()) return true;
  Sequence& seq = *s.sequence;
  const int64_t P = seq.n_past();
  // max_tokens leaves room for the drafts and the target's own token; the verify's rows fit the
  // request's reservation; one call takes them whole.
  const int64_t k =
      s.draft->next_draft(std::min({int64_t{s.job->gen.max_tokens} - s.stream->steps() - 1,
                                    s.capacity - P - 1, int64_t{ubatch_rows} - 1}));
  if (k <= 0) return true;
  try {
    // A drafted image/audio placeholder would be a row without its soft token, which a call
    // that also carries another request's image refuses: the round ends before it.
    s.verify_ids = draft_round(*pool, *drafter, draft_context(seq, draft_donors, P), *s.next_id,
                               s.draft_h, k, [&](int32_t tok) {
                                 return std::find(placeholders.begin(), placeholders.end(), tok) !=
                                        placeholders.end();
                               });
  } catch (const std::exception& e) {
    s.verify_ids.clear();
    end_job(s, "", ApiError(500, std::string("drafting failed: ") + e.what(), "server_error"));
    return false;
  }
  if (s.verify_ids.size() == 1) s.verify_ids.clear();
  return true;
}

// One batched step: a decode row for every sequence that is generating, then prompt rows of the
// sequences being prefilled (oldest first) up to -b rows in all, run as calls of at most -ub rows.
// With the model's stages in several processes, the running sequences are split over that many
// calls kept in flight together, and a step ends once one of them finished (its sequences then
// take part in the next step while the others still compute); otherwise every call finishes
// within its step.
void Server::Impl::step() {
  ++steps;
  const auto t0 = Clock::now();
  for (auto& s : slots)
    if (s->job && !s->in_flight && s->job->cancel.load()) end_job(*s, "cancelled");

  struct Piece {
    Slot* slot;
    int64_t begin, n;  // prompt rows [begin, begin + n); decode rows have n == 0
  };
  std::vector<Piece> pieces;
  int64_t room = batch_rows;
  // Every generating sequence gets its row each step (none starves when --parallel exceeds -b).
  for (auto& s : slots)
    if (s->job && !s->in_flight && s->next_id) {
      if (drafter && !draft(*s)) continue;
      pieces.push_back({s.get(), 0, 0});
      room -= std::max<int64_t>(1, static_cast<int64_t>(s->verify_ids.size()));
    }
  std::vector<Slot*> filling;
  for (auto& s : slots)
    if (s->job && !s->in_flight && s->state == SlotState::kPrefill) filling.push_back(s.get());
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
  if (pieces.empty() && pipeline->in_flight() == 0) return;
  // Pipelined, a call takes its share of the running sequences.
  size_t max_entries = pieces.size() + 1;
  if (pipeline_depth > 1) {
    size_t running = 0;
    for (auto& s : slots) running += s->job ? 1 : 0;
    max_entries = std::max<size_t>(1, (running + pipeline_depth - 1) / pipeline_depth);
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
    while (next_piece < pieces.size() && call_rows < ubatch_rows && batch.size() < max_entries) {
      const Piece& p = pieces[next_piece];
      Slot& s = *p.slot;
      if (!s.job) {  // ended by a failed call earlier in this step
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
                                 from + std::min(p.n - piece_done, ubatch_rows - call_rows)) -
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
    while (pipeline->in_flight() > 0 &&
           (pipeline->in_flight() >= static_cast<size_t>(pipeline_depth) || owner_in_flight())) {
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
      if (!s.job) continue;
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
    if (drafter)
      call.hidden = std::make_unique<TapRecorder>(std::vector<std::string>{"final_hidden"});
    try {
      const uint64_t id = pipeline->start(batch, call.hidden.get());
      for (Slot* s : call.owners) s->in_flight = true;
      calls_in_flight.emplace(id, std::move(call));
    } catch (const std::exception& e) {
      for (Slot* s : call.owners)
        if (s->job) end_job(*s, "", ApiError(500, e.what(), "server_error"));
    }
  }
  // Pipelined, the step ends once a call finished (the pipeline stays full); otherwise once all
  // did.
  while (pipeline->in_flight() > 0 &&
         (pipeline_depth == 1 || finished == 0 ||
          pipeline->in_flight() >= static_cast<size_t>(pipeline_depth))) {
    rows_run += finish_call();
    ++finished;
  }
  const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
  std::lock_guard<std::mutex> lk(q_mu);
  for (auto& s : slots) s->rows = s->job ? s->sequence->n_past() : s->rows;
  size_t b = 0;
  while (b < kStepBuckets.size() && secs > kStepBuckets[b]) ++b;
  ++step_counts[b];
  step_seconds_sum += secs;
  step_rows_total += rows_run;
}

// The next call of the pipeline to finish: its sequences sample their next ids (or their
// requests end with the call's error). Returns the rows it ran.
int64_t Server::Impl::finish_call() {
  CallPipeline::Finished f = pipeline->next();
  auto node = calls_in_flight.extract(f.call);
  if (node.empty()) return 0;
  CallInFlight& call = node.mapped();
  for (Slot* s : call.owners) s->in_flight = false;
  if (f.error) {
    try {
      std::rethrow_exception(f.error);
    } catch (const std::bad_alloc&) {
      for (Slot* s : call.owners)
        if (s->job)
          end_job(*s, "",
                  ApiError(503, "out of memory while serving this request", "server_error", {},
                           "out_of_memory"));
    } catch (const std::exception& e) {
      // A stage on a rank that stopped answering is the service's failure, not the request's.
      const bool stage_down = !stage_failure().empty();
      for (Slot* s : call.owners)
        if (s->job)
          end_job(*s, "",
                  stage_down ? ApiError(503, e.what(), "server_error", {}, "stage_failed")
                             : ApiError(500, e.what(), "server_error"));
    }
    return 0;
  }
  const int64_t V = assistant->model().config().text.vocab_size;
  // The drafter's h: the post-final-norm hidden of each head row, entry after entry.
  FloatTensor hidden;
  if (call.hidden && call.hidden->has("final_hidden")) hidden = call.hidden->get("final_hidden");
  int64_t head_row = 0;
  for (size_t i = 0; i < call.owners.size(); ++i) {
    Slot& s = *call.owners[i];
    const FloatTensor& l = f.logits[i];
    const int64_t row0 = head_row;
    head_row += l.dim(0);
    if (!s.job) continue;
    s.soft_at += call.soft_rows[i];
    const bool prompt_done = s.state == SlotState::kDecode ||
                             s.sequence->n_past() == static_cast<int64_t>(s.prompt.size());
    if (!prompt_done) continue;
    const bool was_decoding = s.state == SlotState::kDecode;
    if (s.state == SlotState::kPrefill) {
      s.soft = FloatTensor();
      std::lock_guard<std::mutex> lk(q_mu);
      s.state = SlotState::kDecode;
    }
    Job& job = *s.job;
    const TextCallback emit = [&job](std::string_view piece) {
      {
        std::lock_guard<std::mutex> lk(job.mu);
        job.pending.append(piece);
      }
      job.cv.notify_all();
      return !job.cancel.load();
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
      ++draft_rounds_total;
      drafted_total += k;
      draft_accepted_total += n;
      s.draft->round(k, n, -1);
      if (!s.sequence->truncate(P + n + 1)) {
        if (s.next_id) {
          end_job(s, "",
                  ApiError(500,
                           "speculative decoding: the KV cache cannot roll back to " +
                               std::to_string(P + n + 1) + " rows",
                           "server_error"));
          continue;
        }
        s.sequence->reset();
      }
      keep_hidden(n);
    } else {
      s.next_id =
          s.stream->next(l.row(l.dim(0) - 1), V, s.sequence->n_past() + 1 <= s.capacity, emit);
      if (s.draft && was_decoding) s.draft->plain_step(-1);
      keep_hidden(l.dim(0) - 1);
    }
    if (job.gen.top_logprobs >= 0) {
      const std::vector<TokenLogprob>& all = s.stream->result().logprobs;
      std::lock_guard<std::mutex> lk(job.mu);
      job.logprobs.insert(job.logprobs.end(),
                          all.begin() + static_cast<std::ptrdiff_t>(job.logprobs.size()),
                          all.end());
    }
    if (!s.next_id) end_job(s, s.stream->result().finish_reason);
  }
  return call.rows;
}

// Abandons every call in flight: their sequences stay as they were before each call.
void Server::Impl::drop_calls_in_flight() {
  pipeline = std::make_unique<CallPipeline>(*pool);
  calls_in_flight.clear();
  for (auto& s : slots) {
    s->in_flight = false;
    s->verify_ids.clear();
  }
}

// GET /metrics: Prometheus text exposition format, version 0.0.4.
std::string Server::Impl::metrics_text() {
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
  value("gemstage_requests_total{outcome=\"completed\"}", static_cast<double>(completed.load()));
  value("gemstage_requests_total{outcome=\"cancelled\"}", static_cast<double>(cancelled.load()));
  value("gemstage_requests_total{outcome=\"failed\"}", static_cast<double>(failed.load()));
  value("gemstage_requests_total{outcome=\"refused\"}", static_cast<double>(refused.load()));
  metric("gemstage_prompt_tokens_total", "counter", "Prompt tokens of requests that started.");
  value("gemstage_prompt_tokens_total", static_cast<double>(prompt_tokens_total.load()));
  metric("gemstage_prompt_tokens_reused_total", "counter",
         "Prompt tokens found in a slot's caches and not prefilled again.");
  value("gemstage_prompt_tokens_reused_total", static_cast<double>(reused_tokens_total.load()));
  metric("gemstage_generated_tokens_total", "counter", "Tokens generated.");
  value("gemstage_generated_tokens_total", static_cast<double>(generated_tokens_total.load()));
  metric("gemstage_draft_rounds_total", "counter",
         "Speculative rounds: drafts verified in one step of their sequence (-md).");
  value("gemstage_draft_rounds_total", static_cast<double>(draft_rounds_total.load()));
  metric("gemstage_draft_tokens_total", "counter", "Tokens the drafter proposed.");
  value("gemstage_draft_tokens_total", static_cast<double>(drafted_total.load()));
  metric("gemstage_draft_accepted_total", "counter", "Drafted tokens the target accepted.");
  value("gemstage_draft_accepted_total", static_cast<double>(draft_accepted_total.load()));
  std::lock_guard<std::mutex> lk(q_mu);
  metric("gemstage_step_seconds", "histogram", "Wall time of one engine step (all its calls).");
  int64_t cumulative = 0;
  for (size_t b = 0; b < kStepBuckets.size(); ++b) {
    cumulative += step_counts[b];
    std::ostringstream le;
    le << kStepBuckets[b];
    value("gemstage_step_seconds_bucket{le=\"" + le.str() + "\"}", static_cast<double>(cumulative));
  }
  cumulative += step_counts.back();
  value("gemstage_step_seconds_bucket{le=\"+Inf\"}", static_cast<double>(cumulative));
  value("gemstage_step_seconds_sum", step_seconds_sum);
  value("gemstage_step_seconds_count", static_cast<double>(cumulative));
  metric("gemstage_step_rows_total", "counter", "Rows (decode and prompt) the engine ran.");
  value("gemstage_step_rows_total", static_cast<double>(step_rows_total));
  metric("gemstage_queue_depth", "gauge", "Requests waiting for a slot or KV rows.");
  value("gemstage_queue_depth", static_cast<double>(queue.size()));
  metric("gemstage_slots", "gauge", "Slots (--parallel).");
  value("gemstage_slots", static_cast<double>(slots.size()));
  metric("gemstage_slots_busy", "gauge", "Slots running a request.");
  value("gemstage_slots_busy", busy);
  int64_t used = 0, reserved = 0;
  for (const auto& s : slots) {
    used += s->rows;
    reserved += s->reserved;
  }
  metric("gemstage_kv_rows_budget", "gauge", "KV rows all sequences share (-c).");
  value("gemstage_kv_rows_budget", static_cast<double>(kv_budget));
  metric("gemstage_kv_rows_used", "gauge", "KV rows the slots' caches hold.");
  value("gemstage_kv_rows_used", static_cast<double>(used));
  metric("gemstage_kv_rows_free", "gauge",
         "KV rows of the budget not reserved by running requests or held by idle slots.");
  value("gemstage_kv_rows_free", static_cast<double>(kv_budget - reserved));
  return out;
}

void Server::Impl::submit(const std::shared_ptr<Job>& job) {
  {
    std::lock_guard<std::mutex> lk(q_mu);
    if (draining.load()) throw shutting_down_error();
    queue.push_back(job);
    queue_changed = true;
  }
  q_cv.notify_one();
}

// ------------------------------------------------------------------------------------------
// HTTP.

namespace {

// Waits for pred (checked under job.mu) while watching the client; false if it went away.
template <typename Pred>
bool wait_watching(Job& job, const ClientSocket& client, Pred pred) {
  std::unique_lock<std::mutex> lk(job.mu);
  while (!job.cv.wait_for(lk, kPollInterval, pred)) {
    lk.unlock();
    const bool alive = client.alive();
    lk.lock();
    if (!alive) {
      job.request_cancel(CancelReason::kClientGone);
      return false;
    }
  }
  return true;
}

// What a streamed reply's content provider needs between calls.
struct StreamState {
  std::shared_ptr<Job> job;
  ResponseMeta meta;
  bool chat = true, include_usage = false, sent_role = false;
  std::unique_ptr<ClientSocket> client;
  size_t logprobs_sent = 0;                         // of job->logprobs
  const Tokenizer* tokenizer = nullptr;             // to name the logprobs' tokens
  std::function<void()> on_close;                   // the server's open-stream count
  std::unique_ptr<OutputStreamParser> tool_parser;  // tool path: raw text -> deltas
  std::function<std::string()> new_call_id;
  // A reply framed as named events (/v1/messages, /v1/responses): the dialect's writers.
  struct EventReply {
    std::function<std::string(int64_t prompt_tokens)> begin;
    std::function<std::string(const OutputDelta&, const json& text_logprobs)> delta;
    std::function<std::string(const std::string& tool_finish, int64_t prompt, int64_t completion,
                              const std::string& stop_sequence)>
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
  int64_t prompt_tokens = 0, completion_tokens = 0;
  std::vector<TokenLogprob> logprobs;  // of the tokens since the last look
};

StreamProgress take_progress(Job& j, size_t* logprobs_sent = nullptr) {
  StreamProgress p;
  std::unique_lock<std::mutex> lk(j.mu);
  j.cv.wait_for(lk, kPollInterval, [&] { return !j.pending.empty() || j.done; });
  p.piece.swap(j.pending);
  if (logprobs_sent && *logprobs_sent < j.logprobs.size()) {
    p.logprobs.assign(j.logprobs.begin() + static_cast<std::ptrdiff_t>(*logprobs_sent),
                      j.logprobs.end());
    *logprobs_sent = j.logprobs.size();
  }
  p.done = j.done;
  p.error = j.error;
  p.finish = j.finish_reason;
  p.stop_sequence = j.stop_sequence;
  p.prompt_tokens = j.prompt_tokens;
  p.completion_tokens = j.completion_tokens;
  return p;
}

// The /v1/messages and /v1/responses streams: the same progress, framed as the dialect's named
// events. They take the tool path, whose parser splits reasoning, text and tool calls.
bool event_stream_step(StreamState& st, httplib::DataSink& sink) {
  Job& j = *st.job;
  auto write = [&](const std::string& events) {
    return events.empty() || sink.write(events.data(), events.size());
  };
  auto gone = [&] {
    j.request_cancel(CancelReason::kClientGone);
    return false;
  };
  if (!st.sent_role) {
    st.sent_role = true;
    int64_t prompt_tokens = 0;
    {
      std::lock_guard<std::mutex> lk(j.mu);
      prompt_tokens = j.prompt_tokens;
    }
    if (!write(st.events->begin(prompt_tokens))) return gone();
  }
  StreamProgress p = take_progress(j, st.reply_tokens ? &st.logprobs_sent : nullptr);
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
  if (!write(st.events->delta(d, text_logprobs))) return gone();
  if (!p.done) return st.client->alive() ? true : gone();
  if (p.error || p.finish == "cancelled") {
    write(st.events->error(p.error ? *p.error : shutting_down_error()));
    sink.done();
    return true;
  }
  std::string fr = openai_finish_reason(p.finish);
  if (st.tool_parser) {
    const std::string& raw = st.tool_parser->text();
    fr = tool_finish_reason(parse_model_output(raw), raw, p.finish == "stop");
  }
  if (!write(st.events->end(fr, p.prompt_tokens, p.completion_tokens, p.stop_sequence)))
    return gone();
  sink.done();
  return true;
}

// One call of a streamed reply's content provider: waits briefly for new text and writes it,
// with no lock held, so a slow reader only ever stalls its own thread. False ends the stream.
bool stream_step(StreamState& st, httplib::DataSink& sink) {
  Job& j = *st.job;
  auto write = [&](const json& chunk) {
    const std::string ev = sse_event(chunk);
    return sink.write(ev.data(), ev.size());
  };
  auto gone = [&] {
    j.request_cancel(CancelReason::kClientGone);
    return false;
  };
  if (st.events) return event_stream_step(st, sink);
  if (!st.sent_role) {
    st.sent_role = true;
    // OpenAI's first chunk carries the role; clients key the message off it.
    if (st.chat &&
        !write(chat_chunk_json(st.meta, {{"role", "assistant"}, {"content", ""}}, std::nullopt)))
      return gone();
  }
  StreamProgress p = take_progress(j, st.chat ? &st.logprobs_sent : nullptr);
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
      if (!write(with_logprobs(chunk))) return gone();
  } else if (!piece.empty()) {
    const json chunk = st.chat ? chat_chunk_json(st.meta, {{"content", piece}}, std::nullopt)
                               : text_completion_chunk_json(st.meta, piece, std::nullopt);
    if (!write(with_logprobs(chunk))) return gone();
  }
  if (logprobs && !write(with_logprobs(chat_chunk_json(st.meta, {{"content", ""}}, std::nullopt))))
    return gone();
  if (!done) return st.client->alive() ? true : gone();
  if (error || finish == "cancelled") {
    // Cut short (shutdown, or a fault after the 200 went out): an error event, and no
    // [DONE], so no client mistakes the partial reply for a whole one.
    write(error_json(error ? *error : shutting_down_error()));
    sink.done();
    return true;
  }
  std::string fr = openai_finish_reason(finish);
  if (st.tool_parser) {
    const std::string& raw = st.tool_parser->text();
    fr = tool_finish_reason(parse_model_output(raw), raw, finish == "stop");
  }
  const json last = st.chat ? chat_chunk_json(st.meta, json::object(), fr)
                            : text_completion_chunk_json(st.meta, "", fr);
  if (!write(last)) return gone();
  if (st.include_usage &&
      !write(usage_chunk_json(st.meta, st.chat ? "chat.completion.chunk" : "text_completion",
                              p.prompt_tokens, p.completion_tokens)))
    return gone();
  static constexpr std::string_view kDone = "data: [DONE]\n\n";
  if (!sink.write(kDone.data(), kDone.size())) return gone();
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
  job->chat = route != Route::kCompletion;
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
  if (route == Route::kCompletion) {
    CompletionRequest r =
        parse_completion_request(body, {assistant->model().config().text.vocab_size, max_context});
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
  if (dialect) common.stream = m ? m->stream : rs->stream;
  return job;
}

void Server::Impl::handle_count_tokens(const httplib::Request& req, httplib::Response& res) {
  json body = parse_json_body(req.body);
  // Counting needs no max_tokens; give the Messages parser its required field.
  if (!body.contains("max_tokens")) body["max_tokens"] = 1;
  GenerationRequest common;
  const std::shared_ptr<Job> job = parse_job(body, Route::kMessages, common);
  prepare(*job);
  res.set_content(wire_json({{"input_tokens", job->prompt.ids.size()}}), "application/json");
}

void Server::Impl::handle_generation(const httplib::Request& req, httplib::Response& res,
                                     Route route) {
  const bool chat = route != Route::kCompletion;
  GenerationRequest common;  // the shared part of every request, sliced off
  const std::shared_ptr<Job> job = parse_job(parse_json_body(req.body), route, common);
  const bool stream = common.stream, include_usage = common.include_usage;
  try {
    prepare(*job);
  } catch (...) {
    ++refused;
    throw;
  }
  auto client = std::make_unique<ClientSocket>(req);
  submit(job);
  // Until the prompt is known to fit, the status is still open: a context overflow is a 400
  // even for a streamed request.
  if (!wait_watching(*job, *client, [&] { return job->started || job->done; })) return;
  {
    std::lock_guard<std::mutex> lk(job->mu);
    if (job->error && !job->started) throw *job->error;
  }
  const char* id_prefix = route == Route::kMessages    ? "msg_"
                          : route == Route::kResponses ? "resp_"
                          : chat                       ? "chatcmpl-"
                                                       : "cmpl-";
  const ResponseMeta meta{new_id(id_prefix), model_name, static_cast<int64_t>(std::time(nullptr))};
  if (!stream) {
    if (!wait_watching(*job, *client, [&] { return job->done; })) return;
    std::lock_guard<std::mutex> lk(job->mu);
    if (job->error) throw *job->error;
    if (job->finish_reason == "cancelled") throw shutting_down_error();
    const std::string fr = openai_finish_reason(job->finish_reason);
    auto ids = [this] { return new_id("call_"); };
    if (route == Route::kMessages || route == Route::kResponses) {
      const std::string raw = job->generation_prefix + job->text;
      ParsedOutput parsed;
      std::string finish = fr;
      if (job->tool_request) {
        parsed = parse_model_output(raw);
        finish = tool_finish_reason(parsed, raw, job->finish_reason == "stop");
      } else if (!job->text.empty()) {
        parsed.content = job->text;
      }
      const json out =
          route == Route::kMessages
              ? messages::message_json(
                    meta, parsed, messages::stop_reason(finish, job->stop_sequence),
                    job->prompt_tokens, job->completion_tokens, [this] { return new_id("toolu_"); },
                    job->stop_sequence)
              : responses::response_json(
                    meta, job->response_echo, parsed, finish, job->prompt_tokens,
                    job->completion_tokens, [this](const char* prefix) { return new_id(prefix); },
                    job->gen.top_logprobs >= 0
                        ? ReplyTextTokens(assistant->tokenizer(), job->generation_prefix)
                              .take_logprobs(job->logprobs)
                        : json::array());
      res.set_content(wire_json(out), "application/json");
      return;
    }
    json out =
        job->tool_request
            ? chat_tool_completion_json(meta, job->generation_prefix + job->text,
                                        job->finish_reason == "stop", job->prompt_tokens,
                                        job->completion_tokens, ids)
        : chat
            ? chat_completion_json(meta, job->text, fr, job->prompt_tokens, job->completion_tokens)
            : text_completion_json(meta, job->text, fr, job->prompt_tokens, job->completion_tokens);
    if (chat && job->gen.top_logprobs >= 0)
      out["choices"][0]["logprobs"] = logprobs_json(assistant->tokenizer(), job->logprobs);
    res.set_content(wire_json(out), "application/json");
    return;
  }

  auto st = std::make_shared<StreamState>();
  st->job = job;
  st->meta = meta;
  st->chat = chat;
  st->include_usage = include_usage;
  st->tokenizer = &assistant->tokenizer();
  st->client = std::move(client);
  if (job->tool_request) {
    std::lock_guard<std::mutex> lk(job->mu);
    st->tool_parser = std::make_unique<OutputStreamParser>(job->generation_prefix);
    st->new_call_id = [this] { return new_id("call_"); };
  }
  if (route == Route::kMessages) {
    auto es = std::make_shared<messages::EventStream>(meta, [this] { return new_id("toolu_"); });
    st->events = StreamState::EventReply{
        [es](int64_t prompt) { return es->begin(prompt); },
        [es](const OutputDelta& d, const json&) { return es->delta(d); },
        [es](const std::string& finish, int64_t, int64_t completion,
             const std::string& stop_sequence) {
          return es->end(messages::stop_reason(finish, stop_sequence), completion, stop_sequence);
        },
        [](const ApiError& e) { return messages::EventStream::error(e); }};
  } else if (route == Route::kResponses) {
    auto es = std::make_shared<responses::EventStream>(
        meta, job->response_echo, [this](const char* prefix) { return new_id(prefix); });
    st->events = StreamState::EventReply{
        [es](int64_t) { return es->begin(); },
        [es](const OutputDelta& d, const json& text_logprobs) {
          return es->delta(d, text_logprobs);
        },
        [es](const std::string& finish, int64_t prompt, int64_t completion, const std::string&) {
          return es->end(finish, prompt, completion);
        },
        [es](const ApiError& e) { return es->error(e); }};
    if (job->gen.top_logprobs >= 0)
      st->reply_tokens.emplace(assistant->tokenizer(), job->generation_prefix);
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
          st->job->request_cancel(CancelReason::kClientGone);
          return false;
        }
      },
      // Released with the response; success is false when the library gave up on the stream
      // (write error, or the server stopping), so the generation must not run on.
      [st](bool success) {
        if (!success) st->job->request_cancel(CancelReason::kClientGone);
      });
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
          msg = "no such route: " + req.method + " " + req.path +
                " (this server has GET /, GET /health, GET /metrics, GET /v1/models, POST "
                "/v1/chat/completions, "
                "POST /v1/completions, POST /v1/responses, POST /v1/messages and POST "
                "/v1/messages/count_tokens)";
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
  http.set_pre_routing_handler([this](const Request& req, Response& res) {
    if (req.path.rfind("/v1/", 0) != 0) return HR::Unhandled;
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

  auto guarded = [this](Route route) {
    return [this, route](const Request& req, Response& res) {
      try {
        ensure_model_files_intact();
        if (route == Route::kMessages && req.path != "/v1/messages")
          handle_count_tokens(req, res);
        else
          handle_generation(req, res, route);
      } catch (const ApiError& e) {
        set_error(req, res, e);
      } catch (const Error& e) {
        set_error(req, res, ApiError(400, e.what()));
      } catch (const std::bad_alloc&) {
        set_error(req, res,
                  ApiError(503, "out of memory while serving this request", "server_error", {},
                           "out_of_memory"));
      }
    };
  };
  http.Post("/v1/chat/completions", guarded(Route::kChat));
  http.Post("/v1/completions", guarded(Route::kCompletion));
  http.Post("/v1/messages", guarded(Route::kMessages));
  http.Post("/v1/messages/count_tokens", guarded(Route::kMessages));
  http.Post("/v1/responses", guarded(Route::kResponses));
  http.Get("/v1/models", [this](const Request&, Response& res) {
    res.set_content(wire_json(models_json(model_name, created)), "application/json");
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
      std::lock_guard<std::mutex> lk(q_mu);
      json states = json::array();
      int64_t reserved = 0;
      for (const auto& s : slots) {
        states.push_back({{"id", s->id}, {"state", slot_state_name(s->state)}, {"rows", s->rows}});
        reserved += s->reserved;
      }
      j = {{"status", "ok"},
           {"slots", slots.size()},
           {"slots_busy", busy},
           {"queued", queue.size()},
           {"kv_budget", kv_budget},
           {"kv_rows_reserved", reserved},
           {"pipeline_depth", pipeline_depth},
           {"slot_states", std::move(states)}};
      if (drafter)
        j["speculative"] = {{"draft_model", drafter_name},
                            {"draft_max", opt.draft_max},
                            {"draft_min", opt.draft_min},
                            {"draft_adapt", opt.draft_adapt},
                            {"rounds", draft_rounds_total.load()},
                            {"drafted", drafted_total.load()},
                            {"accepted", draft_accepted_total.load()}};
    }
    res.set_content(wire_json(j), "application/json");
  });
  http.Get("/metrics", [this](const Request&, Response& res) {
    if (!ready.load()) {
      res.status = 503;
      res.set_content("# the model is still loading\n", "text/plain; version=0.0.4");
      return;
    }
    res.set_content(metrics_text(), "text/plain; version=0.0.4");
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
  for (const auto& [path, allow] :
       {std::pair{"/v1/chat/completions", "POST"}, std::pair{"/v1/completions", "POST"},
        std::pair{"/v1/messages", "POST"}, std::pair{"/v1/messages/count_tokens", "POST"},
        std::pair{"/v1/responses", "POST"}, std::pair{"/v1/models", "GET"},
        std::pair{"/health", "GET"}, std::pair{"/metrics", "GET"}, std::pair{"/", "GET"}}) {
    if (std::string_view(allow) != "GET") http.Get(path, not_allowed(allow));
    if (std::string_view(allow) != "POST") http.Post(path, not_allowed(allow));
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
  {
    std::lock_guard<std::mutex> lk(q_mu);
    draining.store(true);
  }
  if (loader.joinable()) loader.join();
  {
    std::lock_guard<std::mutex> lk(q_mu);
    for (const auto& job : queue) fail_job(*job, shutting_down_error());
    queue.clear();
  }
  {
    // Running generations may finish within the grace period; then they are cut short.
    std::unique_lock<std::mutex> lk(q_mu);
    const auto grace = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(std::max(0.0, opt.shutdown_grace_seconds)));
    idle_cv.wait_until(lk, Clock::now() + grace, [&] { return busy == 0; });
    for (auto& s : slots)
      if (s->job) s->job->request_cancel(CancelReason::kShutdown);
    idle_cv.wait(lk, [&] { return busy == 0; });
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
  {
    std::lock_guard<std::mutex> lk(q_mu);
    engine_stop = true;
  }
  q_cv.notify_all();
  if (engine_thread.joinable()) engine_thread.join();
}

// ------------------------------------------------------------------------------------------

Server::Server(ServerOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {
  if (impl_->opt.parallel < 1) fail("--parallel must be at least 1");
  if (impl_->opt.max_body == 0) fail("--max-body must be at least 1 byte");
}

Server::~Server() {
  shutdown();
}

void Server::start() {
  Impl& m = *impl_;
  const int http_threads =
      m.opt.http_threads > 0 ? m.opt.http_threads : std::max(64, 4 * m.opt.parallel + 16);
  // Each connection holds one library thread while it is open (a waiting or streaming client
  // included), so there are many more of them than slots; they sleep while they wait.
  m.http.new_task_queue = [http_threads] { return new httplib::ThreadPool(http_threads); };
  m.http.set_payload_max_length(m.opt.max_body);
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
  // The loader fills `slots` before it sets `ready`; before that there are none to count.
  const int slots = impl_->ready.load() ? static_cast<int>(impl_->slots.size()) : 0;
  std::lock_guard<std::mutex> lk(impl_->q_mu);
  Stats st{slots, impl_->busy, static_cast<int>(impl_->queue.size()), impl_->completed.load(),
           impl_->cancelled.load()};
  st.draft_rounds = impl_->draft_rounds_total.load();
  st.drafted = impl_->drafted_total.load();
  st.draft_accepted = impl_->draft_accepted_total.load();
  if (impl_->ready.load()) {
    st.kv_budget = impl_->kv_budget;
    st.max_context = impl_->max_context;
    for (const auto& s : impl_->slots) {
      st.kv_rows_used += s->rows;
      st.kv_rows_reserved += s->reserved;
    }
  }
  return st;
}

}  // namespace gemstage::server
