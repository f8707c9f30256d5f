// Models by name (issue 47), the library: names, settings, hashes, proxies, the cache layout the
// Python tools share, and downloads against the in-process Hub of hub_fake_server.h (fresh,
// cut and resumed, restarted, corrupted, gated, offline, by branch and commit, sharded, proxied).
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "hub/cache.h"
#include "hub/digest.h"
#include "hub/download.h"
#include "hub/http.h"
#include "hub/model_ref.h"
#include "hub/settings.h"
#include "hub_fake_server.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::hub;
using namespace gemstage::testing;
namespace fs = std::filesystem;

namespace {

const char* kRepo = "google/gemma-4-E2B-it";
const ModelRef kRef{"google", "gemma-4-E2B-it", ""};

// The files gemstage fetches from the fixture repository (fixture_repo adds others it must not).
const std::vector<std::string> kWanted = {"config.json", "model.safetensors",
                                          "preprocessor_config.json", "tokenizer.json",
                                          "tokenizer_config.json"};

std::string model_file(const std::string& name) {
  return read_bytes(fixture("model/" + name));
}

HubSettings settings_for(const FakeHub& hub, const std::string& cache) {
  HubSettings s;
  s.endpoint = hub.endpoint();
  s.cache_dir = cache;
  s.progress = false;
  s.retry_wait_seconds = 0;
  s.jobs = 4;
  return s;
}

// Collects the downloader's messages (they come from several threads).
struct Notes {
  std::mutex mu;
  std::vector<std::string> lines;
  Notify notify() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mu);
      lines.push_back(m);
    };
  }
  bool any_contains(const std::string& s) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& l : lines)
      if (l.find(s) != std::string::npos) return true;
    return false;
  }
};

HubError::Kind kind_of(const std::function<void()>& fn, std::string* message) {
  try {
    fn();
  } catch (const HubError& e) {
    *message = e.what();
    return e.kind();
  }
  *message = "(no error)";
  ADD_FAILURE() << "expected a HubError";
  return HubError::Kind::Refused;
}

std::string main_commit() {
  return test_commit("main of the fixture");
}

fs::path repo_dir(const std::string& cache) {
  return fs::path(cache) / "models--google--gemma-4-E2B-it";
}

// The etag the Hub names a file's blob by: sha256 for LFS files, the git blob sha1 otherwise.
std::string etag_for(const std::string& name, const std::string& bytes) {
  return fake_is_lfs(name) ? test_sha256(bytes) : test_git_sha1(bytes);
}

// --- names, settings, hashes, URLs -------------------------------------------------------------

TEST(HubNames, ModelReferencesParseAndPathsDoNot) {
  auto r = parse_model_ref("google/gemma-4-E2B-it");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->repo_id(), "google/gemma-4-E2B-it");
  EXPECT_EQ(r->revision_or_default(), "main");
  r = parse_model_ref("google/gemma-4-E2B-it@refs/pr/1");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->revision, "refs/pr/1");
  r = parse_model_ref("org_1/Name.v2@" + main_commit());
  ASSERT_TRUE(r);
  EXPECT_TRUE(is_commit_hash(r->revision));
  const std::vector<std::string> bad = {
      "gemma",        "/abs/path/model", "./rel/model",   "a/b/c",
      "../up/x",      "org/na--me",      "org/x.git",     "-org/name",
      "org/name.",    "org/name@",       "org/name@../x", "org/name@a b",
      "org/name@x~1", "org/name:Q4_K_M", "org/name@/x",   std::string(97, 'a') + "/x"};
  for (const std::string& b : bad) EXPECT_FALSE(parse_model_ref(b)) << b;
  EXPECT_TRUE(parse_model_ref(std::string(96, 'a') + "/x"));
  EXPECT_FALSE(is_commit_hash("ABCDEF0123456789ABCDEF0123456789ABCDEF01"));
  EXPECT_FALSE(is_commit_hash("main"));
}

