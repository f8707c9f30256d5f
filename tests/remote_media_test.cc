// Remote media (serve --allow-remote-media): URL parsing, which addresses count as public, and
// fetches from a local HTTP server (allowed only as a private host), with redirects, size and time
// limits, and the chat parser's use of it for image_url and audio_url parts.
#include "server/remote_media.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "server/api.h"

namespace gemstage::server {
namespace {

using json = nlohmann::json;

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

const std::string kPng = std::string(GEMSTAGE_FIXTURES) + "/image/decode/rgb_interlaced.png";
const std::string kWav = std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny-audio/audio/audio.wav";

// The message of the Error fn throws, or "" when it throws none.
template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const Error& e) {  // ApiError too
    return e.what();
  }
  return "";
}

TEST(RemoteMedia, ParsesHttpUrls) {
  MediaUrl u = parse_media_url("http://example.com/a/b.png?x=1#frag");
  EXPECT_FALSE(u.https);
  EXPECT_EQ(u.host, "example.com");
  EXPECT_EQ(u.port, 80);
  EXPECT_EQ(u.target, "/a/b.png?x=1");
  u = parse_media_url("https://[2001:db8::1]:8443");
  EXPECT_TRUE(u.https);
  EXPECT_EQ(u.host, "2001:db8::1");
  EXPECT_EQ(u.port, 8443);
  EXPECT_EQ(u.target, "/");
  EXPECT_EQ(parse_media_url("https://h?q").target, "/?q");
  for (const char* bad : {"ftp://h/x", "http://user:pw@h/x", "http://h/a b", "http://h:0/",
                          "http://h:99999/", "http://h:8x/", "http:///x", "http://[::1/x"})
    EXPECT_NE(error_of([&] { parse_media_url(bad); }), "") << bad;
}

TEST(RemoteMedia, OnlyPublicAddressesArePublic) {
  for (const char* a :
       {"8.8.8.8", "172.32.0.1", "100.128.0.1", "1.1.1.1", "2606:4700::1111", "::ffff:8.8.8.8"})
    EXPECT_TRUE(is_public_address(a)) << a;
  for (const char* a :
       {"127.0.0.1",       "10.1.2.3",   "172.16.0.1", "172.31.255.255",   "192.168.1.1",
        "169.254.169.254", "100.64.0.1", "0.0.0.0",    "224.0.0.1",        "255.255.255.255",
        "192.0.2.1",       "::1",        "::",         "::ffff:127.0.0.1", "64:ff9b::a9fe:a9fe",
        "fe80::1",         "fd00::1",    "ff02::1",    "2001:db8::1",      "not an address"})
    EXPECT_FALSE(is_public_address(a)) << a;
}

// A local media server: /img.png, /redirect (to /img.png), /loop (to itself), /big, /slow, 404s.
class MediaServer {
 public:
  MediaServer() {
    png_ = read_file(kPng);
    wav_ = read_file(kWav);
    http_.Get("/img.png", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(png_, "image/png");
    });
    http_.Get("/clip.wav", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(wav_, "audio/wav");
    });
    http_.Get("/redirect", [](const httplib::Request&, httplib::Response& res) {
      res.set_redirect("/img.png");
    });
    http_.Get("/loop",
              [](const httplib::Request&, httplib::Response& res) { res.set_redirect("loop"); });
    http_.Get("/big", [](const httplib::Request&, httplib::Response& res) {
      res.set_content(std::string(4096, 'x'), "image/png");
    });
    http_.Get("/slow", [](const httplib::Request&, httplib::Response& res) {
      res.set_chunked_content_provider("image/png", [](size_t, httplib::DataSink& sink) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        return sink.write("x", 1);
      });
    });
    // Bound and listening here: connections queue until the thread accepts them.
    port_ = http_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { http_.listen_after_bind(); });
  }
  ~MediaServer() {
    http_.stop();
    thread_.join();
  }
  std::string url(const std::string& path) const {
    return "http://127.0.0.1:" + std::to_string(port_) + path;
  }
  const std::string& png() const { return png_; }

 private:
  httplib::Server http_;
  std::thread thread_;
  int port_ = 0;
  std::string png_, wav_;
};

TEST(RemoteMedia, FetchesWithinItsLimits) {
  MediaServer media;
  RemoteMediaOptions o;
  o.enabled = true;
  o.timeout_seconds = 5;
  // Loopback is private: refused, naming the address and the flag that allows it.
  const std::string refused = error_of([&] { fetch_remote_media(media.url("/img.png"), o); });
  EXPECT_NE(refused.find("127.0.0.1"), std::string::npos) << refused;
  EXPECT_NE(refused.find("--allow-remote-media-private"), std::string::npos) << refused;

  o.private_hosts = true;
  const std::vector<uint8_t> png = fetch_remote_media(media.url("/img.png"), o);
  EXPECT_EQ(std::string(png.begin(), png.end()), media.png());
  const std::vector<uint8_t> redirected = fetch_remote_media(media.url("/redirect"), o);
  EXPECT_EQ(std::string(redirected.begin(), redirected.end()), media.png());
  EXPECT_NE(error_of([&] { fetch_remote_media(media.url("/loop"), o); }).find("redirects"),
            std::string::npos);
  EXPECT_NE(error_of([&] { fetch_remote_media(media.url("/none"), o); }).find("HTTP 404"),
            std::string::npos);
  o.max_bytes = 1000;
  EXPECT_NE(error_of([&] { fetch_remote_media(media.url("/big"), o); }).find("larger than"),
            std::string::npos);
  o.timeout_seconds = 0.5;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NE(error_of([&] { fetch_remote_media(media.url("/slow"), o); }).find("within"),
            std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // A port nobody listens on: the library's reason, with the URL.
  EXPECT_NE(error_of([&] { fetch_remote_media("http://127.0.0.1:1/x", o); }).find("127.0.0.1:1"),
            std::string::npos);
}

TEST(RemoteMedia, ChatPartsFetchWhenTheServerAllowsIt) {
  MediaServer media;
  const auto body = [](const json& part) {
    return json{{"messages", {{{"role", "user"}, {"content", json::array({part})}}}}};
  };
  const json image = {{"type", "image_url"}, {"image_url", {{"url", media.url("/img.png")}}}};
  const json audio = {{"type", "audio_url"}, {"audio_url", {{"url", media.url("/clip.wav")}}}};
  RequestLimits limits;
  // Off by default: a 400 that names the flag.
  for (const json& part : {image, audio}) {
    const std::string e = error_of([&] { parse_chat_request(body(part), limits); });
    EXPECT_NE(e.find("--allow-remote-media"), std::string::npos) << e;
  }
  limits.remote_media.enabled = true;
  limits.remote_media.private_hosts = true;
  const ChatRequest with_image = parse_chat_request(body(image), limits);
  ASSERT_TRUE(with_image.messages[0].parts[0].image);
  EXPECT_EQ(with_image.messages[0].parts[0].image->width, 23);
  const ChatRequest with_audio = parse_chat_request(body(audio), limits);
  ASSERT_TRUE(with_audio.messages[0].parts[0].audio);
  EXPECT_GT(with_audio.messages[0].parts[0].audio->samples.size(), 0u);
  // A fetch that fails is a 400 on the part's URL, with the reason.
  try {
    parse_chat_request(
        body({{"type", "image_url"}, {"image_url", {{"url", media.url("/missing.png")}}}}), limits);
    ADD_FAILURE() << "a 404 image was accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "messages[0].content[0].image_url.url");
    EXPECT_EQ(e.code(), "invalid_image_url");
    EXPECT_NE(std::string(e.what()).find("HTTP 404"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace gemstage::server
