// Failing disks and files that change underneath: export never leaves a half-written bundle,
// refuses folders that are not bundles, and a truncated weights file ends in a message that
// names it instead of a bare SIGBUS (io/file_writer.h, io/mapped_file.h, stage/bundle.h).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "io/file_writer.h"
#include "io/mapped_file.h"
#include "stage/bundle.h"
#include "test_util.h"

using namespace gemstage;
using namespace gemstage::testing;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Runs a shell command line; the exit code, or 128 + signal when a signal ended it.
int shell(const std::string& cmd) {
  const int st = std::system(cmd.c_str());
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  return 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
}

int export_cli(const std::string& args, const std::string& log, const std::string& prefix = "") {
  return shell("bash -c '" + prefix + "exec " + GEMSTAGE_CLI + " export -m " + fixture("model") +
               " " + args + "' > " + log + " 2>&1");
}

// Names in dir that a reader could take for bundle files: manifest.json, *.gsw, and the
// export's partial files.
std::vector<std::string> bundle_like_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (n == "manifest.json" || e.path().extension() == ".gsw" ||
        n.find(".gemstage-partial") != std::string::npos)
      out.push_back(n);
  }
  return out;
}

TEST(ExportAtomic, RefusesAFolderThatIsNotABundleUnlessForced) {
  const std::string dir = temp_dir("export_refuse");
  const std::string out = dir + "/out";
  fs::create_directories(out);
  std::ofstream(out + "/notes.txt") << "mine";
  EXPECT_EQ(export_cli("--out " + out + " --stages 1", dir + "/log"), 1);
  const std::string log = slurp(dir + "/log");
  EXPECT_NE(log.find("notes.txt"), std::string::npos) << log;
  EXPECT_NE(log.find("--force"), std::string::npos) << log;
  EXPECT_TRUE(bundle_like_files(out).empty());

  // A plain file as --out is refused too.
  std::ofstream(dir + "/file") << "x";
  EXPECT_EQ(export_cli("--out " + dir + "/file", dir + "/log2"), 1);
  EXPECT_NE(slurp(dir + "/log2").find("not a folder"), std::string::npos) << slurp(dir + "/log2");

  ASSERT_EQ(export_cli("--out " + out + " --stages 1 --force", dir + "/log3"), 0)
      << slurp(dir + "/log3");
  EXPECT_TRUE(is_bundle_dir(out));
  EXPECT_EQ(slurp(out + "/notes.txt"), "mine");  // --force leaves other files alone

  // An existing bundle is replaced without --force; files of the old layout go, partial files
  // an interrupted export left are cleaned up, and nothing of the new one stays partial.
  std::ofstream(out + "/stale.gsw.gemstage-partial") << "left by a killed export";
  ASSERT_EQ(export_cli("--out " + out + " --stages 2", dir + "/log4"), 0) << slurp(dir + "/log4");
  const BundleManifest m = read_bundle_manifest(out);
  EXPECT_EQ(m.stages.size(), 4u);
  EXPECT_FALSE(fs::exists(out + "/layers_0_6.gsw"));  // the one-stage layout's file
  EXPECT_FALSE(fs::exists(out + "/stale.gsw.gemstage-partial"));
  for (const std::string& f : bundle_like_files(out))
    EXPECT_EQ(f.find(".gemstage-partial"), std::string::npos) << f;
  std::ostringstream check_log;
  EXPECT_EQ(check_bundle(out, {}, check_log), 0) << check_log.str();
}

// Disk full, without mounting anything: the file size limit makes write(2) fail with EFBIG
// (SIGXFSZ ignored, so the write fails instead of the signal killing the process).
TEST(ExportAtomic, DiskFullLeavesNothingThatLooksLikeABundle) {
  const std::string dir = temp_dir("export_full");
  const std::string out = dir + "/out";
  for (const int kib : {1, 256, 1024}) {
    SCOPED_TRACE(kib);
    const std::string log = dir + "/log" + std::to_string(kib);
    EXPECT_EQ(export_cli("--out " + out + " --stages 2", log,
                         "ulimit -f " + std::to_string(kib) + "; trap \"\" XFSZ; "),
              1);
    const std::string text = slurp(log);
    EXPECT_NE(text.find("File too large"), std::string::npos) << text;
    EXPECT_NE(text.find(".gsw"), std::string::npos) << text;       // names the file
    EXPECT_NE(text.find("ulimit -f"), std::string::npos) << text;  // says what to do
    EXPECT_NE(text.find("holds no new bundle"), std::string::npos) << text;
    ASSERT_TRUE(fs::is_directory(out));
    EXPECT_TRUE(bundle_like_files(out).empty()) << bundle_like_files(out).front();
  }
}

TEST(ExportAtomic, AFailedReexportKeepsTheExistingBundle) {
  const std::string dir = temp_dir("export_keep");
  const std::string out = dir + "/out";
  ASSERT_EQ(export_cli("--out " + out, dir + "/log"), 0) << slurp(dir + "/log");
  const std::string manifest = slurp(out + "/manifest.json");
  EXPECT_EQ(export_cli("--out " + out + " --weights f32", dir + "/log2",
                       "ulimit -f 2048; trap \"\" XFSZ; "),
            1);
  EXPECT_NE(slurp(dir + "/log2").find("File too large"), std::string::npos) << slurp(dir + "/log2");
  EXPECT_EQ(slurp(out + "/manifest.json"), manifest);
  std::ostringstream check_log;
  EXPECT_EQ(check_bundle(out, {}, check_log), 0) << check_log.str();
}