TEST(HubSettings, ReadTheVariablesThePythonToolsRead) {
  const std::string dir = temp_dir("hub_settings");
  std::ofstream(dir + "/token") << "  hf_from_file \r\n";
  std::map<std::string, std::string> env = {{"HOME", "/home/u"}, {"HF_HOME", dir}};
  auto lookup = [&env](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  HubSettings s = settings_from_environment(lookup);
  EXPECT_EQ(s.cache_dir, fs::path(dir) / "hub");
  EXPECT_EQ(s.token, "hf_from_file");
  EXPECT_EQ(s.token_source, (fs::path(dir) / "token").string());
  EXPECT_EQ(s.endpoint, "https://huggingface.co");
  EXPECT_FALSE(s.offline);
  EXPECT_TRUE(s.progress);

  env = {{"HOME", "/home/u"}};
  s = settings_from_environment(lookup);
  EXPECT_EQ(s.cache_dir, fs::path("/home/u/.cache/huggingface/hub"));
  EXPECT_TRUE(s.token.empty());
  env = {{"HOME", "/home/u"}, {"XDG_CACHE_HOME", "/x"}};
  EXPECT_EQ(settings_from_environment(lookup).cache_dir, fs::path("/x/huggingface/hub"));

  env = {{"HOME", "/home/u"},
         {"HF_HOME", dir},
         {"HF_HUB_CACHE", "~/hfc"},
         {"HF_TOKEN", "hf_env"},
         {"HF_ENDPOINT", "http://mirror.example:8080/"},
         {"HF_HUB_OFFLINE", "True"},
         {"HF_HUB_DISABLE_PROGRESS_BARS", "1"},
         {"https_proxy", "http://p:3128"},
         {"NO_PROXY", "localhost"}};
  s = settings_from_environment(lookup);
  EXPECT_EQ(s.cache_dir, fs::path("/home/u/hfc"));
  EXPECT_EQ(s.token, "hf_env");
  EXPECT_EQ(s.token_source, "HF_TOKEN");
  EXPECT_EQ(s.endpoint, "http://mirror.example:8080");
  EXPECT_TRUE(s.offline);
  EXPECT_FALSE(s.progress);
  EXPECT_EQ(s.https_proxy, "http://p:3128");
  EXPECT_EQ(s.no_proxy, "localhost");
  env["HF_HUB_OFFLINE"] = "0";
  EXPECT_FALSE(settings_from_environment(lookup).offline);
  env["HF_HUB_OFFLINE"] = "";
  env["TRANSFORMERS_OFFLINE"] = "yes";
  EXPECT_TRUE(settings_from_environment(lookup).offline);
}

TEST(HubDigest, KnownAnswers) {
  // FIPS 180-2's "abc" vector, and git's ids of "hello\n" and of the empty blob.
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(git_blob_sha1_hex("hello\n"), "ce013625030ba8dba906f756967f9e9ca394464a");
  EXPECT_EQ(git_blob_sha1_hex(""), "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391");
  Digest d(Digest::Kind::Sha256);
  d.update("a");
  d.update("bc");
  EXPECT_EQ(d.hex(), sha256_hex("abc"));
  EXPECT_EQ(etag_kind(sha256_hex("x")), EtagKind::Sha256);
  EXPECT_EQ(etag_kind(git_blob_sha1_hex("x")), EtagKind::GitSha1);
  EXPECT_EQ(etag_kind("W/abc"), EtagKind::Opaque);
}

TEST(HubHttp, UrlsProxiesAndNoProxy) {
  auto u = parse_url("https://huggingface.co/api/models/a/b/revision/refs%2Fpr%2F1");
  ASSERT_TRUE(u);
  EXPECT_EQ(u->port, 443);
  EXPECT_EQ(u->target, "/api/models/a/b/revision/refs%2Fpr%2F1");
  EXPECT_EQ(u->origin(), "https://huggingface.co:443");
  EXPECT_FALSE(parse_url("ftp://x/y"));
  EXPECT_FALSE(parse_url("http://user:pw@x/y"));
  EXPECT_FALSE(parse_url("http://x:99999/"));
  EXPECT_EQ(resolve_location(*u, "https://cdn-lfs.hf.co/x?sig=1")->str(),
            "https://cdn-lfs.hf.co/x?sig=1");
  EXPECT_EQ(resolve_location(*u, "/api/models/c/d/revision/main")->str(),
            "https://huggingface.co/api/models/c/d/revision/main");
  EXPECT_EQ(percent_encode("refs/pr/1", false), "refs%2Fpr%2F1");
  EXPECT_EQ(percent_encode("sub dir/a+b.json", true), "sub%20dir/a%2Bb.json");

  EXPECT_TRUE(bypasses_proxy("huggingface.co", 443, "huggingface.co"));
  EXPECT_TRUE(bypasses_proxy("cdn-lfs.huggingface.co", 443, "localhost, .huggingface.co"));
  EXPECT_TRUE(bypasses_proxy("cdn-lfs.huggingface.co", 443, "huggingface.co"));
  EXPECT_FALSE(bypasses_proxy("nothuggingface.co", 443, "huggingface.co"));
  EXPECT_TRUE(bypasses_proxy("anything", 80, "*"));
  EXPECT_TRUE(bypasses_proxy("127.0.0.1", 8080, "127.0.0.1:8080"));
  EXPECT_FALSE(bypasses_proxy("127.0.0.1", 9090, "127.0.0.1:8080"));
  EXPECT_FALSE(bypasses_proxy("huggingface.co", 443, ""));
  HubSettings s;
  s.https_proxy = "http://proxy:3128";
  s.http_proxy = "http://plain:80";
  s.no_proxy = "internal.example";
  EXPECT_EQ(proxy_for(*parse_url("https://huggingface.co/x"), s), "http://proxy:3128");
  EXPECT_EQ(proxy_for(*parse_url("http://mirror/x"), s), "http://plain:80");
  EXPECT_EQ(proxy_for(*parse_url("https://hub.internal.example/x"), s), "");
}

TEST(HubFiles, OnlyWhatGemstageReads) {
  for (const char* f :
       {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "tokenizer.model", "special_tokens_map.json", "chat_template.jinja",
        "processor_config.json", "preprocessor_config.json", "model.safetensors",
        "model-00001-of-00002.safetensors", "model.safetensors.index.json"})
    EXPECT_TRUE(wanted_file(f)) << f;
  for (const char* f : {"pytorch_model.bin", "model.gguf", "model-Q4_K_M.gguf", "onnx/model.onnx",
                        "onnx/config.json", "original/model.safetensors", "README.md",
                        ".gitattributes", "tf_model.h5", "flax_model.msgpack", "LICENSE"})
    EXPECT_FALSE(wanted_file(f)) << f;
}

// --- downloads ---------------------------------------------------------------------------------

TEST(HubDownload, FreshPullLaysOutTheCacheLikeHuggingfaceHub) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string cache = temp_dir("hub_fresh");
  HubSettings s = settings_for(hub, cache);
  s.token = "hf_reader";
  s.token_source = "HF_TOKEN";
  const ResolvedModel m = resolve_model(kRef, s, Notes().notify());
  const fs::path repo = repo_dir(cache);
  EXPECT_EQ(m.dir, repo / "snapshots" / main_commit());
  EXPECT_EQ(m.commit, main_commit());
  EXPECT_EQ(m.files_downloaded, static_cast<int>(kWanted.size()));
  for (const auto& name : kWanted) {
    const std::string bytes = model_file(name);
    const std::string etag = etag_for(name, bytes);
    const fs::path link = m.dir / name;
    ASSERT_TRUE(fs::is_symlink(link)) << name;
    EXPECT_EQ(fs::read_symlink(link).string(), "../../blobs/" + etag) << name;
    EXPECT_TRUE(file_holds(link.string(), bytes)) << name;
    EXPECT_TRUE(fs::exists(cache + "/.locks/models--google--gemma-4-E2B-it/" + etag + ".lock"));
    EXPECT_FALSE(fs::exists(repo / "blobs" / (etag + ".incomplete")));
  }
  // refs/main holds the bare commit, no line break, as huggingface_hub writes it.
  EXPECT_TRUE(file_holds((repo / "refs" / "main").string(), main_commit()));
  // Never asked for: other weight formats, subfolders, the model card.
  for (const auto& p : hub.paths_requested())
    EXPECT_NE(std::find(kWanted.begin(), kWanted.end(), p), kWanted.end()) << p;
  const auto w = hub.stats("model.safetensors");
  EXPECT_EQ(w.gets, 1);
  EXPECT_EQ(w.bytes, model_file("model.safetensors").size());
  // The token went to the Hub and never to the CDN the Hub redirected to.
  EXPECT_TRUE(hub.cdn_authorizations().empty());
  for (const auto& a : hub.hub_authorizations()) EXPECT_EQ(a, "Bearer hf_reader");
  EXPECT_TRUE(missing_for_load(m.dir).empty());

  // Again: one question to the Hub (the commit of main), nothing downloaded.
  hub.reset_stats();
  const ResolvedModel again = resolve_model(kRef, s, Notes().notify());
  EXPECT_EQ(again.dir, m.dir);
  EXPECT_EQ(again.files_downloaded, 0);
  EXPECT_EQ(hub.requests(), 1);
}

