// Fetching a request's media from http(s) URLs, for a server started with --allow-remote-media.
//
// A server that fetches whatever URL a client names can be turned against the network it sits in
// (server-side request forgery), so fetching is off unless the operator turns it on, and even then:
// - every address the host name resolves to must be a public one (no loopback, private,
//   link-local, carrier-grade NAT, multicast or reserved ranges) unless private hosts are allowed
//   too, and the connection goes to the address that was checked (a second lookup could answer
//   differently);
// - redirects are followed by hand, at most a few, each target checked as the first was;
// - the body is bounded in bytes (Content-Length and the bytes as they arrive) and the whole fetch
//   in time, so a slow or endless reply cannot hold a handler thread;
// - https certificates are verified against the system's trust store.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gemstage::server {

struct RemoteMediaOptions {
  bool enabled = false;        // --allow-remote-media
  bool private_hosts = false;  // --allow-remote-media-private: loopback and private networks too
  int64_t max_bytes = int64_t{20} << 20;  // --remote-media-max-mb
  double timeout_seconds = 10;            // --remote-media-timeout, the whole fetch
  int max_redirects = 3;
};

// The parts of an http(s) URL a fetch needs; parse_media_url throws Error naming the URL's fault.
struct MediaUrl {
  bool https = false;
  std::string host;  // without brackets for an IPv6 literal
  int port = 0;
  std::string target;  // path and query, "/" at least
};
MediaUrl parse_media_url(const std::string& url);

// Whether a numeric IPv4 / IPv6 address is one a public fetch may reach.
bool is_public_address(const std::string& numeric_address);

// The body of a 200 reply to GET `url`, under `options`' limits. Throws Error with a message that
// names the URL and what went wrong (refused address, status, size, time, TLS).
std::vector<uint8_t> fetch_remote_media(const std::string& url, const RemoteMediaOptions& options);

}  // namespace gemstage::server
