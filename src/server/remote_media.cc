#include "server/remote_media.h"

#include <arpa/inet.h>
#include <httplib.h>
#include <netdb.h>
#include <sys/socket.h>

#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>

#include "core/error.h"

namespace gemstage::server {

namespace {

bool is_public_v4(const uint8_t a[4]) {
  const uint32_t x = (uint32_t{a[0]} << 24) | (uint32_t{a[1]} << 16) | (uint32_t{a[2]} << 8) | a[3];
  struct Range {
    uint32_t base;
    int bits;
  };
  // The IANA special-purpose ranges no public fetch should reach.
  static constexpr std::array<Range, 13> kNotPublic = {{
      {0x00000000, 8},   // "this" network
      {0x0A000000, 8},   // private
      {0x64400000, 10},  // carrier-grade NAT
      {0x7F000000, 8},   // loopback
      {0xA9FE0000, 16},  // link-local (cloud metadata services live here)
      {0xAC100000, 12},  // private
      {0xC0000000, 24},  // IETF protocol assignments
      {0xC0000200, 24},  // documentation
      {0xC0A80000, 16},  // private
      {0xC6120000, 15},  // benchmarking
      {0xC6336400, 24},  // documentation
      {0xCB007100, 24},  // documentation
      {0xE0000000, 3},   // multicast and reserved, broadcast included
  }};
  for (const Range& r : kNotPublic)
    if ((x >> (32 - r.bits)) == (r.base >> (32 - r.bits))) return false;
  return true;
}

bool is_public_v6(const uint8_t a[16]) {
  static constexpr uint8_t kZero[16] = {};
  if (std::memcmp(a, kZero, 15) == 0 && (a[15] == 0 || a[15] == 1)) return false;  // :: and ::1
  // IPv4-mapped (::ffff:a.b.c.d) and NAT64 (64:ff9b::a.b.c.d): the IPv4 address decides.
  static constexpr uint8_t kMapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
  static constexpr uint8_t kNat64[12] = {0, 0x64, 0xff, 0x9b, 0, 0, 0, 0, 0, 0, 0, 0};
  if (std::memcmp(a, kMapped, 12) == 0 || std::memcmp(a, kNat64, 12) == 0)
    return is_public_v4(a + 12);
  if ((a[0] & 0xfe) == 0xfc) return false;                  // unique local fc00::/7
  if (a[0] == 0xfe && (a[1] & 0xc0) == 0x80) return false;  // link-local fe80::/10
  if (a[0] == 0xfe && (a[1] & 0xc0) == 0xc0) return false;  // site-local fec0::/10
  if (a[0] == 0xff) return false;                           // multicast
  if (a[0] == 0x20 && a[1] == 0x01 && a[2] == 0x0d && a[3] == 0xb8) return false;  // docs
  return true;
}

// The numeric addresses `host` resolves to.
std::vector<std::string> resolve(const std::string& host, const std::string& url) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (const int rc = getaddrinfo(host.c_str(), nullptr, &hints, &found); rc != 0)
    fail("cannot fetch ", url, ": the host name '", host, "' does not resolve (", gai_strerror(rc),
         ")");
  std::unique_ptr<addrinfo, decltype(&freeaddrinfo)> hold(found, freeaddrinfo);
  std::vector<std::string> out;
  for (const addrinfo* ai = found; ai; ai = ai->ai_next) {
    char text[INET6_ADDRSTRLEN] = {};
    const void* raw =
        ai->ai_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(ai->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(ai->ai_addr)->sin6_addr);
    if ((ai->ai_family == AF_INET || ai->ai_family == AF_INET6) &&
        inet_ntop(ai->ai_family, raw, text, sizeof(text)))
      out.emplace_back(text);
  }
  if (out.empty()) fail("cannot fetch ", url, ": '", host, "' has no IPv4 or IPv6 address");
  return out;
}

// Where a redirect's Location points, relative to the URL that answered it.
std::string resolve_location(const MediaUrl& from, const std::string& location) {
  if (location.rfind("http://", 0) == 0 || location.rfind("https://", 0) == 0) return location;
  const std::string host =
      from.host.find(':') != std::string::npos ? "[" + from.host + "]" : from.host;
  const std::string origin =
      std::string(from.https ? "https://" : "http://") + host + ":" + std::to_string(from.port);
  if (location.rfind("//", 0) == 0) return std::string(from.https ? "https:" : "http:") + location;
  if (!location.empty() && location[0] == '/') return origin + location;
  // Relative to the directory of the answering path.
  const std::string path = from.target.substr(0, from.target.find('?'));
  return origin + path.substr(0, path.rfind('/') + 1) + location;
}

}  // namespace