TEST(HubDownload, CutConnectionResumesWithARangeRequest) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  hub.cut("model.safetensors", 3000000);
  hub.refuse("tokenizer.json", 503, 1);  // a passing outage is retried too
  // The CDN refuses its signed link once (it expired): a new one comes from the Hub.
  hub.refuse("model.safetensors", 403, 1);
  const std::string cache = temp_dir("hub_cut");
  Notes notes;
  const ResolvedModel m = resolve_model(kRef, settings_for(hub, cache), notes.notify());
  const std::string bytes = model_file("model.safetensors");
  EXPECT_TRUE(file_holds((m.dir / "model.safetensors").string(), bytes));
  const auto w = hub.stats("model.safetensors");
  ASSERT_EQ(w.ranges.size(), 3u);
  EXPECT_EQ(w.ranges[0], "");  // refused
  EXPECT_EQ(w.ranges[1], "");  // cut
  EXPECT_EQ(w.ranges[2], "bytes=3000000-");
  EXPECT_EQ(w.bytes, bytes.size()) << "no byte crosses the wire twice";
  EXPECT_TRUE(notes.any_contains("stopped at 3000000")) << "the cut is reported";
  EXPECT_EQ(hub.stats("tokenizer.json").gets, 2);
  EXPECT_TRUE(notes.any_contains("asking the Hub for a new link"));
  EXPECT_TRUE(file_holds((m.dir / "tokenizer.json").string(), model_file("tokenizer.json")));
}