TEST(FileWriter, ErrorsNameTheFileAndTheReason) {
  const std::string dir = temp_dir("file_writer");
  const std::string msg = error_of([&] { FileWriter w(dir + "/missing/x.bin"); });
  EXPECT_NE(msg.find(dir + "/missing/x.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("No such file or directory"), std::string::npos) << msg;
  write_file_synced(dir + "/a", "hello");
  EXPECT_EQ(slurp(dir + "/a"), "hello");
}

// A file of n bytes of 'x'.
void make_file(const std::string& path, size_t n) {
  std::ofstream(path, std::ios::binary) << std::string(n, 'x');
}

TEST(MappedFiles, ATruncatedFileIsNamedBeforeAnyReadFaults) {
  const std::string dir = temp_dir("mapped_truncate");
  const std::string path = dir + "/w.gsw";
  make_file(path, 1 << 16);
  MappedFile f(path);
  EXPECT_NO_THROW(check_mapped_files());
  // Replacing by rename keeps the old inode alive under the mapping: still fine.
  make_file(dir + "/new", 10);
  fs::rename(dir + "/new", path);
  EXPECT_NO_THROW(check_mapped_files());
  EXPECT_EQ(f.data()[(1 << 16) - 1], 'x');
  {
    MappedFile g(path);  // the new, 10-byte file
    ASSERT_EQ(::truncate(path.c_str(), 4), 0);
    const std::string msg = error_of([] { check_mapped_files(); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("shrank from 10 to 4 bytes"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(check_mapped_files());  // g is gone, and f's file is intact
}

// The backstop for a truncation that races with a read: the fault handler names the file and
// exits with kMappedFileChangedExit. Run in a child, since the process ends.
TEST(MappedFiles, AFaultInATruncatedMappingNamesTheFile) {
  const std::string dir = temp_dir("mapped_sigbus");
  const std::string path = dir + "/w.gsw";
  make_file(path, 1 << 16);
  const std::string err = dir + "/err";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDERR_FILENO);
    install_mapped_file_fault_handler();
    MappedFile f(path);
    if (::truncate(path.c_str(), 0) != 0) ::_exit(2);
    volatile uint8_t v = f.data()[(1 << 16) - 1];  // faults: the page is gone
    (void)v;
    ::_exit(3);
  }
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  ASSERT_TRUE(WIFEXITED(st)) << "signal " << (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
  EXPECT_EQ(WEXITSTATUS(st), kMappedFileChangedExit);
  const std::string text = slurp(err);
  EXPECT_NE(text.find(path), std::string::npos) << text;
  EXPECT_NE(text.find("changed on disk"), std::string::npos) << text;
}

// `gemstage serve` on a bundle whose .gsw is truncated while it runs: the next request is
// refused with a 503 naming the file, /health reports it, and the process never dies of SIGBUS.
TEST(MappedFiles, ServeRefusesRequestsOnceABundleFileIsTruncated) {
  const std::string dir = temp_dir("serve_truncate");
  const std::string bundle = dir + "/bundle";
  ASSERT_EQ(export_cli("--out " + bundle + " --stages 1", dir + "/log"), 0) << slurp(dir + "/log");
  const std::string err = dir + "/serve.err";
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    const int fd = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(fd, STDERR_FILENO);
    ::dup2(fd, STDOUT_FILENO);
    ::execl(GEMSTAGE_CLI, GEMSTAGE_CLI, "serve", "-m", bundle.c_str(), "--port", "0", "-t", "1",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  // The port it chose, from its "listening on http://127.0.0.1:PORT" line.
  int port = -1;
  for (int i = 0; i < 600 && port < 0; ++i) {
    const std::string text = slurp(err);
    const std::string key = "listening on http://127.0.0.1:";
    const size_t at = text.find(key);
    if (at != std::string::npos &&
        text.find_first_not_of("0123456789", at + key.size()) != std::string::npos)
      port = std::stoi(text.substr(at + key.size()));
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GT(port, 0) << slurp(err);
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(120, 0);
  bool ready = false;
  for (int i = 0; i < 1200 && !ready; ++i) {
    auto h = c.Get("/health");
    ready = h && h->status == 200;
    if (!ready) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(ready) << slurp(err);
  const json body = {{"messages", {{{"role", "user"}, {"content", "hi"}}}}, {"max_tokens", 2}};
  auto ok = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;

  const std::string gsw = bundle + "/layers_0_6.gsw";
  ASSERT_TRUE(fs::exists(gsw));
  fs::resize_file(gsw, fs::file_size(gsw) / 2);
  auto r = c.Post("/v1/chat/completions", body.dump(), "application/json");
  ASSERT_TRUE(r) << "no answer: " << slurp(err);
  EXPECT_EQ(r->status, 503) << r->body;
  EXPECT_NE(r->body.find("layers_0_6.gsw"), std::string::npos) << r->body;
  EXPECT_NE(r->body.find("model_file_changed"), std::string::npos) << r->body;
  auto h = c.Get("/health");
  ASSERT_TRUE(h);
  EXPECT_EQ(h->status, 503);
  EXPECT_NE(h->body.find("layers_0_6.gsw"), std::string::npos) << h->body;

  ::kill(pid, SIGTERM);
  int st = 0;
  ASSERT_EQ(waitpid(pid, &st, 0), pid);
  EXPECT_FALSE(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS) << slurp(err);
  EXPECT_NE(slurp(err).find("layers_0_6.gsw"), std::string::npos) << slurp(err);
}

}  // namespace
