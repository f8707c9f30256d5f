// `mpirun -np K gemstage ...` end to end (issue 22): stages on separate processes give the one
// process's logits and greedy ids for text and image prompts, a rank with another bundle is
// refused, a killed worker ends a request with an error naming it (no hang) and /health says so,
// and stage traffic crosses a real network interface between two network namespaces.
// Every run is bounded by `timeout`; these tests run one at a time (RUN_SERIAL).
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "../test_util.h"
#include "io/npy.h"
#include "stage/bundle.h"

namespace gemstage {
namespace {

using testing::fixture;

const std::string kCli = GEMSTAGE_CLI;

std::string slurp(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// Runs a shell command, its output into `log`; returns the exit status.
int sh(const std::string& cmd, const std::string& log) {
  const int rc = std::system((cmd + " > " + log + " 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : 128 + WTERMSIG(rc);
}

// A capability this machine lacks (mpirun cannot start ranks, network namespaces cannot be made)
// fails the test: a skip would pass in ctest and hide that nothing was tested. Where that is known
// and accepted (a developer without root), GEMSTAGE_ALLOW_MPI_SKIP=1 turns it into a skip that
// says what went untested; scripts/test.sh repeats that at the end of its run.
bool mpi_skip_allowed() {
  const char* v = std::getenv("GEMSTAGE_ALLOW_MPI_SKIP");
  return v != nullptr && std::string(v) == "1";
}
#define GEMSTAGE_MISSING_CAPABILITY(why)                                                       \
  do {                                                                                         \
    if (mpi_skip_allowed()) GTEST_SKIP() << "NOT TESTED (GEMSTAGE_ALLOW_MPI_SKIP=1): " << why; \
    FAIL() << why << " (set GEMSTAGE_ALLOW_MPI_SKIP=1 to skip this knowingly)";                \
  } while (false)

std::string mpirun(int np) {
  return "timeout 120 mpirun --oversubscribe -np " + std::to_string(np) + " ";
}

class MpiRun : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    // CI and this machine run as root; Open MPI refuses that unless told.
    setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 1);
    setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 1);
    // Containers (CI's included) often forbid the cross-process memory reads Open MPI's shared
    // memory transport uses for large messages; copying through the shared segment always works.
    setenv("OMPI_MCA_btl_vader_single_copy_mechanism", "none", 1);
    dir_ = new std::string(testing::temp_dir("mpi_run"));
    // Whether this machine can start an MPI job at all (a container without the resources Open
    // MPI needs cannot); if not, every test says why rather than blaming gemstage.
    const std::string probe = *dir_ + "/mpirun_probe.log";
    if (sh("timeout 60 mpirun --oversubscribe -np 2 true", probe) != 0)
      no_mpi_ = new std::string(slurp(probe));
    ExportOptions o;
    o.stages = "2";
    o.weights = "f32";
    o.progress = false;
    export_bundle(fixture("model"), *dir_ + "/b", o);
  }
  void SetUp() override {
    if (no_mpi_)
      GEMSTAGE_MISSING_CAPABILITY("mpirun cannot start 2 ranks on this machine: " << *no_mpi_);
  }
  static std::string dir() { return *dir_; }
  static std::string bundle() { return *dir_ + "/b"; }
  static std::string* dir_;
  static std::string* no_mpi_;
};
std::string* MpiRun::dir_ = nullptr;
std::string* MpiRun::no_mpi_ = nullptr;

// dump's taps of one run, single process or under mpirun.
void expect_same_taps(const std::string& a, const std::string& b) {
  for (const char* tap : {"logits", "decode_logits"}) {
    const NpyArray x = load_npy(a + "/" + tap + ".npy"), y = load_npy(b + "/" + tap + ".npy");
    ASSERT_EQ(x.shape, y.shape) << tap;
    EXPECT_LE(testing::max_abs_diff(x.to_f32(), y.to_f32()), 1e-6) << tap;
  }
  EXPECT_EQ(load_npy(a + "/decode_ids.npy").to_i64(), load_npy(b + "/decode_ids.npy").to_i64());
}

TEST_F(MpiRun, TextAndImagePromptsGiveTheOneProcessLogitsAndIds) {
  struct Case {
    const char* name;
    std::string args;
  };
  const Case cases[] = {
      {"text", "--ids " + fixture("text/input_ids.npy")},
      // The image rows: the splice mask and the PAD identity of the per-layer inputs are made
      // on rank 0 and must survive the wire to the transformer ranks.
      {"image", "--ids " + fixture("multimodal/input_ids.npy") + " --image " +
                    fixture("multimodal/image.png")},
  };
  for (const Case& c : cases) {
    const std::string one = dir() + "/one_" + c.name, three = dir() + "/three_" + c.name;
    const std::string common = " dump -m " + bundle() + " " + c.args +
                               " --taps logits,decode_ids,decode_logits --decode 6 -t 1 --out ";
    ASSERT_EQ(sh(kCli + common + one, one + ".log"), 0) << slurp(one + ".log");
    ASSERT_EQ(sh(mpirun(3) + kCli + common + three, three + ".log"), 0) << slurp(three + ".log");
    EXPECT_NE(slurp(three + ".log").find("3 ranks; 0=embeddings,head 1=layers_0_2 2=layers_2_6"),
              std::string::npos)
        << slurp(three + ".log");
    expect_same_taps(one, three);
  }
  // Against the reference too: the split run is the model, not just equal to itself.
  const NpyArray got = load_npy(dir() + "/three_image/logits.npy");
  const NpyArray ref = load_npy(fixture("multimodal/logits.npy"));
  ASSERT_EQ(got.shape, ref.shape);
  EXPECT_LE(testing::max_abs_diff(got.to_f32(), ref.to_f32()), 2e-4);
}

TEST_F(MpiRun, PlacementFlagPutsBothTransformerStagesOnOneRank) {
  const std::string out = dir() + "/placed";
  const std::string cmd = mpirun(2) + kCli + " dump -m " + bundle() + " --ids " +
                          fixture("text/input_ids.npy") +
                          " --taps logits,decode_ids,decode_logits --decode 3 -t 1 --out " + out +
                          " --placement '0=embeddings,head 1=layers_0_2,layers_2_6'";
  ASSERT_EQ(sh(cmd, out + ".log"), 0) << slurp(out + ".log");
  EXPECT_NE(slurp(out + ".log").find("1=layers_0_2,layers_2_6"), std::string::npos);
  const std::string bad = dir() + "/bad_placement";
  EXPECT_NE(sh(mpirun(2) + kCli + " generate -m " + bundle() +
                   " -p hi -n 1 --placement '0=head 1=embeddings,layers_0_2,layers_2_6'",
               bad + ".log"),
            0);
  EXPECT_NE(slurp(bad + ".log").find("must be on rank 0"), std::string::npos)
      << slurp(bad + ".log");
}

TEST_F(MpiRun, ARankGivenAnotherBundleIsRefusedNamingRankAndHost) {
  // Same stages, other weights: rank 2 opens this one (MPMD: one command line per rank group).
  const std::string other = dir() + "/other";
  ExportOptions o;
  o.stages = "2";
  o.weights = "bf16";
  o.progress = false;
  export_bundle(fixture("model"), other, o);
  const std::string log = dir() + "/mismatch.log";
  const auto t0 = std::chrono::steady_clock::now();
  const int rc =
      sh("timeout 120 mpirun --oversubscribe -np 2 " + kCli + " generate -m " + bundle() +
             " -p hi -n 2 -t 1 : -np 1 " + kCli + " generate -m " + other + " -p hi -n 2 -t 1",
         log);
  EXPECT_NE(rc, 0);
  EXPECT_NE(rc, 124) << "timed out";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(60));
  const std::string text = slurp(log);
  EXPECT_NE(text.find("rank 2 on host"), std::string::npos) << text;
  EXPECT_NE(text.find("opened another bundle"), std::string::npos) << text;
}

