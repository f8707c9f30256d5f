// README.md and the CLI, kept from drifting apart: every command line in the README's `sh`
// blocks runs here, in order, on the tiny test models (the names the README uses for a
// checkpoint, a drafter and input files are mapped to fixtures below; outputs land in a fresh
// working directory, so a bundle exported by one line is there for the next). A `serve` line
// starts the server (on a free port), the `curl` lines after it in the same block talk to it,
// and the end of the block stops it with SIGTERM, which must exit 0. The command reference
// table must list every subcommand `gemstage --help` knows, and every flag it names must appear
// in that subcommand's --help. A command line outside an `sh` block, or a line this test cannot
// run, fails. Every link in the README, docs/ and bench/RESULTS.md must resolve inside the
// repository. The sanitizer build runs the same tests on its own binary.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "hub_fake_server.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using gemstage::testing::temp_dir;

const std::string kFixtures = GEMSTAGE_FIXTURES;

std::string readme_path() {
  return (fs::path(kFixtures) / ".." / ".." / "README.md").string();
}

std::string slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

std::string tail(const std::string& s, size_t n = 3000) {
  return s.size() <= n ? s : "..." + s.substr(s.size() - n);
}

struct Line {
  int number;        // README line of the command's first physical line
  std::string text;  // continuation lines joined
};

struct Block {
  std::string lang;
  std::vector<Line> lines;
};

// Fenced blocks (their fences may be indented, as inside list items); "\"-continued lines are
// joined into one.
std::vector<Block> read_blocks(const std::string& path) {
  std::ifstream f(path);
  std::vector<Block> blocks;
  std::string raw;
  int number = 0;
  bool in_block = false;
  std::string pending;
  int pending_line = 0;
  while (std::getline(f, raw)) {
    ++number;
    const std::string t = trim(raw);
    if (t.rfind("```", 0) == 0) {
      if (!in_block) blocks.push_back({trim(t.substr(3)), {}});
      in_block = !in_block;
      continue;
    }
    if (!in_block) continue;
    if (pending.empty()) pending_line = number;
    if (!t.empty() && t.back() == '\\') {
      pending += t.substr(0, t.size() - 1) + " ";
      continue;
    }
    blocks.back().lines.push_back({pending_line, pending + t});
    pending.clear();
  }
  return blocks;
}

// The command after any leading VAR=value assignments.
std::string command_part(const std::string& line) {
  static const std::regex assignments(R"(^([A-Za-z_][A-Za-z0-9_]*=\S*\s+)*)");
  return std::regex_replace(line, assignments, "", std::regex_constants::format_first_only);
}

bool is_gemstage_line(const std::string& line) {
  const std::string c = command_part(trim(line));
  return c.rfind("build/gemstage ", 0) == 0 || c.rfind("gemstage ", 0) == 0;
}

// What the README's names stand for here. A line that passes --audio gets the audio fixture
// model (the E-series checkpoint the README names has both towers; the tiny fixtures split them).
std::string substitute(std::string line) {
  const bool audio = line.find("--audio") != std::string::npos;
  const std::vector<std::pair<std::string, std::string>> names = {
      {"build/gemstage", GEMSTAGE_CLI},
      {"gemma-4-E2B-it-assistant", kFixtures + "/gemma4-tiny-assistant/assistant_e"},
      // A Hub name (the quick start's): the same fixture models. How a name resolves through the
      // Hugging Face cache is hub_cli_test.cc's; `pull` itself runs below on a cache of its own.
      {"google/gemma-4-E2B-it",
       kFixtures + (audio ? "/gemma4-tiny-audio/model" : "/gemma4-tiny/model")},
      {"gemma-4-E2B-it", kFixtures + (audio ? "/gemma4-tiny-audio/model" : "/gemma4-tiny/model")},
      {"cat.png", kFixtures + "/gemma4-tiny/multimodal/image.png"},
      {"speech.wav", kFixtures + "/gemma4-tiny-audio/audio/audio.wav"},
      {"prompt.npy", kFixtures + "/gemma4-tiny/text/input_ids.npy"},
      {"ids.npy", kFixtures + "/readme/ids.npy"},
      {"hf-ref", kFixtures + "/gemma4-tiny/multimodal"},
      {"conversation.json", kFixtures + "/chat-template/16-tool_call_then_response.json"},
      {"reply.txt", kFixtures + "/readme/reply.txt"},
  };
  auto word_char = [](char ch) {
    return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_' || ch == '-' || ch == '.';
  };
  for (const auto& [name, value] : names) {
    std::string out;
    size_t i = 0;
    while (i < line.size()) {
      const size_t at = line.find(name, i);
      if (at == std::string::npos) break;
      const size_t end = at + name.size();
      const bool starts = at == 0 || (!word_char(line[at - 1]) && line[at - 1] != '/');
      const bool ends = end == line.size() || !word_char(line[end]);
      out += line.substr(i, at - i) + (starts && ends ? value : name);
      i = end;
    }
    line = out + line.substr(i);
  }
  return line;
}

