// HTTP for the Hub through cpp-httplib (OpenSSL, the system CA store): URLs, proxies by the
// usual environment variables, redirects followed by hand so the Hub's token never leaves the
// Hub's own host (a CDN the Hub redirects to gets no Authorization header).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "hub/settings.h"

namespace gemstage::hub {

struct Url {
  std::string scheme;  // "http" or "https"
  std::string host;
  int port = 0;
  std::string target = "/";  // path and query, as sent on the request line

  // scheme://host:port, the part that decides where a token may go.
  std::string origin() const;
  std::string str() const;
};

// http(s)://host[:port][/target]; nullopt for anything else.
std::optional<Url> parse_url(std::string_view text);
// A Location header against the URL it answered: absolute, or relative to base's origin.
std::optional<Url> resolve_location(const Url& base, const std::string& location);
// Percent-encodes everything but RFC 3986's unreserved characters, and '/' when keep_slash.
std::string percent_encode(std::string_view s, bool keep_slash);

// Whether NO_PROXY (comma-separated hosts, ".suffix" or "suffix" domains, host:port, "*") says
// host goes direct.
bool bypasses_proxy(const std::string& host, int port, const std::string& no_proxy);
// The proxy URL a request to url goes through, or "" for a direct connection.
std::string proxy_for(const Url& url, const HubSettings& s);

struct HttpReply {
  int status = 0;  // 0: no HTTP answer at all (transport_error says why)
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
  std::string transport_error;  // connection refused, TLS failure, connection cut mid-body, ...
  Url url;                      // the URL that gave this answer (after redirects)

  std::string header(const std::string& lower_name) const;
};

class HttpClient {
 public:
  explicit HttpClient(const HubSettings& settings);

  // HEAD without following redirects to other hosts (a relative one, a renamed repository, is
  // followed): the Hub's answer for an LFS file is a redirect whose headers carry the metadata.
  HttpReply head(const std::string& url) const;
  // GET of a small reply (JSON), redirects followed, the body capped at max_body bytes.
  HttpReply get(const std::string& url, size_t max_body) const;
  // GET streamed: from byte range_start on (a Range request when > 0), redirects followed.
  // on_answer sees each final answer's status and headers before its body and returns false to
  // refuse the body; on_data gets the body in pieces and returns false to stop.
  HttpReply get_stream(const std::string& url, uint64_t range_start,
                       const std::function<bool(const HttpReply&)>& on_answer,
                       const std::function<bool(const char*, size_t)>& on_data) const;

  const Url& endpoint() const { return endpoint_; }

 private:
  std::map<std::string, std::string> headers_for(const Url& url) const;

  HubSettings settings_;
  Url endpoint_;
};

}  // namespace gemstage::hub