// Two hosts simulated by two network namespaces joined by a veth pair: rank 2 runs in the second
// namespace (Open MPI starts it there through an `ip netns exec` launcher in place of ssh), and
// its stage traffic crosses the veth interface, TCP only. Needs the right to create namespaces
// (root with CAP_SYS_ADMIN, as CI has); where that is missing it fails (see mpi_skip_allowed).
TEST_F(MpiRun, StageTrafficCrossesAVethPairBetweenTwoNetworkNamespaces) {
  const std::string tag = std::to_string(getpid() % 100000);
  const std::string a = "gsA" + tag, b = "gsB" + tag, va = "vA" + tag, vb = "vB" + tag;
  const std::string net = "10.77." + std::to_string(getpid() % 200) + ".";
  const std::string log = dir() + "/netns.log";
  if (sh("ip netns add " + a, log) != 0)
    GEMSTAGE_MISSING_CAPABILITY("cannot create network namespaces here ("
                                << slurp(log)
                                << "); the two-host test needs root with CAP_SYS_ADMIN");
  struct Namespaces {
    std::string a, b, log;
    ~Namespaces() { sh("ip netns del " + a + "; ip netns del " + b, log); }
  } cleanup{a, b, log};
  const std::string ha = net + "1", hb = net + "2";
  ASSERT_EQ(sh("ip netns add " + b + " && ip link add " + va + " type veth peer name " + vb +
                   " && ip link set " + va + " netns " + a + " && ip link set " + vb + " netns " +
                   b + " && ip -n " + a + " addr add " + ha + "/24 dev " + va + " && ip -n " + b +
                   " addr add " + hb + "/24 dev " + vb + " && ip -n " + a + " link set " + va +
                   " up && ip -n " + b + " link set " + vb + " up && ip -n " + a +
                   " link set lo up && ip -n " + b + " link set lo up",
               log),
            0)
      << slurp(log);
  // Open MPI's launcher calls "AGENT [options] HOST COMMAND"; this one enters HOST's namespace.
  const std::string agent = dir() + "/netns_agent.sh";
  {
    std::ofstream f(agent);
    f << "#!/bin/sh\nwhile [ $# -gt 0 ]; do case \"$1\" in -*) shift;; *) break;; esac; done\n"
      << "host=$1; shift\ncase \"$host\" in " << hb << ") ns=" << b << " ;; *) ns=" << a
      << " ;; esac\nexec ip netns exec \"$ns\" /bin/sh -c \"$*\"\n";
  }
  std::filesystem::permissions(agent, std::filesystem::perms::owner_all);
  const auto tx_bytes = [&] {
    const std::string out = dir() + "/tx";
    sh("ip netns exec " + a + " cat /sys/class/net/" + va + "/statistics/tx_bytes", out);
    return std::atoll(slurp(out).c_str());
  };
  const long long before = tx_bytes();
  const std::string one = dir() + "/one_text", two_hosts = dir() + "/two_hosts";
  if (!std::filesystem::exists(one + "/logits.npy")) {
    ASSERT_EQ(sh(kCli + " dump -m " + bundle() + " --ids " + fixture("text/input_ids.npy") +
                     " --taps logits,decode_ids,decode_logits --decode 6 -t 1 --out " + one,
                 one + ".log"),
              0);
  }
  const std::string cmd =
      "timeout 120 ip netns exec " + a + " mpirun --oversubscribe -np 3 --host " + ha + ":2," + hb +
      ":1 --mca plm_rsh_agent " + agent + " --mca btl self,tcp --mca btl_tcp_if_include " + net +
      "0/24 --mca oob_tcp_if_include " + net + "0/24 " + kCli + " dump -m " + bundle() + " --ids " +
      fixture("text/input_ids.npy") +
      " --taps logits,decode_ids,decode_logits --decode 6 -t 1 --out " + two_hosts;
  ASSERT_EQ(sh(cmd, two_hosts + ".log"), 0) << slurp(two_hosts + ".log");
  expect_same_taps(one, two_hosts);
  // Rank 2's stage got the hidden states (f32, 128 wide) of 24 prompt rows and 5 decoded ones,
  // and its per-layer inputs, through the veth.
  const long long sent = tx_bytes() - before;
  EXPECT_GT(sent, 29 * 128 * 4) << "bytes sent over " << va << ": " << sent;
}