TEST(HubDownload, RestartResumesFromTheIncompleteFile) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string cache = temp_dir("hub_restart");
  HubSettings s = settings_for(hub, cache);
  s.max_retries = 0;
  // The connection breaks at 2.5 MB, and the next try brings nothing: this run gives up.
  hub.cut("model.safetensors", 2500000, 2);
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, s, Notes().notify()); }, &msg),
            HubError::Kind::Network);
  const std::string bytes = model_file("model.safetensors");
  const fs::path incomplete = repo_dir(cache) / "blobs" / (test_sha256(bytes) + ".incomplete");
  EXPECT_NE(msg.find(incomplete.string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("resumes"), std::string::npos) << msg;
  ASSERT_TRUE(fs::exists(incomplete));
  EXPECT_EQ(fs::file_size(incomplete), 2500000u);
  // No partial snapshot looks complete: no config.json, no ref, and offline resolution refuses it.
  const fs::path snap = repo_dir(cache) / "snapshots" / main_commit();
  EXPECT_FALSE(fs::exists(snap / "model.safetensors"));
  EXPECT_FALSE(fs::exists(snap / "config.json"));
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / "main"));
  EXPECT_FALSE(missing_for_load(snap).empty());
  EXPECT_EQ(kind_of([&] { resolve_cached(kRef, s); }, &msg), HubError::Kind::NotCached);

  // A new run (a restart: only the disk remembers) asks for the rest and nothing else.
  const ResolvedModel m = resolve_model(kRef, settings_for(hub, cache), Notes().notify());
  EXPECT_TRUE(file_holds((m.dir / "model.safetensors").string(), bytes));
  const auto w = hub.stats("model.safetensors");
  ASSERT_FALSE(w.ranges.empty());
  EXPECT_EQ(w.ranges.back(), "bytes=2500000-");
  EXPECT_EQ(w.bytes, bytes.size());
  EXPECT_FALSE(fs::exists(incomplete));
  EXPECT_TRUE(missing_for_load(m.dir).empty());
}

TEST(HubDownload, CorruptedByteIsCaughtAndTheBlobDeleted) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string bytes = model_file("model.safetensors");
  const std::string sha = test_sha256(bytes);
  std::string cache;
  for (const std::string file : {"tokenizer.json", "model.safetensors"}) {
    SCOPED_TRACE(file);
    cache = temp_dir("hub_corrupt_" + file);
    const HubSettings s = settings_for(hub, cache);
    hub.corrupt(file, 4097);
    std::string msg;
    EXPECT_EQ(kind_of([&] { resolve_model(kRef, s, Notes().notify()); }, &msg),
              HubError::Kind::Integrity);
    EXPECT_NE(msg.find("checksum mismatch for " + file), std::string::npos) << msg;
    EXPECT_NE(msg.find("deleted"), std::string::npos) << msg;
    EXPECT_NE(msg.find(file == "model.safetensors" ? "sha256 " + sha : "git blob sha1"),
              std::string::npos)
        << msg;
    const std::string etag = etag_for(file, model_file(file));
    EXPECT_FALSE(fs::exists(repo_dir(cache) / "blobs" / etag));
    EXPECT_FALSE(fs::exists(repo_dir(cache) / "blobs" / (etag + ".incomplete")));
    EXPECT_FALSE(fs::exists(repo_dir(cache) / "snapshots" / main_commit() / file));
    EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / "main"));
    hub.corrupt(file, -1);
  }
  const ResolvedModel m = resolve_model(kRef, settings_for(hub, cache), Notes().notify());
  EXPECT_TRUE(file_holds((m.dir / "model.safetensors").string(), bytes));
  EXPECT_TRUE(file_holds((m.dir / "tokenizer.json").string(), model_file("tokenizer.json")));
}

