// gemstage serve: the OpenAI-compatible HTTP server of src/server behind llama.cpp-style flags.
#include <pthread.h>
#include <signal.h>

#include <atomic>
#include <fstream>
#include <iostream>
#include <thread>

#include "core/error.h"
#include "server/server.h"
#include "tools/cli_common.h"
#include "tools/commands.h"
#include "tools/generation_args.h"

namespace gemstage::cli {

namespace {

struct ServeArgs : CommonArgs {
  std::string host = "127.0.0.1";
  int port = 8080;
  int parallel = 1;
  int http_threads = 0;
  int ubatch = 512;
  std::string api_key;
  size_t max_body = size_t{32} << 20;
  int64_t max_image_pixels = server::RequestLimits{}.max_image_pixels;
  std::string allowed_local_media_path;
  server::RemoteMediaOptions remote_media;
  double remote_media_max_mb = 20;
  VideoArgs video;
  double shutdown_grace = 5;
  std::string model_draft;  // -md: speculative decoding with a gemma4_assistant drafter
  int draft_max = 4, draft_min = 0;
  bool no_draft_adapt = false;
  bool no_bundle_drafter = false;
  // llama-server's spellings.
  std::string alias, api_key_file, cors;
  std::string log_format = "text", log_file;
  bool log_disable = false;
  bool slots = false, no_slots = false, metrics = false, jinja = false;
  int timeout = 0;
};

// The signal that arrived within `wait`, or 0.
int wait_signal(const sigset_t& sigs, std::chrono::milliseconds wait) {
  timespec ts{static_cast<time_t>(wait.count() / 1000),
              static_cast<long>(wait.count() % 1000) * 1000000L};
  const int s = sigtimedwait(&sigs, nullptr, &ts);
  return s > 0 ? s : 0;
}

int run_serve(const ServeArgs& a, const RunContext& cx) {
  // SIGINT/SIGTERM are blocked in every thread (the server's threads inherit this mask) and taken
  // synchronously below, so a signal never lands inside a worker mid-token.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  // A write to a client that hung up must fail with EPIPE (ending that one stream), not kill us.
  signal(SIGPIPE, SIG_IGN);

  server::ServerOptions o;
  o.model_path = a.model;
  o.models = cx.models;
  o.pipeline_depth = cx.pipeline_depth;
  o.host = a.host;
  o.port = a.port;
  o.parallel = a.parallel;
  o.ctx = a.ctx;
  // -b (--chunk, --batch-size) bounds a step's rows: decode rows plus prompt chunks.
  if (a.chunk < 1 || a.chunk > (int64_t{1} << 20)) fail("-b / --batch-size must be 1 to 1048576");
  o.batch = static_cast<int>(a.chunk);
  o.ubatch = a.ubatch;
  o.kv_type = cache_type_of(a.cache_type);
  o.api_key = a.api_key;
  if (!a.api_key_file.empty()) {
    // llama-server's --api-key-file: one key per line; this server takes one key, the first.
    std::ifstream in(a.api_key_file);
    if (!in) fail("--api-key-file ", a.api_key_file, ": cannot read the file");
    std::string line;
    while (std::getline(in, line)) {
      while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
      if (!line.empty()) break;
    }
    if (line.empty()) fail("--api-key-file ", a.api_key_file, ": the file holds no key");
    if (!o.api_key.empty() && o.api_key != line)
      fail("--api-key and --api-key-file name different keys; give one");
    o.api_key = line;
  }
  o.alias = a.alias;
  o.slots_endpoint = a.slots && !a.no_slots;
  o.cors_origins = a.cors;
  o.io_timeout_seconds = a.timeout;
  o.access_log_format = a.log_disable ? "off" : a.log_format;
  o.access_log_path = a.log_file;
  o.max_body = a.max_body;
  o.threads = a.threads;
  o.http_threads = a.http_threads;
  o.defaults = generation_defaults(a);
  o.ignore_eos = a.ignore_eos;
  if (a.seed_given) o.seed = a.seed;
  o.think = a.think;
  o.limits.max_image_pixels = a.max_image_pixels;
  o.limits.allowed_local_media_path = a.allowed_local_media_path;
  o.limits.remote_media = a.remote_media;
  o.limits.remote_media.max_bytes = static_cast<int64_t>(a.remote_media_max_mb * (1 << 20));
  o.limits.video_frames = a.video.frames;
  o.limits.video_budget = a.video.budget;
  o.shutdown_grace_seconds = a.shutdown_grace;
  o.model_draft = a.model_draft;
  o.draft_max = a.draft_max;
  o.draft_min = a.draft_min;
  o.draft_adapt = !a.no_draft_adapt;
  o.bundle_drafter = !a.no_bundle_drafter;

  server::Server srv(o);
  srv.start();
  const bool v6 = a.host.find(':') != std::string::npos;
  const std::string url =
      "http://" + (v6 ? "[" + a.host + "]" : a.host) + ":" + std::to_string(srv.port());
  std::cerr << "gemstage serve: listening on " << url << " (loading " << a.model << ")"
            << std::endl;

  bool announced = false;
  int sig = 0;
  while (!(sig = wait_signal(sigs, std::chrono::milliseconds(100)))) {
    if (announced) continue;
    const auto state = srv.load_state();
    if (state == server::Server::LoadState::kFailed) {
      std::cerr << "error: " << srv.load_error() << std::endl;
      srv.shutdown();
      return 1;
    }
    if (state == server::Server::LoadState::kReady) {
      const auto st = srv.stats();
      std::cerr << "gemstage serve: ready, " << st.slots << " slot(s); KV budget " << st.kv_budget
                << " tokens of context shared by all slots (-c), at most " << st.max_context
                << " for one request; chat page at " << url << "/ , API at " << url << "/v1"
                << std::endl;
      announced = true;
    }
  }
  std::cerr << "gemstage serve: " << (sig == SIGINT ? "SIGINT" : "SIGTERM")
            << ": finishing in-flight requests (up to " << a.shutdown_grace
            << " s), then exiting; a second signal exits at once" << std::endl;
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    srv.shutdown();
    stopped.store(true);
  });
  while (!stopped.load()) {
    if (wait_signal(sigs, std::chrono::milliseconds(100))) {
      std::cerr << "gemstage serve: second signal, exiting now" << std::endl;
      std::_Exit(130);
    }
  }
  stopper.join();
  std::cerr << "gemstage serve: stopped" << std::endl;
  return 0;
}

}  // namespace