// The pid of the gemstage process of `rank` whose command line names `marker`.
pid_t pid_of_rank(const std::string& marker, int rank) {
  const std::string want = "OMPI_COMM_WORLD_RANK=" + std::to_string(rank);
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const std::string cmd = slurp(e.path() / "cmdline");
    if (cmd.find(marker) == std::string::npos || cmd.find("gemstage") == std::string::npos ||
        cmd.find("mpirun") != std::string::npos)
      continue;
    const std::string env = slurp(e.path() / "environ");
    if (env.find(want + '\0') != std::string::npos) return std::stoi(name);
  }
  return -1;
}

// Whether pid is a process that has not ended (a zombie has: its parent just has not reaped it).
bool running(pid_t pid) {
  const std::string stat = slurp("/proc/" + std::to_string(pid) + "/stat");
  const size_t paren = stat.rfind(')');
  return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
}

// The workers' silence limit at --stage-timeout 2 (worker_silence_limit in
// src/distributed/mpi_launch.cc: the larger of 10 s and twice the stage timeout).
constexpr auto kWorkerSilenceLimit = std::chrono::seconds(10);

// GET /metrics, and the value of one series in it ("" when absent).
std::string metrics(httplib::Client& c) {
  const auto r = c.Get("/metrics");
  return r && r->status == 200 ? r->body : std::string();
}
std::string metric_value(const std::string& text, const std::string& series) {
  const size_t at = text.find("\n" + series);
  if (at == std::string::npos) return "";
  const size_t from = at + 1 + series.size();
  return text.substr(from, text.find('\n', from) - from);
}

