#include "hub/http.h"

#include <httplib.h>

#include <algorithm>
#include <cctype>
#include <memory>

#include "core/error.h"

namespace gemstage::hub {

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string trim(const std::string& s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return s.substr(a, b - a);
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string percent_decode(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && hex_value(s[i + 1]) >= 0 && hex_value(s[i + 2]) >= 0) {
      out += static_cast<char>(hex_value(s[i + 1]) * 16 + hex_value(s[i + 2]));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

// A proxy as the variables write it: [http://][user:password@]host[:port].
struct ProxySpec {
  std::string host, user, password;
  int port = 0;
};

ProxySpec parse_proxy(const std::string& text) {
  std::string rest = text;
  const size_t scheme_end = rest.find("://");
  if (scheme_end != std::string::npos) {
    const std::string scheme = lower(rest.substr(0, scheme_end));
    if (scheme != "http")
      fail("the proxy ", text, " is a ", scheme,
           ":// proxy; gemstage talks to proxies over plain http:// (HTTPS is tunnelled through "
           "them with CONNECT)");
    rest = rest.substr(scheme_end + 3);
  }
  rest = rest.substr(0, rest.find('/'));
  ProxySpec p;
  if (const size_t at = rest.rfind('@'); at != std::string::npos) {
    const std::string cred = rest.substr(0, at);
    rest = rest.substr(at + 1);
    const size_t colon = cred.find(':');
    p.user = percent_decode(cred.substr(0, colon));
    if (colon != std::string::npos) p.password = percent_decode(cred.substr(colon + 1));
  }
  p.port = 80;
  if (const size_t colon = rest.rfind(':'); colon != std::string::npos) {
    try {
      p.port = std::stoi(rest.substr(colon + 1));
    } catch (const std::exception&) {
      fail("the proxy ", text, " has no valid port");
    }
    rest = rest.substr(0, colon);
  }
  if (rest.empty()) fail("the proxy ", text, " names no host");
  p.host = rest;
  return p;
}

std::string describe(httplib::Error e, const Url& url, const std::string& proxy) {
  const std::string where = url.host + ":" + std::to_string(url.port);
  std::string what;
  switch (e) {
    case httplib::Error::Connection:
      what = "could not connect to " + where;
      break;
    case httplib::Error::ConnectionTimeout:
      what = "connecting to " + where + " timed out";
      break;
    case httplib::Error::Read:
      what = "the connection to " + where + " broke while reading its answer";
      break;
    case httplib::Error::Write:
      what = "the connection to " + where + " broke while sending the request";
      break;
    case httplib::Error::SSLConnection:
      what = "the TLS handshake with " + where + " failed";
      break;
    case httplib::Error::SSLLoadingCerts:
      what = "the system CA certificates could not be loaded (SSL_CERT_FILE / SSL_CERT_DIR)";
      break;
    case httplib::Error::SSLServerVerification:
      what = "the TLS certificate of " + url.host +
             " could not be verified against the system CA store (SSL_CERT_FILE or "
             "SSL_CERT_DIR name another one)";
      break;
    default:
      what = "request to " + where + " failed (" + httplib::to_string(e) + ")";
  }
  if (!proxy.empty()) what += " (through the proxy " + proxy + ")";
  return what;
}

void capture(const httplib::Response& res, HttpReply& out) {
  out.status = res.status;
  out.headers.clear();
  for (const auto& [k, v] : res.headers) out.headers.emplace(lower(k), v);
}

httplib::Headers to_httplib(const std::map<std::string, std::string>& h) {
  httplib::Headers out;
  for (const auto& [k, v] : h) out.emplace(k, v);
  return out;
}

std::unique_ptr<httplib::Client> make_client(const Url& url, const HubSettings& s,
                                             std::string* proxy_used) {
  auto cli = std::make_unique<httplib::Client>(url.scheme + "://" + url.host + ":" +
                                               std::to_string(url.port));
  cli->set_connection_timeout(s.connect_timeout_seconds);
  cli->set_read_timeout(s.read_timeout_seconds);
  cli->set_write_timeout(s.read_timeout_seconds);
  cli->set_follow_location(false);  // redirects are followed by hand (the token rule)
  cli->set_url_encode(false);       // targets are percent-encoded already
  cli->set_keep_alive(false);
  cli->enable_server_certificate_verification(true);
  const std::string proxy = proxy_for(url, s);
  if (!proxy.empty()) {
    const ProxySpec p = parse_proxy(proxy);
    cli->set_proxy(p.host, p.port);
    if (!p.user.empty()) cli->set_proxy_basic_auth(p.user, p.password);
  }
  if (proxy_used) *proxy_used = proxy;
  return cli;
}

bool is_redirect(int status) {
  return status == 301 || status == 302 || status == 303 || status == 307 || status == 308;
}

constexpr int kMaxRedirects = 10;

}  // namespace

std::string Url::origin() const {
  return scheme + "://" + host + ":" + std::to_string(port);
}

std::string Url::str() const {
  const bool default_port = (scheme == "http" && port == 80) || (scheme == "https" && port == 443);
  return scheme + "://" + host + (default_port ? "" : ":" + std::to_string(port)) + target;
}

std::optional<Url> parse_url(std::string_view text) {
  const size_t sep = text.find("://");
  if (sep == std::string_view::npos) return std::nullopt;
  Url u;
  u.scheme = lower(std::string(text.substr(0, sep)));
  if (u.scheme != "http" && u.scheme != "https") return std::nullopt;
  std::string_view rest = text.substr(sep + 3);
  const size_t end = rest.find_first_of("/?#");
  std::string authority(rest.substr(0, end));
  if (authority.find('@') != std::string::npos) return std::nullopt;  // no credentials in URLs
  u.port = u.scheme == "https" ? 443 : 80;
  const size_t colon = authority.rfind(':');
  if (colon != std::string::npos && authority.find(']') == std::string::npos) {
    const std::string port = authority.substr(colon + 1);
    if (port.empty() || port.size() > 5 ||
        !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return std::nullopt;
    u.port = std::stoi(port);
    if (u.port <= 0 || u.port > 65535) return std::nullopt;
    authority = authority.substr(0, colon);
  }
  if (authority.empty()) return std::nullopt;
  u.host = lower(authority);
  if (end != std::string_view::npos) {
    std::string target(rest.substr(end));
    if (const size_t hash = target.find('#'); hash != std::string::npos) target.resize(hash);
    if (target.empty() || target[0] != '/') target = "/" + target;
    u.target = target;
  }
  for (char c : u.target)
    if (static_cast<unsigned char>(c) <= 0x20 || static_cast<unsigned char>(c) >= 0x7f)
      return std::nullopt;  // a request line must not carry these
  return u;
}

std::optional<Url> resolve_location(const Url& base, const std::string& location) {
  if (location.find("://") != std::string::npos) return parse_url(location);
  if (location.rfind("//", 0) == 0) return parse_url(base.scheme + ":" + location);
  if (location.empty()) return std::nullopt;
  Url u = base;
  if (location[0] == '/') {
    u.target = location;
  } else {
    std::string dir = base.target.substr(0, base.target.find('?'));
    dir = dir.substr(0, dir.rfind('/') + 1);
    u.target = dir + location;
  }
  return parse_url(u.scheme + "://" + u.host + ":" + std::to_string(u.port) + u.target);
}

std::string percent_encode(std::string_view s, bool keep_slash) {
  static constexpr char digits[] = "0123456789ABCDEF";
  std::string out;
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (std::isalnum(c) || c == '-' || c == '.' || c == '_' || c == '~' ||
        (keep_slash && c == '/')) {
      out += ch;
    } else {
      out += '%';
      out += digits[c >> 4];
      out += digits[c & 15];
    }
  }
  return out;
}

bool bypasses_proxy(const std::string& host_in, int port, const std::string& no_proxy) {
  const std::string host = lower(host_in);
  size_t start = 0;
  while (start <= no_proxy.size()) {
    size_t end = no_proxy.find_first_of(", ", start);
    if (end == std::string::npos) end = no_proxy.size();
    std::string entry = lower(trim(no_proxy.substr(start, end - start)));
    start = end + 1;
    if (entry.empty()) continue;
    if (entry == "*") return true;
    if (entry.rfind("*.", 0) == 0) entry = entry.substr(1);
    int entry_port = 0;
    if (const size_t colon = entry.rfind(':');
        colon != std::string::npos && entry.find(']') == std::string::npos) {
      try {
        entry_port = std::stoi(entry.substr(colon + 1));
      } catch (const std::exception&) {
        continue;
      }
      entry = entry.substr(0, colon);
    }
    if (entry_port != 0 && entry_port != port) continue;
    if (!entry.empty() && entry[0] == '.') entry = entry.substr(1);
    if (host == entry) return true;
    if (host.size() > entry.size() &&
        host.compare(host.size() - entry.size(), entry.size(), entry) == 0 &&
        host[host.size() - entry.size() - 1] == '.')
      return true;
  }
  return false;
}

std::string proxy_for(const Url& url, const HubSettings& s) {
  const std::string& proxy = url.scheme == "https" ? s.https_proxy : s.http_proxy;
  if (proxy.empty() || bypasses_proxy(url.host, url.port, s.no_proxy)) return "";
  return proxy;
}

std::string HttpReply::header(const std::string& lower_name) const {
  const auto it = headers.find(lower_name);
  return it == headers.end() ? "" : it->second;
}

HttpClient::HttpClient(const HubSettings& settings) : settings_(settings) {
  const auto e = parse_url(settings.endpoint);
  if (!e) fail("HF_ENDPOINT '", settings.endpoint, "' is not an http:// or https:// URL");
  endpoint_ = *e;
}

std::map<std::string, std::string> HttpClient::headers_for(const Url& url) const {
  std::map<std::string, std::string> h;
  h["User-Agent"] = "gemstage (huggingface_hub cache compatible)";
  // The real size and bytes of a file, never a compressed form of it.
  h["Accept-Encoding"] = "identity";
  // The token goes to the Hub's own origin only: a CDN it redirects to gets a signed URL instead.
  if (!settings_.token.empty() && url.origin() == endpoint_.origin())
    h["Authorization"] = "Bearer " + settings_.token;
  return h;
}

HttpReply HttpClient::head(const std::string& url_text) const {
  auto u = parse_url(url_text);
  if (!u) fail("not an http(s) URL: ", url_text);
  for (int hop = 0; hop <= kMaxRedirects; ++hop) {
    std::string proxy;
    auto cli = make_client(*u, settings_, &proxy);
    auto res = cli->Head(u->target, to_httplib(headers_for(*u)));
    HttpReply r;
    r.url = *u;
    if (!res) {
      r.transport_error = describe(res.error(), *u, proxy);
      return r;
    }
    capture(*res, r);
    const std::string loc = r.header("location");
    // Only a relative redirect (a renamed repository) is followed; an absolute one points at the
    // content on a CDN and is what the caller wants to see.
    if (is_redirect(r.status) && !loc.empty() && loc.find("://") == std::string::npos &&
        loc.rfind("//", 0) != 0) {
      u = resolve_location(*u, loc);
      if (!u) fail("the Hub redirected ", url_text, " to an unusable Location '", loc, "'");
      continue;
    }
    return r;
  }
  fail("more than ", kMaxRedirects, " redirects from ", url_text);
}

HttpReply HttpClient::get(const std::string& url_text, size_t max_body) const {
  auto u = parse_url(url_text);
  if (!u) fail("not an http(s) URL: ", url_text);
  for (int hop = 0; hop <= kMaxRedirects; ++hop) {
    std::string proxy;
    auto cli = make_client(*u, settings_, &proxy);
    HttpReply r;
    r.url = *u;
    bool too_big = false;
    auto res = cli->Get(
        u->target, to_httplib(headers_for(*u)),
        [&](const httplib::Response& resp) {
          capture(resp, r);
          return true;
        },
        [&](const char* data, size_t n) {
          if (r.body.size() + n > max_body) {
            too_big = true;
            return false;
          }
          r.body.append(data, n);
          return true;
        });
    if (too_big) fail("the answer of ", u->str(), " is larger than ", max_body, " bytes");
    if (!res) {
      r.transport_error = describe(res.error(), *u, proxy);
      return r;
    }
    if (is_redirect(r.status) && !r.header("location").empty()) {
      u = resolve_location(*u, r.header("location"));
      if (!u) fail("unusable redirect from ", url_text);
      continue;
    }
    return r;
  }
  fail("more than ", kMaxRedirects, " redirects from ", url_text);
}

HttpReply HttpClient::get_stream(const std::string& url_text, uint64_t range_start,
                                 const std::function<bool(const HttpReply&)>& on_answer,
                                 const std::function<bool(const char*, size_t)>& on_data) const {
  auto u = parse_url(url_text);
  if (!u) fail("not an http(s) URL: ", url_text);
  for (int hop = 0; hop <= kMaxRedirects; ++hop) {
    std::string proxy;
    auto cli = make_client(*u, settings_, &proxy);
    auto headers = headers_for(*u);
    if (range_start > 0) headers["Range"] = "bytes=" + std::to_string(range_start) + "-";
    HttpReply r;
    r.url = *u;
    bool redirect = false, refused = false, stopped = false;
    auto res = cli->Get(
        u->target, to_httplib(headers),
        [&](const httplib::Response& resp) {
          capture(resp, r);
          if (is_redirect(r.status)) {
            redirect = true;
            return false;
          }
          if (!on_answer(r)) {
            refused = true;
            return false;
          }
          return true;
        },
        [&](const char* data, size_t n) {
          if (!on_data(data, n)) {
            stopped = true;
            return false;
          }
          return true;
        });
    if (redirect) {
      u = resolve_location(*u, r.header("location"));
      if (!u) fail("unusable redirect from ", url_text, " ('", r.header("location"), "')");
      continue;
    }
    if (!res && !refused && !stopped) r.transport_error = describe(res.error(), *u, proxy);
    return r;
  }
  fail("more than ", kMaxRedirects, " redirects from ", url_text);
}

}  // namespace gemstage::hub
