// Models by name (issue 47), the command line: `pull`, `ls`, `rm`, `-m ORG/NAME` / `-hf` on the
// commands that take a model, run from the cache offline and from the in-process Hub
// (hub_fake_server.h): concurrent pulls, a full disk, gated repositories, TLS.
#include <gtest/gtest.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "hub_fake_server.h"
#include "io/npy.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;
namespace fs = std::filesystem;

namespace {

const std::string kRepo = "google/gemma-4-E2B-it";
const std::vector<std::string> kWanted = {"config.json", "model.safetensors",
                                          "preprocessor_config.json", "tokenizer.json",
                                          "tokenizer_config.json"};

std::string slurp(const std::string& p) {
  std::ifstream in(p);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The environment of one CLI run: this endpoint and cache, and nothing inherited that would
// change where it connects or which token it sends.
std::string hub_env(const std::string& endpoint, const std::string& cache) {
  std::string e = "env";
  for (const char* v : {"HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY",
                        "all_proxy", "NO_PROXY", "no_proxy", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN",
                        "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "SSL_CERT_FILE",
                        "SSL_CERT_DIR", "HUGGINGFACE_HUB_CACHE"})
    e += std::string(" -u ") + v;
  return e + " HF_ENDPOINT=" + endpoint + " HF_HUB_CACHE=" + cache + " HF_HOME=" + cache +
         "/home HF_HUB_DISABLE_PROGRESS_BARS=1 ";
}

int run(const std::string& env, const std::string& args, const std::string& out,
        const std::string& err) {
  const std::string cmd =
      env + std::string(GEMSTAGE_CLI) + " " + args + " > " + out + " 2> " + err + " < /dev/null";
  return std::system(cmd.c_str());
}

std::string main_commit() {
  return test_commit("main of the fixture");
}

fs::path snapshot_of(const std::string& cache, const std::string& commit) {
  return fs::path(cache) / "models--google--gemma-4-E2B-it" / "snapshots" / commit;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s;
}

TEST(HubCli, PullListRemove) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string dir = temp_dir("hubcli_pull"), cache = dir + "/cache";
  const std::string env = hub_env(hub.endpoint(), cache);
  ASSERT_EQ(run(env, "pull -j 2 " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  const fs::path snap = snapshot_of(cache, main_commit());
  EXPECT_EQ(trim(slurp(dir + "/out")), snap.string());
  EXPECT_NE(slurp(dir + "/err").find("commit " + main_commit()), std::string::npos)
      << slurp(dir + "/err");
  ASSERT_EQ(run(env, "ls", dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  const std::string table = slurp(dir + "/out");
  const size_t line = table.find(kRepo);
  ASSERT_NE(line, std::string::npos) << table;
  const std::string row = table.substr(line, table.find('\n', line) - line);
  EXPECT_NE(row.find(" main "), std::string::npos) << row;
  EXPECT_NE(row.find(main_commit().substr(0, 12)), std::string::npos) << row;
  EXPECT_NE(row.find("yes"), std::string::npos) << row;
  ASSERT_EQ(run(env, "ls --json", dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  const auto j = nlohmann::json::parse(slurp(dir + "/out"));
  ASSERT_EQ(j.size(), 1u);
  EXPECT_EQ(j[0]["model"], kRepo);
  EXPECT_EQ(j[0]["runs"], true);
  EXPECT_EQ(j[0]["path"], snap.string());
  // Pulling again downloads nothing.
  hub.reset_stats();
  ASSERT_EQ(run(env, "pull " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_NE(slurp(dir + "/err").find("nothing to download"), std::string::npos);
  EXPECT_EQ(hub.requests(), 1);

  // One snapshot by revision (the last one: the model's folder goes with it), then all of it.
  ASSERT_EQ(run(env, "rm " + kRepo + "@main", dir + "/out", dir + "/err"), 0)
      << slurp(dir + "/err");
  EXPECT_NE(slurp(dir + "/err").find("removed " + kRepo + "@" + main_commit()), std::string::npos)
      << slurp(dir + "/err");
  EXPECT_FALSE(fs::exists(snap));
  ASSERT_EQ(run(env, "ls", dir + "/out", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("no models"), std::string::npos) << slurp(dir + "/err");
  ASSERT_EQ(run(env, "pull " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  ASSERT_EQ(run(env, "rm " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_NE(slurp(dir + "/err").find("removed " + kRepo + "\n"), std::string::npos)
      << slurp(dir + "/err");
  EXPECT_FALSE(fs::exists(fs::path(cache) / "models--google--gemma-4-E2B-it"));
  EXPECT_NE(run(env, "rm " + kRepo, dir + "/out", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("is not in the cache"), std::string::npos);
  EXPECT_NE(run(env, "pull not-a-model-name", dir + "/out", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("ORG/NAME"), std::string::npos) << slurp(dir + "/err");
}

// The README's quick start: a name, downloaded, verified and run.
TEST(HubCli, GenerateByNameDownloadsAndRuns) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string dir = temp_dir("hubcli_quickstart"), cache = dir + "/cache";
  ASSERT_EQ(run(hub_env(hub.endpoint(), cache),
                "generate -m " + kRepo + " -p \"Why is the sky blue?\" -n 4 --temp 0", dir + "/out",
                dir + "/err"),
            0)
      << slurp(dir + "/err");
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("model " + kRepo + ": commit " + main_commit()), std::string::npos) << err;
  EXPECT_NE(err.find(snapshot_of(cache, main_commit()).string()), std::string::npos) << err;
  EXPECT_EQ(hub.stats("model.safetensors").gets, 1);
}

TEST(HubCli, ByNameFromAHuggingfaceHubCacheOffline) {
  const std::string dir = temp_dir("hubcli_offline"), cache = dir + "/cache";
  write_hf_cache_snapshot(cache, kRepo, fixture("model"), main_commit());
  // Offline, and the endpoint is a port nothing listens on: any request would fail.
  const std::string env = hub_env("http://127.0.0.1:1", cache) + "HF_HUB_OFFLINE=1 ";

  // Golden decode ids from the reference implementation, by name.
  ASSERT_EQ(run(env,
                "dump -m " + kRepo + " --ids " + fixture("text/input_ids.npy") +
                    " --decode 8 --taps decode_ids --out " + dir + "/taps",
                dir + "/out", dir + "/err"),
            0)
      << slurp(dir + "/err");
  const auto golden = load_npy(fixture("text/decode_ids.npy")).to_i64();
  const auto ours = load_npy(dir + "/taps/decode_ids.npy").to_i64();
  ASSERT_GE(golden.size(), 8u);
  ASSERT_EQ(ours.size(), 8u);
  for (size_t i = 0; i < ours.size(); ++i) EXPECT_EQ(ours[i], golden[i]) << i;

  // generate by name equals generate by path.
  const std::string args = " -p \"Hello there\" --temp 0 -n 8 --json -t 2";
  ASSERT_EQ(run(env, "generate -m " + kRepo + args, dir + "/by_name", dir + "/err"), 0)
      << slurp(dir + "/err");
  EXPECT_NE(slurp(dir + "/err").find("commit " + main_commit()), std::string::npos);
  ASSERT_EQ(run(env, "generate -m " + fixture("model") + args, dir + "/by_path", dir + "/err2"), 0)
      << slurp(dir + "/err2");
  const auto a = nlohmann::json::parse(slurp(dir + "/by_name"));
  const auto b = nlohmann::json::parse(slurp(dir + "/by_path"));
  EXPECT_FALSE(a["tokens"].empty());
  EXPECT_EQ(a["tokens"], b["tokens"]);

  // -hf is llama.cpp's spelling; info takes it like --model.
  ASSERT_EQ(run(env, "info -hf " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_NE(slurp(dir + "/out").find("D=128"), std::string::npos) << slurp(dir + "/out");
  // --help never resolves (nor downloads) a name.
  EXPECT_EQ(run(env, "generate -m google/not-cached --help", dir + "/out", dir + "/err"), 0)
      << slurp(dir + "/err");

  // A model the cache lacks, offline: an error that names it and says what to run.
  EXPECT_NE(run(env, "generate -m google/not-cached -p hi", dir + "/out", dir + "/err"), 0);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("google/not-cached is not in the Hugging Face cache"), std::string::npos)
      << err;
  EXPECT_NE(err.find("gemstage pull google/not-cached"), std::string::npos) << err;
  // llama.cpp's ORG/NAME:QUANT is refused with the reason.
  EXPECT_NE(run(env, "info -hf " + kRepo + ":Q4_K_M", dir + "/out", dir + "/err"), 0);
  EXPECT_NE(slurp(dir + "/err").find("GGUF"), std::string::npos) << slurp(dir + "/err");
  // A local path that exists wins over a name (a folder called google/gemma-4-E2B-it here).
  fs::create_directories(dir + "/google");
  fs::create_directory_symlink(fixture("model"), dir + "/google/gemma-4-E2B-it");
  const std::string in_dir = "cd " + dir + " && " + env;
  ASSERT_EQ(run(in_dir, "info -m " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_EQ(slurp(dir + "/err").find("commit"), std::string::npos) << slurp(dir + "/err");
}

// serve takes -m like every command: the central hook resolves it before serve's own checks.
TEST(HubCli, ServeTakesAModelByName) {
  const std::string dir = temp_dir("hubcli_serve"), cache = dir + "/cache";
  write_hf_cache_snapshot(cache, kRepo, fixture("model"), main_commit());
  const std::string env = hub_env("http://127.0.0.1:1", cache) + "HF_HUB_OFFLINE=1 ";
  const std::string cmd = env + std::string(GEMSTAGE_CLI) + " serve -m " + kRepo + "@main" +
                          " --port 0 -t 2 > " + dir + "/out 2> " + dir +
                          "/err < /dev/null & echo $! > " + dir + "/pid";
  ASSERT_EQ(std::system(cmd.c_str()), 0);
  const pid_t pid = std::stoi(slurp(dir + "/pid"));
  int port = 0;
  for (int i = 0; i < 1200 && port == 0; ++i) {
    const std::string err = slurp(dir + "/err");
    const std::string mark = "listening on http://127.0.0.1:";
    if (const size_t at = err.find(mark); at != std::string::npos)
      port = std::atoi(err.c_str() + at + mark.size());
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  bool healthy = false;
  if (port != 0) {
    httplib::Client cli("127.0.0.1", port);
    for (int i = 0; i < 1200 && !healthy; ++i) {
      auto res = cli.Get("/health");
      healthy = res && res->status == 200;
      if (!healthy) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (healthy) {
      auto models = cli.Get("/v1/models");
      ASSERT_TRUE(models);
      EXPECT_EQ(models->status, 200);
    }
  }
  ::kill(pid, SIGTERM);
  for (int i = 0; i < 300 && ::kill(pid, 0) == 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_NE(port, 0) << slurp(dir + "/err");
  EXPECT_TRUE(healthy) << slurp(dir + "/err");
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("model " + kRepo + "@main: commit " + main_commit()), std::string::npos)
      << err;
  EXPECT_NE(err.find("(loading " + snapshot_of(cache, main_commit()).string()), std::string::npos)
      << err;
}

TEST(HubCli, TwoConcurrentPullsDownloadOnceAndBothSucceed) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  // The weights' GET waits until both processes asked about the file, so the two runs overlap.
  hub.hold_until_heads("model.safetensors", 2);
  const std::string dir = temp_dir("hubcli_concurrent"), cache = dir + "/cache";
  const std::string env = hub_env(hub.endpoint(), cache);
  int rc[2] = {-1, -1};
  std::thread a([&] { rc[0] = run(env, "pull " + kRepo, dir + "/out0", dir + "/err0"); });
  std::thread b([&] { rc[1] = run(env, "pull " + kRepo, dir + "/out1", dir + "/err1"); });
  a.join();
  b.join();
  EXPECT_EQ(rc[0], 0) << slurp(dir + "/err0");
  EXPECT_EQ(rc[1], 0) << slurp(dir + "/err1");
  EXPECT_EQ(slurp(dir + "/out0"), slurp(dir + "/out1"));
  EXPECT_EQ(hub.stats("model.safetensors").heads, 2);
  for (const auto& f : kWanted) EXPECT_LE(hub.stats(f).gets, 1) << f;
  EXPECT_EQ(hub.stats("model.safetensors").gets, 1);
  EXPECT_EQ(hub.stats("model.safetensors").bytes,
            read_bytes(fixture("model/model.safetensors")).size());
  EXPECT_TRUE(file_holds((snapshot_of(cache, main_commit()) / "model.safetensors").string(),
                         read_bytes(fixture("model/model.safetensors"))));
}

// A file size limit (ulimit -f, with SIGXFSZ ignored) makes writes fail like a full disk does.
TEST(HubCli, FullDiskKeepsTheIncompleteFileAndTheNextRunResumes) {
  FakeHub hub;
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  const std::string dir = temp_dir("hubcli_disk"), cache = dir + "/cache";
  const std::string env = hub_env(hub.endpoint(), cache);
  const std::string bytes = read_bytes(fixture("model/model.safetensors"));
  const std::string cmd = "sh -c \"trap '' XFSZ; ulimit -f 4096; exec " + env +
                          std::string(GEMSTAGE_CLI) + " pull " + kRepo + "\" > " + dir +
                          "/out 2> " + dir + "/err < /dev/null";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_NE(err.find("resumes"), std::string::npos) << err;
  const fs::path incomplete = fs::path(cache) / "models--google--gemma-4-E2B-it" / "blobs" /
                              (test_sha256(bytes) + ".incomplete");
  ASSERT_TRUE(fs::exists(incomplete)) << err;
  const uint64_t kept = fs::file_size(incomplete);
  EXPECT_GT(kept, 0u);
  EXPECT_LT(kept, bytes.size());
  EXPECT_FALSE(fs::exists(snapshot_of(cache, main_commit()) / "model.safetensors"));
  EXPECT_FALSE(fs::exists(snapshot_of(cache, main_commit()) / "config.json"));

  ASSERT_EQ(run(env, "pull " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_EQ(hub.stats("model.safetensors").ranges.back(), "bytes=" + std::to_string(kept) + "-");
  EXPECT_TRUE(
      file_holds((snapshot_of(cache, main_commit()) / "model.safetensors").string(), bytes));
}

TEST(HubCli, GatedRepositoryTokenFromTheEnvironmentOrTheTokenFile) {
  FakeHub hub;
  FakeRepo repo = fixture_repo(fixture("model"));
  repo.gated = true;
  repo.accepted_token = "hf_accepted";
  hub.add_repo(kRepo, repo);
  const std::string dir = temp_dir("hubcli_gated"), cache = dir + "/cache";
  const std::string env = hub_env(hub.endpoint(), cache);
  EXPECT_NE(run(env, "pull " + kRepo, dir + "/out", dir + "/err"), 0);
  const std::string err = slurp(dir + "/err");
  EXPECT_NE(err.find(hub.endpoint() + "/" + kRepo), std::string::npos) << err;
  EXPECT_NE(err.find("HF_TOKEN"), std::string::npos) << err;
  ASSERT_EQ(run(env + "HF_TOKEN=hf_accepted ", "pull " + kRepo, dir + "/out", dir + "/err"), 0)
      << slurp(dir + "/err");
  fs::remove_all(cache);
  fs::create_directories(cache + "/home");
  std::ofstream(cache + "/home/token") << "hf_accepted\n";
  ASSERT_EQ(run(env, "pull " + kRepo, dir + "/out", dir + "/err"), 0) << slurp(dir + "/err");
  EXPECT_TRUE(hub.cdn_authorizations().empty());
}

// A self-signed certificate for 127.0.0.1, its own CA.
struct TestCert {
  X509* cert = nullptr;
  EVP_PKEY* key = nullptr;
  TestCert() {
    key = EVP_EC_gen("P-256");
    cert = X509_new();
    X509_set_version(cert, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(cert), 47);
    X509_gmtime_adj(X509_getm_notBefore(cert), -3600);
    X509_gmtime_adj(X509_getm_notAfter(cert), 86400);
    X509_set_pubkey(cert, key);
    X509_NAME* name = X509_get_subject_name(cert);
    X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                               reinterpret_cast<const unsigned char*>("127.0.0.1"), -1, -1, 0);
    X509_set_issuer_name(cert, name);
    X509V3_CTX ctx;
    X509V3_set_ctx_nodb(&ctx);
    X509V3_set_ctx(&ctx, cert, cert, nullptr, nullptr, 0);
    for (auto [nid, value] : {std::pair{NID_subject_alt_name, "IP:127.0.0.1"},
                              std::pair{NID_basic_constraints, "critical,CA:TRUE"}}) {
      X509_EXTENSION* ext = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
      X509_add_ext(cert, ext, -1);
      X509_EXTENSION_free(ext);
    }
    X509_sign(cert, key, EVP_sha256());
  }
  ~TestCert() {
    X509_free(cert);
    EVP_PKEY_free(key);
  }
  void write_pem(const std::string& path) const {
    FILE* f = std::fopen(path.c_str(), "w");
    PEM_write_X509(f, cert);
    std::fclose(f);
  }
};

TEST(HubCli, HttpsVerifiesTheServerAgainstTheCaStore) {
  TestCert tc;
  ASSERT_NE(tc.key, nullptr);
  FakeHub hub(tc.cert, tc.key);
  hub.add_repo(kRepo, fixture_repo(fixture("model")));
  ASSERT_EQ(hub.endpoint().rfind("https://", 0), 0u);
  const std::string dir = temp_dir("hubcli_tls"), cache = dir + "/cache";
  tc.write_pem(dir + "/ca.pem");
  const std::string env = hub_env(hub.endpoint(), cache);
  // The system store does not know this certificate: refused, and said why.
  EXPECT_NE(run(env + "SSL_CERT_DIR=" + dir + "/none SSL_CERT_FILE=" + dir + "/none.pem ",
                "pull " + kRepo, dir + "/out", dir + "/err"),
            0);
  EXPECT_NE(slurp(dir + "/err").find("could not be verified"), std::string::npos)
      << slurp(dir + "/err");
  // OpenSSL's default store, pointed at it the standard way.
  ASSERT_EQ(
      run(env + "SSL_CERT_FILE=" + dir + "/ca.pem ", "pull " + kRepo, dir + "/out", dir + "/err"),
      0)
      << slurp(dir + "/err");
  EXPECT_TRUE(file_holds((snapshot_of(cache, main_commit()) / "model.safetensors").string(),
                         read_bytes(fixture("model/model.safetensors"))));
}

}  // namespace