// `serve` started by a shell command (under mpirun or not), up and answering /health; the job
// ends with the object.
class ServeJob {
 public:
  // cmd: the command line; its output goes to `log`. `exec` in it makes the launcher's pid the
  // job's, so signals to pid() reach it (and mpirun passes them to its ranks).
  ServeJob(const std::string& cmd, const std::string& log) : log_(log) {
    pid_ = fork();
    if (pid_ == 0) {
      setpgid(0, 0);
      const std::string full = cmd + " > " + log + " 2>&1";
      execl("/bin/sh", "sh", "-c", full.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
  }
  ~ServeJob() {
    // Already reaped when a test saw the job end; otherwise ask, then force.
    if (pid_ <= 0 || waitpid(pid_, nullptr, WNOHANG) != 0) return;
    kill(pid_, SIGTERM);
    for (int i = 0; i < 100; ++i) {
      if (waitpid(pid_, nullptr, WNOHANG) == pid_) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    kill(-pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
  ServeJob(const ServeJob&) = delete;
  ServeJob& operator=(const ServeJob&) = delete;

  // Waits for the port the server took (--port 0: any free one, from its start-up line) and for
  // /health to answer 200; false (the log says why) if that does not happen within 120 s. A
  // 3-rank job started beside a 1-rank one is four processes on a 2-core CI machine, and Open
  // MPI's ranks poll while they wait: such a start took over 30 s now and then.
  bool wait_up() {
    const std::string listening = "listening on http://127.0.0.1:";
    for (int i = 0; i < 1200 && port_ == 0; ++i) {
      const std::string text = slurp(log_);
      if (const auto at = text.find(listening); at != std::string::npos)
        port_ = std::atoi(text.c_str() + at + listening.size());
      if (port_ == 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (port_ == 0) return false;
    httplib::Client c = client();
    for (int i = 0; i < 1200; ++i) {
      const auto r = c.Get("/health");
      if (r && r->status == 200) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    return false;
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  pid_t pid() const { return pid_; }
  std::string log() const { return slurp(log_); }

 private:
  std::string log_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// Four requests at once on a server whose transformer stages are on two other ranks: the engine
// keeps one call per rank in flight (pipeline depth 3), and every reply is the one the single
// process gives.
TEST_F(MpiRun, ConcurrentRequestsPipelinedOverRanksGetTheOneProcessReplies) {
  const std::string serve = kCli + " serve -m " + bundle() + " --port 0 -t 1 -np 4";
  // exec: without it the job's pid is the shell's, and SIGTERM at the end left serve running.
  ServeJob one("exec " + serve, dir() + "/serve_one.log");
  ServeJob three("exec mpirun --oversubscribe -np 3 " + serve, dir() + "/serve_three.log");
  ASSERT_TRUE(one.wait_up()) << one.log();
  ASSERT_TRUE(three.wait_up()) << three.log();
  const auto health = three.client().Get("/health");
  ASSERT_TRUE(health);
  EXPECT_NE(health->body.find("\"pipeline_depth\":3"), std::string::npos) << health->body;
  auto replies = [](const ServeJob& job) {
    std::vector<std::string> texts(4);
    std::vector<std::thread> clients;
    for (int k = 0; k < 4; ++k)
      clients.emplace_back([&, k] {
        const std::string body = R"({"prompt":"Request )" + std::to_string(k) +
                                 R"( says","max_tokens":)" + std::to_string(10 + 3 * k) +
                                 R"(,"temperature":0})";
        const auto r = job.client().Post("/v1/completions", body, "application/json");
        texts[k] = r ? std::to_string(r->status) + " " + r->body : "no reply";
      });
    for (auto& t : clients) t.join();
    return texts;
  };
  const std::vector<std::string> want = replies(one), got = replies(three);
  for (int k = 0; k < 4; ++k) {
    ASSERT_EQ(want[k].rfind("200 ", 0), 0u) << want[k];
    ASSERT_EQ(got[k].rfind("200 ", 0), 0u) << got[k] << "\n" << three.log();
    // The ids and timings of the replies differ; the texts must not.
    auto text = [](const std::string& reply) {
      const auto at = reply.find("\"text\":");
      return reply.substr(at, reply.find("\"", at + 8) - at);
    };
    EXPECT_EQ(text(got[k]), text(want[k])) << "request " << k;
  }
}

TEST_F(MpiRun, AKilledWorkerEndsTheRequestWithAnErrorAndHealthSaysSo) {
  // --enable-recovery keeps rank 0 (the server) up when a worker dies, so it can answer.
  ServeJob job("exec mpirun --enable-recovery --oversubscribe -np 3 " + kCli + " serve -m " +
                   bundle() + " --port 0 -t 1 --stage-timeout 2",
               dir() + "/serve.log");
  ASSERT_GT(job.pid(), 0);
  ASSERT_TRUE(job.wait_up()) << job.log();
  const pid_t launcher = job.pid();
  httplib::Client c = job.client();
  auto slurp_log = [&] { return job.log(); };
  const std::string body = R"({"prompt":"hello","max_tokens":4})";
  auto r = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;

  const pid_t worker = pid_of_rank(bundle(), 2);
  ASSERT_GT(worker, 0);
  ASSERT_EQ(kill(worker, SIGKILL), 0);
  const auto t0 = std::chrono::steady_clock::now();
  r = c.Post("/v1/completions", body, "application/json");
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_TRUE(r) << "no reply: " << slurp_log();
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_NE(r->body.find("stage layers_2_6 on rank 2 (host "), std::string::npos) << r->body;
  EXPECT_LT(waited, 20.0) << "the failed request took " << waited << " s";
  r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("stage_failed"), std::string::npos) << r->body;
  // A request that arrives now is refused at once, not queued behind a dead rank: it never
  // reaches the engine, so no prompt token is counted and no request ends as failed.
  const std::string before = metrics(c);
  r = c.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 503);
  EXPECT_NE(r->body.find("stage_failed"), std::string::npos) << r->body;
  const std::string after = metrics(c);
  for (const char* series :
       {"gemstage_prompt_tokens_total ", "gemstage_requests_total{outcome=\"failed\"} "})
    EXPECT_EQ(metric_value(after, series), metric_value(before, series)) << series;
  // The service stops when told (the supervisor's restart), ending the whole job.
  kill(launcher, SIGTERM);
  bool ended = false;
  for (int i = 0; i < 300 && !ended; ++i) {
    ended = waitpid(launcher, nullptr, WNOHANG) == launcher;
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ended) << "the job did not end within 30 s of SIGTERM";
}

// Rank 0 (the server) dies under --enable-recovery: its workers notice the silence and leave,
// so the job ends and a supervisor can start it again, rather than the workers keeping the dead
// job alive for ever.
TEST_F(MpiRun, WorkersLeaveWhenRankZeroDies) {
  ServeJob job("exec mpirun --enable-recovery --oversubscribe -np 3 " + kCli + " serve -m " +
                   bundle() + " --port 0 -t 1 --stage-timeout 2",
               dir() + "/serve_rank0.log");
  ASSERT_TRUE(job.wait_up()) << job.log();
  // The workers entered their loops (and started their silence clocks) before rank 0 answered
  // /health: the handshake comes first. Watch them idle past the silence limit, failing the
  // moment one leaves; rank 0's keep-alives must hold them. The workers themselves are watched,
  // not the job: under --enable-recovery the job outlives a worker.
  const auto up = std::chrono::steady_clock::now();
  const pid_t workers[] = {pid_of_rank(bundle(), 1), pid_of_rank(bundle(), 2)};
  for (pid_t w : workers) ASSERT_GT(w, 0) << job.log();
  while (std::chrono::steady_clock::now() - up < kWorkerSilenceLimit + std::chrono::seconds(1)) {
    for (pid_t w : workers)
      ASSERT_TRUE(running(w)) << "worker " << w << " left while rank 0 lived\n" << job.log();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_EQ(waitpid(job.pid(), nullptr, WNOHANG), 0) << "the job ended while rank 0 lived\n"
                                                     << job.log();
  const pid_t rank0 = pid_of_rank(bundle(), 0);
  ASSERT_GT(rank0, 0);
  ASSERT_EQ(kill(rank0, SIGKILL), 0);
  bool ended = false;
  for (int i = 0; i < 400 && !ended; ++i) {
    ended = waitpid(job.pid(), nullptr, WNOHANG) == job.pid();
    if (!ended) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(ended) << "the job outlived rank 0 by 40 s\n" << job.log();
  EXPECT_NE(job.log().find("rank 0 sent nothing for 10 s"), std::string::npos) << job.log();
}

}  // namespace
}  // namespace gemstage
