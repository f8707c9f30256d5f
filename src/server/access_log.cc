// The access log: one line per request, written by the HTTP library's logger once the reply has
// gone out (a streamed one included), with what the request's generation left in its record.
#include <cerrno>
#include <cmath>
#include <cstring>
#include <ctime>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "server/server_impl.h"

namespace gemstage::server {

using json = nlohmann::json;

namespace {

// UTC with milliseconds, as ISO 8601 writes it: 2026-12-07T19:40:00.123Z.
std::string utc_now() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t secs = std::chrono::system_clock::to_time_t(now);
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000;
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%S", &tm);
  char out[40];
  std::snprintf(out, sizeof(out), "%s.%03dZ", buf, static_cast<int>(ms));
  return out;
}

// The error reply's code: OpenAI's error.code where it has one, else its error.type (Anthropic's
// shape has only the type). Empty for a reply that is not a JSON error.
std::string error_code(const httplib::Response& res) {
  if (res.status < 400) return {};
  const json body = json::parse(res.body, nullptr, false);
  if (!body.is_object() || !body.contains("error") || !body["error"].is_object()) return {};
  const json& e = body["error"];
  if (e.contains("code") && e["code"].is_string() && !e["code"].get<std::string>().empty())
    return e["code"].get<std::string>();
  if (e.contains("type") && e["type"].is_string()) return e["type"].get<std::string>();
  return {};
}

double rounded(double v) {
  return std::round(v * 10) / 10;
}

}  // namespace

void Server::Impl::open_access_log() {
  if (opt.access_log_format == "off" || opt.access_log_path.empty()) return;
  access_file = std::make_unique<std::ofstream>(opt.access_log_path, std::ios::app);
  if (!*access_file)
    fail("--log-file ", opt.access_log_path,
         ": cannot open it for appending: ", std::strerror(errno));
}

void Server::Impl::access_begin(const httplib::Request& req) {
  if (opt.access_log_format == "off") return;
  AccessRecord r;
  r.start = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lk(access_mu);
  access_records.insert_or_assign(&req, r);
}

void Server::Impl::access_generation(const httplib::Request& req, const Generation::Result& r,
                                     int64_t generated) {
  if (opt.access_log_format == "off") return;
  if (generated < 0) generated = static_cast<int64_t>(r.generation.tokens.size());
  std::lock_guard<std::mutex> lk(access_mu);
  const auto it = access_records.find(&req);
  if (it == access_records.end()) return;
  AccessRecord& a = it->second;
  a.prompt_tokens = r.prompt_tokens;
  a.cached_tokens = r.cached_tokens;
  a.generated_tokens = generated;
  a.ttft_ms = (r.queue_seconds + r.prefill_seconds) * 1e3;
  // The decode phase starts at the first token, so it produced the tokens after it.
  if (r.decode_seconds > 0 && generated > 1)
    a.tokens_per_second = static_cast<double>(generated - 1) / r.decode_seconds;
}

void Server::Impl::access_log(const httplib::Request& req, const httplib::Response& res) {
  if (opt.access_log_format == "off") return;
  AccessRecord a;
  bool known = false;
  {
    std::lock_guard<std::mutex> lk(access_mu);
    if (const auto it = access_records.find(&req); it != access_records.end()) {
      a = it->second;
      known = true;
      access_records.erase(it);
    }
  }
  const double ms =
      known ? std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a.start)
                  .count()
            : -1;
  const std::string code = error_code(res);
  std::string line;
  if (opt.access_log_format == "json") {
    json j = {{"time", utc_now()},
              {"remote", req.remote_addr},
              {"method", req.method},
              {"path", req.path},
              {"status", res.status}};
    if (ms >= 0) j["duration_ms"] = rounded(ms);
    if (a.prompt_tokens >= 0) {
      j["prompt_tokens"] = a.prompt_tokens;
      j["cached_tokens"] = a.cached_tokens;
      j["generated_tokens"] = a.generated_tokens;
      j["ttft_ms"] = rounded(a.ttft_ms);
      if (a.tokens_per_second >= 0) j["tokens_per_second"] = rounded(a.tokens_per_second);
    }
    if (!code.empty()) j["error"] = code;
    line = j.dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    std::ostringstream o;
    o << utc_now() << ' ' << req.remote_addr << ' ' << req.method << ' ' << req.path << ' '
      << res.status;
    if (ms >= 0) o << ' ' << rounded(ms) << "ms";
    if (a.prompt_tokens >= 0) {
      o << " prompt=" << a.prompt_tokens << " cached=" << a.cached_tokens
        << " generated=" << a.generated_tokens << " ttft=" << rounded(a.ttft_ms) << "ms";
      if (a.tokens_per_second >= 0) o << " tok/s=" << rounded(a.tokens_per_second);
    }
    if (!code.empty()) o << " error=" << code;
    line = o.str();
  }
  std::lock_guard<std::mutex> lk(access_mu);
  std::ostream& out = access_file ? static_cast<std::ostream&>(*access_file) : std::cerr;
  out << line << '\n';
  out.flush();
}

}  // namespace gemstage::server