TEST(HubDownload, GatedRepositoryNeedsAnAcceptedToken) {
  FakeHub hub;
  FakeRepo repo = fixture_repo(fixture("model"));
  repo.gated = true;
  repo.accepted_token = "hf_accepted";
  hub.add_repo(kRepo, repo);
  const std::string cache = temp_dir("hub_gated");
  HubSettings s = settings_for(hub, cache);
  const std::string page = hub.endpoint() + "/" + kRepo;
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, s, Notes().notify()); }, &msg),
            HubError::Kind::Gated);
  EXPECT_NE(msg.find(page), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_TOKEN"), std::string::npos) << msg;
  EXPECT_NE(msg.find("gated"), std::string::npos) << msg;

  s.token = "hf_not_accepted";
  s.token_source = "HF_TOKEN";
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, s, Notes().notify()); }, &msg),
            HubError::Kind::Gated);
  EXPECT_NE(msg.find(page), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_TOKEN"), std::string::npos) << msg;
  EXPECT_NE(msg.find("403"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "snapshots" / main_commit() / "config.json"));

  hub.reset_stats();
  s.token = "hf_accepted";
  const ResolvedModel m = resolve_model(kRef, s, Notes().notify());
  EXPECT_TRUE(missing_for_load(m.dir).empty());
  EXPECT_TRUE(hub.cdn_authorizations().empty());
  ASSERT_FALSE(hub.hub_authorizations().empty());
  for (const auto& a : hub.hub_authorizations()) EXPECT_EQ(a, "Bearer hf_accepted");
}

TEST(HubDownload, MissingRepositoryRevisionAndEntrySayWhich) {
  FakeHub hub;
  FakeRepo repo = fixture_repo(fixture("model"));
  hub.add_repo(kRepo, repo);
  // A listing that names a file the server then does not have.
  FakeRepo broken = repo;
  broken.phantom_files = {"tokenizer.model"};
  hub.add_repo("test-org/listed-but-missing", broken);
  const std::string cache = temp_dir("hub_missing");
  const HubSettings s = settings_for(hub, cache);
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(*parse_model_ref("google/no-such-model"), s); }, &msg),
            HubError::Kind::RepoNotFound);
  EXPECT_NE(msg.find("google/no-such-model was not found"), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_TOKEN"), std::string::npos) << msg;
  EXPECT_EQ(kind_of([&] { resolve_model(*parse_model_ref(std::string(kRepo) + "@v9"), s); }, &msg),
            HubError::Kind::RevisionNotFound);
  EXPECT_NE(msg.find("has no revision 'v9'"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / "v9"));
  EXPECT_EQ(
      kind_of([&] { resolve_model(*parse_model_ref("test-org/listed-but-missing"), s); }, &msg),
      HubError::Kind::EntryNotFound);
  EXPECT_NE(msg.find("has no file tokenizer.model at commit " + main_commit()), std::string::npos)
      << msg;
}

