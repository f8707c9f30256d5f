// A Hugging Face Hub in the test process (issue 47): the endpoints the downloader uses, on
// 127.0.0.1, with the large files behind a redirect to a second server standing in for the CDN.
// It follows the Hub's answers as docs/hf-hub.md describes them (model info at a revision, HEAD
// and GET on resolve/, X-Repo-Commit, X-Linked-Etag / X-Linked-Size, 302 + Location for LFS
// files, X-Error-Code on errors) and can cut, corrupt, refuse or hold transfers on request.
// Hashes here come from OpenSSL's one-shot functions, not from src/hub.
#pragma once

#include <gtest/gtest.h>
#include <httplib.h>
#include <openssl/sha.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace gemstage::testing {

inline std::string hex_of(const unsigned char* d, size_t n) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += digits[d[i] >> 4];
    s += digits[d[i] & 15];
  }
  return s;
}
inline std::string test_sha256(const std::string& data) {
  unsigned char d[SHA256_DIGEST_LENGTH];
  SHA256(reinterpret_cast<const unsigned char*>(data.data()), data.size(), d);
  return hex_of(d, sizeof d);
}
// git's blob id: sha1("blob <size>\0" + data).
inline std::string test_git_sha1(const std::string& data) {
  const std::string obj = "blob " + std::to_string(data.size()) + std::string(1, '\0') + data;
  unsigned char d[SHA_DIGEST_LENGTH];
  SHA1(reinterpret_cast<const unsigned char*>(obj.data()), obj.size(), d);
  return hex_of(d, sizeof d);
}
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
// Whether the file at path holds exactly `want` (a short message instead of a diff of megabytes).
inline ::testing::AssertionResult file_holds(const std::string& path, const std::string& want) {
  const std::string got = read_bytes(path);
  if (got == want) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return ::testing::AssertionFailure()
         << path << " holds " << got.size() << " bytes, " << want.size()
         << " expected; first difference at byte " << i;
}

// A 40-hex commit id made from a label.
inline std::string test_commit(const std::string& label) {
  return test_git_sha1("commit " + label);
}

