// What the in-process server tests share: the tiny fixture's options, starting a server and
// waiting for its model, and a client for it.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "server/server.h"
#include "test_util.h"

namespace gemstage::testing {

// Sanitizer builds run the model several times slower; their waits stretch by this much.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr int kSlow = 10;
#else
inline constexpr int kSlow = 1;
#endif

// The tiny fixture model on a free port: two slots, two threads, 16 tokens a reply by default.
inline server::ServerOptions tiny_server_options() {
  server::ServerOptions o;
  o.model_path = fixture("model");
  o.port = 0;
  o.parallel = 2;
  o.threads = 2;
  o.defaults.max_tokens = 16;
  o.shutdown_grace_seconds = 1;
  return o;
}

// A started server whose model has loaded (a failed load fails the test).
inline std::unique_ptr<server::Server> start_server(server::ServerOptions o) {
  auto s = std::make_unique<server::Server>(std::move(o));
  s->start();
  EXPECT_TRUE(s->wait_loaded()) << s->load_error();
  return s;
}

inline httplib::Client server_client(const server::Server& s) {
  httplib::Client c("127.0.0.1", s.port());
  c.set_read_timeout(60 * kSlow, 0);
  return c;
}

inline httplib::Result post_json(const server::Server& s, const std::string& path,
                                 const nlohmann::json& body, const httplib::Headers& headers = {}) {
  return server_client(s).Post(path.c_str(), headers, body.dump(), "application/json");
}

// The parsed body of a request that must answer 200 (anything else fails the test).
inline nlohmann::json post_ok(const server::Server& s, const std::string& path,
                              const nlohmann::json& body) {
  auto r = post_json(s, path, body);
  EXPECT_TRUE(r) << path;
  if (!r) return nlohmann::json();
  EXPECT_EQ(r->status, 200) << path << ": " << r->body;
  return nlohmann::json::parse(r->body);
}

}  // namespace gemstage::testing