TEST(HubDownload, RevisionByBranchTagAndCommit) {
  FakeHub hub;
  FakeRepo repo = fixture_repo(fixture("model"));
  const std::string c1 = main_commit(), c2 = test_commit("dev");
  auto files2 = repo.commits[c1];
  files2["generation_config.json"] = "{\"do_sample\": false}\n";
  repo.commits[c2] = files2;
  repo.branches["dev"] = c2;
  repo.branches["refs/pr/1"] = c2;
  hub.add_repo(kRepo, repo);
  const std::string cache = temp_dir("hub_revisions");
  const HubSettings s = settings_for(hub, cache);

  const ResolvedModel dev = resolve_model(*parse_model_ref(std::string(kRepo) + "@dev"), s);
  EXPECT_EQ(dev.commit, c2);
  EXPECT_EQ(dev.dir, repo_dir(cache) / "snapshots" / c2);
  EXPECT_TRUE(fs::exists(dev.dir / "generation_config.json"));
  EXPECT_TRUE(file_holds((repo_dir(cache) / "refs" / "dev").string(), c2));
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / "main"));

  // By commit: its own snapshot, the weights blob shared (not fetched again), no ref written.
  const ResolvedModel one = resolve_model(*parse_model_ref(std::string(kRepo) + "@" + c1), s);
  EXPECT_EQ(one.dir, repo_dir(cache) / "snapshots" / c1);
  EXPECT_FALSE(fs::exists(one.dir / "generation_config.json"));
  EXPECT_EQ(hub.stats("model.safetensors").gets, 1);
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / c1));

  // A branch with slashes is a nested ref file, as the tools write it.
  const ResolvedModel pr = resolve_model(*parse_model_ref(std::string(kRepo) + "@refs/pr/1"), s);
  EXPECT_EQ(pr.commit, c2);
  EXPECT_TRUE(file_holds((repo_dir(cache) / "refs" / "refs" / "pr" / "1").string(), c2));

  // Offline, the branch and the commit both resolve from the cache.
  HubSettings off = s;
  off.offline = true;
  hub.reset_stats();
  EXPECT_EQ(resolve_model(*parse_model_ref(std::string(kRepo) + "@dev"), off).dir, dev.dir);
  EXPECT_EQ(resolve_model(*parse_model_ref(std::string(kRepo) + "@" + c1), off).dir, one.dir);
  EXPECT_EQ(hub.requests(), 0);
  // A commit already complete in the cache needs no network even online.
  EXPECT_EQ(resolve_model(*parse_model_ref(std::string(kRepo) + "@" + c1), s).dir, one.dir);
  EXPECT_EQ(hub.requests(), 0);
}

TEST(HubOffline, UsesTheSnapshotAndNeverTheNetwork) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string cache = temp_dir("hub_offline");
  HubSettings s = settings_for(hub, cache);
  const ResolvedModel online = resolve_model(kRef, s, Notes().notify());
  hub.reset_stats();
  s.offline = true;
  const ResolvedModel m = resolve_model(kRef, s);
  EXPECT_EQ(m.dir, online.dir);
  EXPECT_FALSE(m.used_network);
  EXPECT_EQ(hub.requests(), 0);
}

TEST(HubOffline, WithoutTheSnapshotSaysWhatIsMissing) {
  const std::string cache = temp_dir("hub_offline_missing");
  HubSettings s;
  s.cache_dir = cache;
  s.offline = true;
  s.endpoint = "http://127.0.0.1:1";
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, s); }, &msg), HubError::Kind::NotCached);
  EXPECT_NE(msg.find(cache), std::string::npos) << msg;
  EXPECT_NE(msg.find("gemstage pull google/gemma-4-E2B-it"), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_HUB_OFFLINE"), std::string::npos) << msg;

  // A snapshot whose weights blob is gone (an interrupted download, a hand-deleted file).
  write_hf_cache_snapshot(cache, kRepo, fixture("model"), main_commit());
  fs::remove(repo_dir(cache) / "blobs" / test_sha256(model_file("model.safetensors")));
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, s); }, &msg), HubError::Kind::NotCached);
  EXPECT_NE(msg.find("incomplete"), std::string::npos) << msg;
  EXPECT_NE(msg.find("lacks model.safetensors"), std::string::npos) << msg;
  // A revision the cache never saw.
  EXPECT_EQ(kind_of([&] { resolve_model(*parse_model_ref(std::string(kRepo) + "@dev"), s); }, &msg),
            HubError::Kind::NotCached);
  EXPECT_NE(msg.find("refs/dev"), std::string::npos) << msg;
}