// The Hub keeps *.safetensors (and other large formats) in LFS; the rest in git.
inline bool fake_is_lfs(const std::string& path) {
  auto ends = [&](const std::string& s) {
    return path.size() >= s.size() && path.compare(path.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".safetensors") || ends(".bin") || ends(".gguf") || ends(".onnx");
}

// A snapshot of the files of model_dir as huggingface_hub's hf_hub_download / snapshot_download
// leave it in the cache (docs/hf-hub.md "Cache layout"), written by hand: blobs named by etag
// (sha256 for LFS files, else the git blob sha1), relative links from snapshots/<commit>,
// refs/main holding the bare commit, a .no_exist marker and the repository's lock folder.
// Returns the snapshot folder.
inline std::filesystem::path write_hf_cache_snapshot(const std::string& cache,
                                                     const std::string& repo_id,
                                                     const std::string& model_dir,
                                                     const std::string& commit) {
  namespace fs = std::filesystem;
  const std::string folder = "models--" + repo_id.substr(0, repo_id.find('/')) + "--" +
                             repo_id.substr(repo_id.find('/') + 1);
  const fs::path repo = fs::path(cache) / folder;
  fs::create_directories(repo / "blobs");
  fs::create_directories(repo / "refs");
  fs::create_directories(repo / "snapshots" / commit);
  fs::create_directories(repo / ".no_exist" / commit);
  std::ofstream(repo / ".no_exist" / commit / "chat_template.jinja").close();
  for (const auto& entry : fs::directory_iterator(model_dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string name = entry.path().filename().string();
    const std::string bytes = read_bytes(entry.path().string());
    const std::string etag = fake_is_lfs(name) ? test_sha256(bytes) : test_git_sha1(bytes);
    std::ofstream(repo / "blobs" / etag, std::ios::binary) << bytes;
    fs::create_symlink("../../blobs/" + etag, repo / "snapshots" / commit / name);
  }
  std::ofstream(repo / "refs" / "main", std::ios::binary) << commit;
  fs::create_directories(fs::path(cache) / ".locks" / folder);
  return repo / "snapshots" / commit;
}

struct FakeRepo {
  std::map<std::string, std::string> branches;                        // name -> commit
  std::map<std::string, std::map<std::string, std::string>> commits;  // commit -> path -> bytes
  bool gated = false;
  std::string accepted_token;              // the token whose account accepted the licence
  std::vector<std::string> phantom_files;  // listed by the API, missing on resolve/ (404)
};

class FakeHub {
 public:
  struct FileStats {
    int heads = 0, gets = 0;
    uint64_t bytes = 0;               // body bytes sent
    std::vector<std::string> ranges;  // each GET's Range header ("" for none)
  };

  // tls: serve https with this certificate and key (both servers).
  explicit FakeHub(X509* cert = nullptr, EVP_PKEY* key = nullptr) {
    if (cert) {
      hub_ = std::make_unique<httplib::SSLServer>(cert, key);
      cdn_ = std::make_unique<httplib::SSLServer>(cert, key);
      scheme_ = "https";
    } else {
      hub_ = std::make_unique<httplib::Server>();
      cdn_ = std::make_unique<httplib::Server>();
    }
    hub_->Get(R"(/api/models/([^/]+)/([^/]+)/revision/(.+))",
              [this](const httplib::Request& q, httplib::Response& r) { api_revision(q, r); });
    hub_->Get(R"(/([^/]+)/([^/]+)/resolve/([^/]+)/(.+))",
              [this](const httplib::Request& q, httplib::Response& r) { resolve(q, r); });
    cdn_->Get(R"(/blobs/([0-9a-f]{64}))",
              [this](const httplib::Request& q, httplib::Response& r) { cdn_blob(q, r); });
    hub_port_ = hub_->bind_to_any_port("127.0.0.1");
    cdn_port_ = cdn_->bind_to_any_port("127.0.0.1");
    hub_thread_ = std::thread([this] { hub_->listen_after_bind(); });
    cdn_thread_ = std::thread([this] { cdn_->listen_after_bind(); });
    while (!hub_->is_running() || !cdn_->is_running())
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ~FakeHub() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      holds_.clear();
    }
    cv_.notify_all();
    hub_->stop();
    cdn_->stop();
    hub_thread_.join();
    cdn_thread_.join();
  }
  FakeHub(const FakeHub&) = delete;
  FakeHub& operator=(const FakeHub&) = delete;

  std::string endpoint() const { return scheme_ + "://127.0.0.1:" + std::to_string(hub_port_); }
  int hub_port() const { return hub_port_; }

  void add_repo(const std::string& id, FakeRepo repo) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [commit, files] : repo.commits)
      for (const auto& [path, bytes] : files)
        blobs_.emplace(test_sha256(bytes), std::make_pair(path, bytes));
    repos_[id] = std::move(repo);
  }

  // Faults, by repository file path.
  // The next `times` GETs of path stop after `at` bytes of the file (counted from its start).
  void cut(const std::string& path, uint64_t at, int times = 1) {
    std::lock_guard<std::mutex> lock(mu_);
    cuts_[path] = {at, times};
  }
  // The next `times` GETs of path answer `status` (a 503: the server is down for now).
  void refuse(const std::string& path, int status, int times) {
    std::lock_guard<std::mutex> lock(mu_);
    refusals_[path] = {status, times};
  }
  // Every copy of path served flips the byte at offset until cleared (offset < 0).
  void corrupt(const std::string& path, int64_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    if (offset < 0)
      corrupt_.erase(path);
    else
      corrupt_[path] = static_cast<uint64_t>(offset);
  }
  // GETs of path wait (up to timeout) until path had `heads` HEAD requests.
  void hold_until_heads(const std::string& path, int heads) {
    std::lock_guard<std::mutex> lock(mu_);
    holds_[path] = heads;
  }
  // Each GET of a *.safetensors file waits (up to timeout) until n of them are in flight at once.
  void hold_until_in_flight(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_goal_ = n;
  }

  FileStats stats(const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_[path];
  }
  int requests() {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }
  int max_in_flight() {
    std::lock_guard<std::mutex> lock(mu_);
    return max_in_flight_;
  }
  // Authorization headers the CDN received (must stay empty: the token is for the Hub only).
  std::vector<std::string> cdn_authorizations() {
    std::lock_guard<std::mutex> lock(mu_);
    return cdn_auth_;
  }
  std::vector<std::string> hub_authorizations() {
    std::lock_guard<std::mutex> lock(mu_);
    return hub_auth_;
  }
  std::set<std::string> paths_requested() {
    std::lock_guard<std::mutex> lock(mu_);
    std::set<std::string> s;
    for (const auto& [p, st] : stats_)
      if (st.heads + st.gets > 0) s.insert(p);
    return s;
  }
  void reset_stats() {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.clear();
    requests_ = 0;
    max_in_flight_ = 0;
    cdn_auth_.clear();
    hub_auth_.clear();
  }

 private:
  static void error(httplib::Response& r, int status, const std::string& code,
                    const std::string& message) {
    r.status = status;
    if (!code.empty()) r.set_header("X-Error-Code", code);
    r.set_header("X-Error-Message", message);
    r.set_content(nlohmann::json{{"error", message}}.dump(), "application/json");
  }

  // The repository and the commit a revision names, or an error answer (false).
  bool find(const std::string& id, const std::string& rev, const httplib::Request& q,
            httplib::Response& r, FakeRepo** repo, std::string* commit) {
    auto it = repos_.find(id);
    if (it == repos_.end()) {
      // Without a token the Hub cannot tell a missing repository from a private one: 401.
      error(r, q.has_header("Authorization") ? 404 : 401, "RepoNotFound", "Repository not found");
      return false;
    }
    *repo = &it->second;
    if (auto b = it->second.branches.find(rev); b != it->second.branches.end()) {
      *commit = b->second;
    } else if (it->second.commits.count(rev)) {
      *commit = rev;
    } else {
      error(r, 404, "RevisionNotFound", "Invalid rev id: " + rev);
      return false;
    }
    return true;
  }

  void api_revision(const httplib::Request& q, httplib::Response& r) {
    std::lock_guard<std::mutex> lock(mu_);
    ++requests_;
    FakeRepo* repo = nullptr;
    std::string commit;
    if (!find(q.matches[1].str() + "/" + q.matches[2].str(), q.matches[3].str(), q, r, &repo,
              &commit))
      return;
    nlohmann::json j;
    j["id"] = q.matches[1].str() + "/" + q.matches[2].str();
    j["sha"] = commit;
    j["gated"] = repo->gated ? nlohmann::json("manual") : nlohmann::json(false);
    j["siblings"] = nlohmann::json::array();
    for (const auto& [path, bytes] : repo->commits[commit])
      j["siblings"].push_back({{"rfilename", path}});
    for (const auto& path : repo->phantom_files) j["siblings"].push_back({{"rfilename", path}});
    r.set_content(j.dump(), "application/json");
  }

  void resolve(const httplib::Request& q, httplib::Response& r) {
    std::unique_lock<std::mutex> lock(mu_);
    ++requests_;
    const std::string path = q.matches[4].str();
    const bool head = q.method == "HEAD";
    hub_auth_.push_back(q.get_header_value("Authorization"));
    FakeRepo* repo = nullptr;
    std::string commit;
    if (!find(q.matches[1].str() + "/" + q.matches[2].str(), q.matches[3].str(), q, r, &repo,
              &commit))
      return;
    if (repo->gated) {
      const std::string auth = q.get_header_value("Authorization");
      if (auth.empty())
        return error(r, 401, "GatedRepo",
                     "Access to this model is restricted. You must be authenticated.");
      if (auth != "Bearer " + repo->accepted_token)
        return error(r, 403, "GatedRepo",
                     "Access to this model is restricted and you are not in the authorized list.");
    }
    const auto& files = repo->commits[commit];
    auto f = files.find(path);
    if (f == files.end()) return error(r, 404, "EntryNotFound", path + " does not exist");
    auto& st = stats_[path];
    if (head) {
      ++st.heads;
      cv_.notify_all();
    }
    r.set_header("X-Repo-Commit", commit);
    const std::string& bytes = f->second;
    if (fake_is_lfs(path)) {
      const std::string sha = test_sha256(bytes);
      // The ETag of the redirect itself is not the content's; X-Linked-Etag is.
      r.set_header("ETag", "\"" + test_git_sha1("pointer " + sha) + "\"");
      r.set_header("X-Linked-Etag", "\"" + sha + "\"");
      r.set_header("X-Linked-Size", std::to_string(bytes.size()));
      r.set_redirect(scheme_ + "://127.0.0.1:" + std::to_string(cdn_port_) + "/blobs/" + sha +
                         "?X-Amz-Signature=fake",
                     302);
      return;
    }
    r.set_header("ETag", "\"" + test_git_sha1(bytes) + "\"");
    if (head) {
      r.set_header("Content-Length", std::to_string(bytes.size()));
      return;
    }
    serve(path, bytes, q, r, lock);
  }

  void cdn_blob(const httplib::Request& q, httplib::Response& r) {
    std::unique_lock<std::mutex> lock(mu_);
    ++requests_;
    if (q.has_header("Authorization")) cdn_auth_.push_back(q.get_header_value("Authorization"));
    auto b = blobs_.find(q.matches[1].str());
    if (b == blobs_.end()) return error(r, 404, "", "no such object");
    const auto [path, bytes] = b->second;
    serve(path, bytes, q, r, lock);
  }

  // The body of one file, through a content provider so httplib applies the Range; faults
  // applied on the way out.
  void serve(const std::string& path, const std::string& bytes, const httplib::Request& q,
             httplib::Response& r, std::unique_lock<std::mutex>& lock) {
    auto& st = stats_[path];
    ++st.gets;
    st.ranges.push_back(q.get_header_value("Range"));
    if (auto it = refusals_.find(path); it != refusals_.end() && it->second.second > 0) {
      --it->second.second;
      return error(r, it->second.first, "", "temporarily unavailable");
    }
    if (auto h = holds_.find(path); h != holds_.end()) {
      const int want = h->second;
      cv_.wait_for(lock, std::chrono::seconds(20),
                   [&] { return !holds_.count(path) || stats_[path].heads >= want; });
    }
    const bool large = fake_is_lfs(path);
    if (large) {
      ++in_flight_;
      max_in_flight_ = std::max(max_in_flight_, in_flight_);
      cv_.notify_all();
      if (in_flight_goal_ > 0)
        cv_.wait_for(lock, std::chrono::seconds(10), [&] { return in_flight_ >= in_flight_goal_; });
    }
    uint64_t cut_at = UINT64_MAX;
    if (auto c = cuts_.find(path); c != cuts_.end() && c->second.second > 0) {
      --c->second.second;
      cut_at = c->second.first;
    }
    const int64_t flip = corrupt_.count(path) ? static_cast<int64_t>(corrupt_[path]) : -1;
    auto content = std::make_shared<std::string>(bytes);
    r.set_content_provider(
        content->size(), "application/octet-stream",
        [this, content, cut_at, flip, path](size_t offset, size_t length, httplib::DataSink& sink) {
          if (offset >= cut_at) return false;  // drop the connection mid-body
          size_t n = std::min<size_t>(length, 64 << 10);
          if (cut_at != UINT64_MAX) n = std::min<size_t>(n, cut_at - offset);
          std::string piece = content->substr(offset, n);
          if (flip >= 0 && static_cast<uint64_t>(flip) >= offset &&
              static_cast<uint64_t>(flip) < offset + n)
            piece[static_cast<size_t>(flip) - offset] ^= 0x5a;
          {
            std::lock_guard<std::mutex> g(mu_);
            stats_[path].bytes += piece.size();
          }
          return sink.write(piece.data(), piece.size());
        },
        [this, large](bool) {
          if (!large) return;
          std::lock_guard<std::mutex> g(mu_);
          --in_flight_;
        });
  }

  std::string scheme_ = "http";
  std::unique_ptr<httplib::Server> hub_, cdn_;
  int hub_port_ = 0, cdn_port_ = 0;
  std::thread hub_thread_, cdn_thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, FakeRepo> repos_;
  std::map<std::string, std::pair<std::string, std::string>> blobs_;  // sha256 -> path, bytes
  std::map<std::string, FileStats> stats_;
  std::map<std::string, std::pair<uint64_t, int>> cuts_;
  std::map<std::string, std::pair<int, int>> refusals_;
  std::map<std::string, uint64_t> corrupt_;
  std::map<std::string, int> holds_;
  int in_flight_goal_ = 0, in_flight_ = 0, max_in_flight_ = 0, requests_ = 0;
  std::vector<std::string> cdn_auth_, hub_auth_;
};

// The tiny fixture checkpoint as a Hub repository: `main` at one commit with the fixture's files
// plus files gemstage must never fetch (other weight formats, a subfolder, a README).
inline FakeRepo fixture_repo(const std::string& model_dir) {
  FakeRepo repo;
  std::map<std::string, std::string> files;
  for (const char* f : {"config.json", "model.safetensors", "preprocessor_config.json",
                        "tokenizer.json", "tokenizer_config.json"})
    files[f] = read_bytes(model_dir + "/" + f);
  files["README.md"] = "# a model card\n";
  files[".gitattributes"] = "*.safetensors filter=lfs diff=lfs merge=lfs -text\n";
  files["pytorch_model.bin"] = std::string(4096, 'b');
  files["model-q4.gguf"] = std::string(4096, 'g');
  files["onnx/model.onnx"] = std::string(4096, 'o');
  files["onnx/config.json"] = "{}";
  const std::string commit = test_commit("main of the fixture");
  repo.commits[commit] = files;
  repo.branches["main"] = commit;
  return repo;
}

}  // namespace gemstage::testing