struct LineResult {
  int code;
  std::string log;
};

// Runs one command line with bash in `work`, stdin from `input`.
LineResult run_line(const std::string& work, const std::string& line, int n,
                    const std::string& input) {
  const std::string script = work + "/line_" + std::to_string(n) + ".sh";
  const std::string log = work + "/line_" + std::to_string(n) + ".log";
  std::ofstream(script) << "set -o pipefail\n" << line << "\n";
  const std::string cmd =
      "cd '" + work + "' && timeout 600 bash '" + script + "' < " + input + " > '" + log + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, slurp(log)};
}

// A server started by a README line, stopped at the end of its block.
struct Server {
  pid_t pid = -1;
  std::string log, address;  // address: "127.0.0.1:PORT" once ready
  int line = 0;
};

Server start_server(const std::string& work, std::string line, int n) {
  // A free port instead of the README's, so parallel test runs never collide.
  static const std::regex port(R"(--port\s+\d+)");
  line = std::regex_search(line, port) ? std::regex_replace(line, port, "--port 0")
                                       : line + " --port 0";
  Server s;
  s.line = n;
  const std::string script = work + "/line_" + std::to_string(n) + ".sh";
  s.log = work + "/line_" + std::to_string(n) + ".log";
  std::ofstream(script) << "exec " << line << "\n";
  s.pid = fork();
  if (s.pid == 0) {
    if (chdir(work.c_str()) != 0) _exit(126);
    const int fd = open(s.log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int in = open("/dev/null", O_RDONLY);
    if (fd < 0 || in < 0) _exit(126);
    dup2(in, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    execl("/bin/bash", "bash", script.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  static const std::regex listening(R"(http://(127\.0\.0\.1:\d+))");
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(5);
  while (std::chrono::steady_clock::now() < deadline) {
    const std::string text = slurp(s.log);
    std::smatch m;
    if (text.find("ready") != std::string::npos && std::regex_search(text, m, listening)) {
      s.address = m[1];
      return s;
    }
    int status = 0;
    if (waitpid(s.pid, &status, WNOHANG) == s.pid) {
      s.pid = -1;
      ADD_FAILURE() << "README line " << n << ": serve exited before it was ready:\n" << tail(text);
      return s;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ADD_FAILURE() << "README line " << n << ": serve was not ready within 5 minutes:\n"
                << tail(slurp(s.log));
  return s;
}

void stop_server(Server& s) {
  if (s.pid <= 0) return;
  kill(s.pid, SIGTERM);
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(2);
  while (waitpid(s.pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      kill(s.pid, SIGKILL);
      waitpid(s.pid, &status, 0);
      ADD_FAILURE() << "README line " << s.line << ": serve did not stop on SIGTERM";
      s.pid = -1;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
      << "README line " << s.line << ": serve did not exit 0 on SIGTERM:\n"
      << tail(slurp(s.log));
  s.pid = -1;
}

// Lines of an `sh` block this test does not run, and why; anything else unknown fails.
bool not_run_here(const std::string& c) {
  // CI runs both scripts themselves (.ci/run).
  return c == "./scripts/setup.sh" || c == "./scripts/test.sh" ||
         c.rfind("./scripts/setup.sh ", 0) == 0 || c.rfind("./scripts/test.sh ", 0) == 0;
}

std::string help_of(const std::string& sub) {
  const std::string dir = temp_dir("readme_help");
  const std::string out = dir + "/" + (sub.empty() ? std::string("main") : sub) + ".txt";
  const std::string cmd =
      std::string(GEMSTAGE_CLI) + (sub.empty() ? "" : " " + sub) + " --help > '" + out + "' 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0) << "gemstage " << sub << " --help failed";
  return slurp(out);
}

}  // namespace

TEST(ReadmeCommands, EveryCommandLineRunsOnTheTinyModels) {
  const std::vector<Block> blocks = read_blocks(readme_path());
  ASSERT_FALSE(blocks.empty()) << readme_path() << " has no code blocks";
  const std::string work = temp_dir("readme_commands");
  const std::string hf_cache = work + "/hf-cache";
  gemstage::testing::write_hf_cache_snapshot(hf_cache, "google/gemma-4-E2B-it",
                                             kFixtures + "/gemma4-tiny/model",
                                             "0123456789abcdef0123456789abcdef01234567");
  const std::string chat_input = work + "/chat_input.txt";
  std::ofstream(chat_input) << "Hello\n/exit\n";
  int ran = 0, n = 0;
  for (const Block& b : blocks) {
    const bool shell = b.lang == "sh" || b.lang == "bash";
    Server server;
    for (const Line& l : b.lines) {
      ++n;
      const std::string t = trim(l.text);
      if (!shell) {
        EXPECT_FALSE(is_gemstage_line(t))
            << "README line " << l.number << ": a gemstage command in a '" << b.lang
            << "' block; put command lines in sh blocks so this test runs them: " << t;
        continue;
      }
      if (t.empty() || t[0] == '#') continue;
      const std::string c = command_part(t);
      SCOPED_TRACE("README line " + std::to_string(l.number) + ": " + t);
      if (c.rfind("build/gemstage ", 0) == 0) {
        std::istringstream words(c);
        std::string word, sub;
        words >> word >> sub;
        // `pull NAME` finds NAME in a Hugging Face cache holding the tiny model under that name,
        // offline (the real download is hub_cli_test.cc's, against a fake Hub).
        const std::string line = sub == "pull" ? "HF_HUB_CACHE='" + hf_cache +
                                                     "' HF_HUB_OFFLINE=1 " + GEMSTAGE_CLI +
                                                     c.substr(std::string("build/gemstage").size())
                                               : substitute(t);
        if (sub == "serve") {
          stop_server(server);
          server = start_server(work, line, n);
        } else {
          const auto t0 = std::chrono::steady_clock::now();
          const LineResult r = run_line(work, line, n, sub == "chat" ? chat_input : "/dev/null");
          const double seconds =
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
          std::cout << "README line " << l.number << " (" << seconds << " s): " << t << "\n";
          EXPECT_EQ(r.code, 0) << "ran: " << line << "\n" << tail(r.log);
        }
        ++ran;
      } else if (c.rfind("curl ", 0) == 0) {
        ASSERT_FALSE(server.address.empty())
            << "README line " << l.number << ": curl without a serve line before it in the block";
        static const std::regex address(R"(127\.0\.0\.1:\d+)");
        const std::string line =
            "curl -sS -f " + std::regex_replace(c.substr(5), address, server.address);
        const LineResult r = run_line(work, line, n, "/dev/null");
        EXPECT_EQ(r.code, 0) << "ran: " << line << "\n" << tail(r.log);
        EXPECT_EQ(r.log.find("\"error\""), std::string::npos) << r.log;
        ++ran;
      } else {
        EXPECT_TRUE(not_run_here(c))
            << "README line " << l.number
            << ": not a command this test can run; keep sh blocks to gemstage command lines (or "
               "teach tests/readme_commands_test.cc to run it): "
            << t;
      }
    }
    stop_server(server);
  }
  EXPECT_GE(ran, 10) << "the README's sh blocks held fewer commands than expected";
}

TEST(ReadmeCommands, ReferenceTableListsEverySubcommandAndOnlyRealFlags) {
  std::ifstream f(readme_path());
  std::string raw;
  bool in_reference = false;
  std::map<std::string, std::vector<std::string>> flags;  // subcommand -> flags its row names
  static const std::regex cmd_re("`([a-z][a-z-]*)`");
  static const std::regex flag_re(R"((^|[\s`/(])(--?[A-Za-z][A-Za-z0-9-]*))");
  while (std::getline(f, raw)) {
    if (raw.rfind("## ", 0) == 0) in_reference = raw == "## Command reference";
    if (!in_reference || raw.rfind("| `", 0) != 0) continue;
    // | `cmd`, `cmd2` | what | flags |
    std::vector<std::string> cells;
    std::stringstream row(raw.substr(1));
    std::string cell;
    while (std::getline(row, cell, '|')) cells.push_back(cell);
    ASSERT_GE(cells.size(), 3u) << raw;
    std::vector<std::string> names;
    for (std::sregex_iterator it(cells[0].begin(), cells[0].end(), cmd_re), end; it != end; ++it)
      names.push_back((*it)[1]);
    std::vector<std::string> row_flags;
    for (std::sregex_iterator it(cells[2].begin(), cells[2].end(), flag_re), end; it != end; ++it)
      row_flags.push_back((*it)[2]);
    for (const std::string& name : names) flags[name] = row_flags;
  }
  ASSERT_FALSE(flags.empty()) << "no '## Command reference' table in " << readme_path();

  // Every subcommand the CLI has is in the table.
  const std::string main_help = help_of("");
  size_t at = main_help.find("SUBCOMMANDS:");
  if (at == std::string::npos) at = main_help.find("Subcommands:");
  ASSERT_NE(at, std::string::npos) << main_help;
  std::stringstream subs(main_help.substr(at));
  std::string line;
  std::getline(subs, line);
  int listed = 0;
  while (std::getline(subs, line)) {
    std::stringstream words(line);
    std::string name;
    if (!(words >> name) || line.find_first_not_of(' ') != 2) continue;
    ++listed;
    EXPECT_TRUE(flags.count(name))
        << "`gemstage " << name << "` is missing from the README's command reference";
  }
  EXPECT_GT(listed, 5) << main_help;

  // Every flag the table names exists.
  for (const auto& [name, row_flags] : flags) {
    const std::string help = help_of(name);
    for (const std::string& flag : row_flags) {
      bool found = false;
      for (size_t pos = help.find(flag); pos != std::string::npos; pos = help.find(flag, pos + 1)) {
        const size_t end = pos + flag.size();
        const bool before = pos == 0 || (!std::isalnum(static_cast<unsigned char>(help[pos - 1])) &&
                                         help[pos - 1] != '-');
        const bool after =
            end == help.size() ||
            (!std::isalnum(static_cast<unsigned char>(help[end])) && help[end] != '-');
        if (before && after) {
          found = true;
          break;
        }
      }
      EXPECT_TRUE(found) << "the README's command reference gives `" << name << "` the flag "
                         << flag << ", which `gemstage " << name << " --help` does not list";
    }
  }
}

// The README and docs/ link only to files inside the repository, and every such link resolves.
TEST(ReadmeCommands, EveryDocumentationLinkResolvesInsideTheRepository) {
  const fs::path root = fs::weakly_canonical(fs::path(kFixtures) / ".." / "..");
  std::vector<fs::path> pages = {root / "README.md", root / "bench" / "RESULTS.md"};
  for (const auto& e : fs::directory_iterator(root / "docs"))
    if (e.path().extension() == ".md") pages.push_back(e.path());
  static const std::regex link(R"(\]\(([^)\s]+)\))");
  int checked = 0;
  for (const fs::path& page : pages) {
    const std::string text = slurp(page.string());
    ASSERT_FALSE(text.empty()) << page;
    for (std::sregex_iterator it(text.begin(), text.end(), link), end; it != end; ++it) {
      const std::string target = (*it)[1];
      if (target.rfind("http://", 0) == 0 || target.rfind("https://", 0) == 0 || target[0] == '#')
        continue;
      const fs::path file =
          fs::weakly_canonical(page.parent_path() / target.substr(0, target.find('#')));
      const std::string rel = fs::relative(file, root).string();
      EXPECT_FALSE(rel.rfind("..", 0) == 0 || fs::path(target).is_absolute())
          << page.filename() << " links outside the repository: " << target;
      EXPECT_TRUE(fs::exists(file)) << page.filename() << " links to a missing file: " << target;
      ++checked;
    }
  }
  EXPECT_GT(checked, 20);
}