void add_serve_command(CLI::App& app, Registry& reg) {
  auto a = std::make_shared<ServeArgs>();
  auto* sub = app.add_subcommand(
      "serve",
      "OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions) with a chat "
      "page at /");
  add_common(sub, *a);
  sub->add_option("--host", a->host, "address to listen on (loopback unless you choose otherwise)")
      ->capture_default_str();
  sub->add_option("--port", a->port, "port to listen on (0: any free port, printed at start)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  // llama.cpp's -np spelling is mapped to --parallel in main (CLI11 takes one-letter short names).
  sub->add_option("--parallel", a->parallel,
                  "requests generated at the same time (-np), batched into one step; others "
                  "wait in a FIFO queue. -c is the KV context all of them share")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  // llama.cpp's -ub spelling is mapped to --ubatch-size in main, and --batch-size to -b.
  sub->add_option("--ubatch-size", a->ubatch,
                  "rows one batched call runs at most (-ub); a step of -b rows runs as calls of "
                  "this many")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--threads-http", a->http_threads,
                  "connections served at once (default: max(64, 4 x parallel + 16))");
  sub->add_option("--api-key", a->api_key,
                  "require 'Authorization: Bearer KEY' on /v1/* (or set GEMSTAGE_API_KEY)")
      ->envname("GEMSTAGE_API_KEY");
  sub->add_option("--max-body", a->max_body, "largest request body in bytes (413 above it)")
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 40));
  sub->add_option("--max-image-pixels", a->max_image_pixels,
                  "largest image a request may send, in pixels (width x height)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{1}, int64_t{1} << 40));
  sub->add_option("--allowed-local-media-path", a->allowed_local_media_path,
                  "directory whose files video_url parts may name as file:///... (vLLM's flag; "
                  "default: none, data URLs only)")
      ->check(CLI::ExistingDirectory);
  sub->add_flag("--allow-remote-media", a->remote_media.enabled,
                "fetch http(s) image_url / audio_url parts (and Anthropic url image sources); "
                "off by default: a server that fetches any URL can be turned against its own "
                "network. Only public addresses are fetched, redirects re-checked, the size and "
                "time bounded");
  sub->add_flag("--allow-remote-media-private", a->remote_media.private_hosts,
                "with --allow-remote-media: also fetch from loopback, private and link-local "
                "addresses (an intranet's media server)");
  sub->add_option("--remote-media-max-mb", a->remote_media_max_mb,
                  "largest remote media file fetched, in MiB")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 1024.0));
  sub->add_option("--remote-media-timeout", a->remote_media.timeout_seconds,
                  "seconds one remote media fetch may take, redirects included")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 600.0));
  add_video_options(sub, a->video);
  sub->add_option("--shutdown-grace", a->shutdown_grace,
                  "seconds in-flight requests may run on after SIGINT/SIGTERM before they are "
                  "cancelled")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  sub->add_option("--model-draft", a->model_draft,
                  "speculative decoding with this gemma4_assistant (MTP) drafter (also -md: a "
                  "checkpoint, or a bundle whose drafter stage to use): every request drafts "
                  "unless it sends \"speculative.n_max\": 0")
      ->check(CLI::ExistingDirectory);
  sub->add_option("--draft-max", a->draft_max,
                  "drafts per round at most, a request's default (\"speculative.n_max\"; 0: "
                  "requests draft only when they ask)")
      ->capture_default_str()
      ->check(CLI::Range(0, server::kMaxDraftsPerRound));
  sub->add_option("--draft-min", a->draft_min,
                  "rounds that would draft fewer run a plain step, a request's default "
                  "(\"speculative.n_min\")")
      ->capture_default_str()
      ->check(CLI::Range(0, server::kMaxDraftsPerRound));
  sub->add_flag("--no-bundle-drafter", a->no_bundle_drafter,
                "serve a bundle without its drafter stage (export -md), which drafts otherwise");
  sub->add_flag("--no-draft-adapt", a->no_draft_adapt,
                "keep every round's draft length at the request's maximum instead of adapting it "
                "to the measured acceptance");
  // llama-server's flags, for scripts written for it (docs/server.md, "llama-server
  // compatibility").
  sub->add_option("-a,--alias", a->alias,
                  "the model's name in replies, /v1/models and /props (default: the checkpoint's)");
  sub->add_option("--api-key-file", a->api_key_file,
                  "read the API key from this file's first non-empty line");
  sub->add_flag("--slots", a->slots, "serve GET /slots (each slot's state, read-only)");
  sub->add_flag("--no-slots", a->no_slots, "do not serve GET /slots (the default)");
  sub->add_flag("--metrics", a->metrics,
                "accepted for llama-server scripts; /metrics is always on");
  sub->add_flag("--jinja", a->jinja,
                "accepted for llama-server scripts; the checkpoint's chat template always runs");
  sub->add_option("--cors", a->cors,
                  "browser origins allowed to call the API: comma-separated (http://host:port), "
                  "localhost (any page on this machine) or *; default: none (no CORS headers)");
  sub->add_option("--log-format", a->log_format,
                  "the access log's lines (one per request): text or json (one object a line)")
      ->capture_default_str()
      ->check(CLI::IsMember({"text", "json"}));
  sub->add_option("--log-file", a->log_file,
                  "append the access log to this file instead of stderr");
  sub->add_flag("--log-disable", a->log_disable, "write no access log");
  // -to is mapped to --timeout in main (CLI11 takes one-letter short names).
  sub->add_option("--timeout", a->timeout,
                  "seconds a connection may wait on a read or a write (-to; default: the HTTP "
                  "library's, 5 s)")
      ->check(CLI::Range(1, 86400));
  reg.add(sub, [a, &cx = reg.context] { return run_serve(*a, cx); });
}

}  // namespace gemstage::cli