MediaUrl parse_media_url(const std::string& url) {
  MediaUrl u;
  size_t at;
  if (url.rfind("https://", 0) == 0) {
    u.https = true;
    at = 8;
  } else if (url.rfind("http://", 0) == 0) {
    at = 7;
  } else {
    fail("'", url, "' is not an http:// or https:// URL");
  }
  for (unsigned char c : url)
    if (c <= 0x20 || c >= 0x7f)
      fail("the URL '", url,
           "' holds a space, a control character or a non-ASCII byte; "
           "percent-encode it");
  const size_t end = url.find_first_of("/?#", at);
  const std::string authority = url.substr(at, end == std::string::npos ? end : end - at);
  if (authority.find('@') != std::string::npos)
    fail("the URL '", url, "' carries credentials (user@host), which are not sent");
  std::string port_text;
  if (!authority.empty() && authority[0] == '[') {
    const size_t close = authority.find(']');
    if (close == std::string::npos) fail("the URL '", url, "' has an unclosed IPv6 literal");
    u.host = authority.substr(1, close - 1);
    const std::string rest = authority.substr(close + 1);
    if (!rest.empty()) {
      if (rest[0] != ':') fail("the URL '", url, "' has text after its IPv6 literal");
      port_text = rest.substr(1);
    }
  } else {
    const size_t colon = authority.find(':');
    u.host = authority.substr(0, colon);
    if (colon != std::string::npos) port_text = authority.substr(colon + 1);
  }
  if (u.host.empty()) fail("the URL '", url, "' names no host");
  u.port = u.https ? 443 : 80;
  if (!port_text.empty()) {
    if (port_text.size() > 5 || port_text.find_first_not_of("0123456789") != std::string::npos)
      fail("the URL '", url, "' has an invalid port '", port_text, "'");
    u.port = std::stoi(port_text);
    if (u.port < 1 || u.port > 65535) fail("the URL '", url, "' has a port outside 1-65535");
  }
  u.target = end == std::string::npos || url[end] == '#' ? "/" : url.substr(end);
  if (const size_t hash = u.target.find('#'); hash != std::string::npos) u.target.resize(hash);
  if (u.target[0] == '?') u.target = "/" + u.target;
  return u;
}

bool is_public_address(const std::string& numeric_address) {
  uint8_t raw[16];
  if (inet_pton(AF_INET, numeric_address.c_str(), raw) == 1) return is_public_v4(raw);
  if (inet_pton(AF_INET6, numeric_address.c_str(), raw) == 1) return is_public_v6(raw);
  return false;
}

std::vector<uint8_t> fetch_remote_media(const std::string& first_url,
                                        const RemoteMediaOptions& options) {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(options.timeout_seconds));
  std::string url = first_url;
  for (int hop = 0;; ++hop) {
    const MediaUrl u = parse_media_url(url);
    const std::vector<std::string> addresses = resolve(u.host, url);
    if (!options.private_hosts)
      for (const std::string& a : addresses)
        if (!is_public_address(a))
          fail("cannot fetch ", url, ": '", u.host, "' resolves to ", a,
               ", a loopback, private, link-local or reserved address; the server fetches only "
               "from public addresses unless started with --allow-remote-media-private");
    const bool v6 = u.host.find(':') != std::string::npos;
    httplib::Client client(std::string(u.https ? "https://" : "http://") +
                           (v6 ? "[" + u.host + "]" : u.host) + ":" + std::to_string(u.port));
    // Connect to the address checked above, not to whatever a second lookup would say.
    if (!v6) client.set_hostname_addr_map({{u.host, addresses.front()}});
    const auto left =
        std::chrono::duration_cast<std::chrono::microseconds>(deadline - Clock::now());
    if (left.count() <= 0)
      fail("cannot fetch ", first_url, ": no answer within ", options.timeout_seconds, " s");
    client.set_connection_timeout(left);
    client.set_read_timeout(left);
    client.set_write_timeout(left);
    client.set_follow_location(false);
    client.enable_server_certificate_verification(true);
    int status = 0;
    std::string location;
    bool too_big = false, too_slow = false;
    std::vector<uint8_t> body;
    const auto res = client.Get(
        u.target, httplib::Headers{{"User-Agent", "gemstage"}, {"Accept", "image/*, audio/*, */*"}},
        [&](const httplib::Response& r) {
          status = r.status;
          if (status >= 300 && status < 400) location = r.get_header_value("Location");
          if (status != 200) return false;
          const std::string length = r.get_header_value("Content-Length");
          if (!length.empty() && length.size() < 19 &&
              length.find_first_not_of("0123456789") == std::string::npos &&
              std::stoll(length) > options.max_bytes)
            too_big = true;
          return !too_big;
        },
        [&](const char* data, size_t n) {
          if (static_cast<int64_t>(body.size() + n) > options.max_bytes) {
            too_big = true;
            return false;
          }
          if (Clock::now() > deadline) {
            too_slow = true;
            return false;
          }
          body.insert(body.end(), data, data + n);
          return true;
        });
    if (too_big)
      fail("cannot fetch ", first_url, ": the reply is larger than the server's limit of ",
           options.max_bytes, " bytes (--remote-media-max-mb)");
    if (too_slow || (!res && Clock::now() > deadline))
      fail("cannot fetch ", first_url, ": no whole reply within ", options.timeout_seconds,
           " s (--remote-media-timeout)");
    if (status >= 300 && status < 400 && !location.empty()) {
      if (hop >= options.max_redirects)
        fail("cannot fetch ", first_url, ": more than ", options.max_redirects, " redirects");
      url = resolve_location(u, location);
      continue;
    }
    if (!res && status == 0) {
      std::string why = httplib::to_string(res.error());
      if (u.https && res.error() == httplib::Error::SSLServerVerification)
        why += " (the certificate is not trusted by this machine)";
      fail("cannot fetch ", url, ": ", why);
    }
    if (status != 200) fail("cannot fetch ", url, ": the server answered HTTP ", status);
    if (body.empty()) fail("cannot fetch ", url, ": the reply has no body");
    return body;
  }
}

}  // namespace gemstage::server