TEST(HubCache, ALayoutWrittenByHuggingfaceHubIsUsedAsIs) {
  const std::string cache = temp_dir("hub_python_layout");
  write_hf_cache_snapshot(cache, kRepo, fixture("model"), main_commit());
  HubSettings s;
  s.cache_dir = cache;
  s.offline = true;
  const ResolvedModel m = resolve_model(kRef, s);
  EXPECT_EQ(m.dir, repo_dir(cache) / "snapshots" / main_commit());
  EXPECT_EQ(m.commit, main_commit());

  // Online against a Hub at the same commit: one question, nothing downloaded or rewritten.
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const auto before = fs::last_write_time(repo_dir(cache) / "refs" / "main");
  const ResolvedModel on = resolve_model(kRef, settings_for(hub, cache), Notes().notify());
  EXPECT_EQ(on.dir, m.dir);
  EXPECT_EQ(on.files_downloaded, 0);
  EXPECT_EQ(hub.requests(), 1);
  EXPECT_EQ(fs::last_write_time(repo_dir(cache) / "refs" / "main"), before);

  const auto listed = list_cached_models(cache);
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].repo_id, kRepo);
  EXPECT_EQ(listed[0].commit, main_commit());
  EXPECT_EQ(listed[0].refs, std::vector<std::string>{"main"});
  EXPECT_EQ(listed[0].model_type, "gemma4");
  EXPECT_TRUE(listed[0].missing.empty());
  uint64_t total = 0;
  for (const auto& n : kWanted) total += model_file(n).size();
  EXPECT_EQ(listed[0].bytes, total);
}

TEST(HubDownload, ShardsDownloadInParallelAndTheIndexDecidesCompleteness) {
  FakeHub hub;
  FakeRepo repo;
  const std::string commit = test_commit("sharded");
  auto& files = repo.commits[commit];
  files["config.json"] = "{\"model_type\": \"gemma4\"}";
  nlohmann::json index = {{"metadata", {{"total_size", 4 << 20}}}, {"weight_map", {}}};
  for (int i = 1; i <= 4; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05d-of-00004.safetensors", i);
    std::string bytes(1 << 20, '\0');
    for (size_t k = 0; k < bytes.size(); ++k) bytes[k] = static_cast<char>((k * 131 + i * 7) >> 3);
    files[name] = bytes;
    index["weight_map"]["tensor." + std::to_string(i)] = name;
  }
  files["model.safetensors.index.json"] = index.dump();
  repo.branches["main"] = commit;
  hub.add_repo("test-org/sharded", repo);
  hub.hold_until_in_flight(2);
  const std::string cache = temp_dir("hub_shards");
  HubSettings s = settings_for(hub, cache);
  s.jobs = 4;
  const ResolvedModel m = resolve_model(*parse_model_ref("test-org/sharded"), s, Notes().notify());
  EXPECT_GE(hub.max_in_flight(), 2) << "shards are fetched at the same time";
  EXPECT_TRUE(missing_for_load(m.dir).empty());
  for (const auto& [name, bytes] : files) EXPECT_TRUE(file_holds((m.dir / name).string(), bytes));
  // One shard gone: the index says the snapshot is incomplete.
  fs::remove(m.dir / "model-00003-of-00004.safetensors");
  EXPECT_EQ(missing_for_load(m.dir), std::vector<std::string>{"model-00003-of-00004.safetensors"});
}

TEST(HubDownload, WithoutNetworkACompleteCachedSnapshotStillServes) {
  const std::string cache = temp_dir("hub_fallback");
  write_hf_cache_snapshot(cache, kRepo, fixture("model"), main_commit());
  HubSettings s;
  s.cache_dir = cache;
  s.endpoint = "http://127.0.0.1:1";  // nothing listens there
  s.progress = false;
  Notes notes;
  const ResolvedModel m = resolve_model(kRef, s, notes.notify());
  EXPECT_EQ(m.commit, main_commit());
  EXPECT_TRUE(notes.any_contains("could not ask the Hub")) << "the fallback is said";
  // Nothing cached for another model: the network error itself, naming the host.
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(*parse_model_ref("google/other"), s); }, &msg),
            HubError::Kind::Network);
  EXPECT_NE(msg.find("127.0.0.1:1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("HF_HUB_OFFLINE"), std::string::npos) << msg;
}

TEST(HubDownload, ProxyFromTheEnvironmentAndNoProxy) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  // A forward proxy: absolute-form requests for hub.invalid (a name that never resolves) are
  // passed to the fake Hub, so a download can only succeed through it.
  httplib::Server proxy;
  std::mutex mu;
  std::vector<std::string> seen;
  const int hub_port = hub.hub_port();
  proxy.Get(".*", [&](const httplib::Request& q, httplib::Response& r) {
    {
      std::lock_guard<std::mutex> lock(mu);
      seen.push_back(q.target);
    }
    const auto u = parse_url(q.target);
    if (!u || u->host != "hub.invalid") {
      r.status = 502;
      return;
    }
    httplib::Client up("127.0.0.1", hub_port);
    httplib::Headers h;
    for (const char* k : {"Authorization", "Accept-Encoding", "User-Agent"})
      if (q.has_header(k)) h.emplace(k, q.get_header_value(k));
    auto res = q.method == "HEAD" ? up.Head(u->target, h) : up.Get(u->target, h);
    if (!res) {
      r.status = 502;
      return;
    }
    r.status = res->status;
    for (const auto& [k, v] : res->headers)
      if (k != "Content-Length" && k != "Transfer-Encoding" && k != "Connection" &&
          k != "Keep-Alive")
        r.set_header(k, v);
    if (q.method == "HEAD") {
      if (res->has_header("Content-Length"))
        r.set_header("Content-Length", res->get_header_value("Content-Length"));
    } else {
      r.set_content(res->body, res->get_header_value("Content-Type"));
    }
  });
  const int proxy_port = proxy.bind_to_any_port("127.0.0.1");
  std::thread t([&] { proxy.listen_after_bind(); });
  while (!proxy.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(2));

  const std::string cache = temp_dir("hub_proxy");
  std::map<std::string, std::string> env = {
      {"HOME", cache},
      {"HF_HUB_CACHE", cache},
      {"HF_ENDPOINT", "http://hub.invalid:" + std::to_string(hub_port)},
      {"HTTP_PROXY", "http://127.0.0.1:" + std::to_string(proxy_port)},
      {"NO_PROXY", "127.0.0.1"},  // the CDN host goes direct
      {"HF_HUB_DISABLE_PROGRESS_BARS", "1"}};
  auto lookup = [&env](const char* n) -> const char* {
    auto it = env.find(n);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  const ResolvedModel m = resolve_model(kRef, settings_from_environment(lookup), Notes().notify());
  EXPECT_TRUE(missing_for_load(m.dir).empty());
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_FALSE(seen.empty());
    for (const auto& target : seen) EXPECT_EQ(target.rfind("http://hub.invalid:", 0), 0u) << target;
  }
  // NO_PROXY naming the Hub's host: a direct connection, which cannot reach hub.invalid.
  env["NO_PROXY"] = "127.0.0.1,.invalid";
  HubSettings direct = settings_from_environment(lookup);
  direct.cache_dir = temp_dir("hub_proxy_direct");
  std::string msg;
  EXPECT_EQ(kind_of([&] { resolve_model(kRef, direct, Notes().notify()); }, &msg),
            HubError::Kind::Network);
  EXPECT_NE(msg.find("hub.invalid"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("through the proxy"), std::string::npos) << msg;
  proxy.stop();
  t.join();
}

TEST(HubCache, RemoveASnapshotKeepsWhatOthersShare) {
  FakeHub hub;
  FakeRepo repo = fixture_repo(fixture("model"));
  const std::string c1 = main_commit(), c2 = test_commit("dev");
  auto files2 = repo.commits[c1];
  files2["generation_config.json"] = "{}";
  repo.commits[c2] = files2;
  repo.branches["dev"] = c2;
  hub.add_repo(kRepo, repo);
  const std::string cache = temp_dir("hub_rm");
  const HubSettings s = settings_for(hub, cache);
  resolve_model(kRef, s, Notes().notify());
  resolve_model(*parse_model_ref(std::string(kRepo) + "@dev"), s, Notes().notify());
  const HubCache hc(cache);
  const auto r = remove_cached_model(hc, *parse_model_ref(std::string(kRepo) + "@dev"));
  EXPECT_EQ(r.removed, std::vector<std::string>{std::string(kRepo) + "@" + c2});
  EXPECT_EQ(r.bytes_freed, 2u) << "only the blob no other snapshot uses ({})";
  EXPECT_FALSE(fs::exists(repo_dir(cache) / "refs" / "dev"));
  EXPECT_TRUE(fs::exists(repo_dir(cache) / "refs" / "main"));
  EXPECT_TRUE(missing_for_load(repo_dir(cache) / "snapshots" / c1).empty());
  const auto all = remove_cached_model(hc, kRef);
  EXPECT_FALSE(fs::exists(repo_dir(cache)));
  EXPECT_FALSE(fs::exists(fs::path(cache) / ".locks" / "models--google--gemma-4-E2B-it"));
  EXPECT_GT(all.bytes_freed, model_file("model.safetensors").size());
  std::string msg = error_of([&] { remove_cached_model(hc, kRef); });
  EXPECT_NE(msg.find("is not in the cache"), std::string::npos) << msg;
}

}  // namespace
