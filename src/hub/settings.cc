#include "hub/settings.h"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <vector>

namespace gemstage::hub {

namespace {

std::string home_dir(const EnvLookup& env) {
  if (const char* h = env("HOME"); h && *h) return h;
  // getpwuid_r, not getpwuid: the latter hands back a pointer into static storage.
  std::vector<char> buf(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwuid_r(getuid(), &pw, buf.data(), buf.size(), &found) == 0 && found && found->pw_dir)
    return found->pw_dir;
  return ".";
}

// "~/x" and "~" as the shell would expand them (the tools expand both HF_HOME and HF_HUB_CACHE).
std::filesystem::path expand_user(const std::string& p, const EnvLookup& env) {
  if (p == "~") return home_dir(env);
  if (p.rfind("~/", 0) == 0) return std::filesystem::path(home_dir(env)) / p.substr(2);
  return p;
}

std::string first_set(const EnvLookup& env, std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const char* v = env(n); v && *v) return v;
  return "";
}

// The token file's text with line breaks and surrounding blanks removed (huggingface_hub's
// _clean_token); empty when the file is missing or blank.
std::string clean_token(std::string t) {
  t.erase(std::remove(t.begin(), t.end(), '\r'), t.end());
  t.erase(std::remove(t.begin(), t.end(), '\n'), t.end());
  const auto not_space = [](unsigned char c) { return !std::isspace(c); };
  t.erase(t.begin(), std::find_if(t.begin(), t.end(), not_space));
  t.erase(std::find_if(t.rbegin(), t.rend(), not_space).base(), t.end());
  return t;
}

}  // namespace

bool env_flag_true(const char* value) {
  if (value == nullptr) return false;
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return v == "1" || v == "ON" || v == "YES" || v == "TRUE";
}

HubSettings settings_from_environment(const EnvLookup& lookup) {
  const EnvLookup env = lookup ? lookup : EnvLookup([](const char* n) { return std::getenv(n); });
  HubSettings s;
  if (std::string e = first_set(env, {"HF_ENDPOINT"}); !e.empty()) {
    while (!e.empty() && e.back() == '/') e.pop_back();
    s.endpoint = e;
  }
  std::filesystem::path hf_home;
  if (std::string h = first_set(env, {"HF_HOME"}); !h.empty()) {
    hf_home = expand_user(h, env);
  } else if (std::string x = first_set(env, {"XDG_CACHE_HOME"}); !x.empty()) {
    hf_home = expand_user(x, env) / "huggingface";
  } else {
    hf_home = std::filesystem::path(home_dir(env)) / ".cache" / "huggingface";
  }
  if (std::string c = first_set(env, {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"}); !c.empty())
    s.cache_dir = expand_user(c, env);
  else
    s.cache_dir = hf_home / "hub";

  if (std::string t = clean_token(first_set(env, {"HF_TOKEN"})); !t.empty()) {
    s.token = t;
    s.token_source = "HF_TOKEN";
  } else if (t = clean_token(first_set(env, {"HUGGING_FACE_HUB_TOKEN"})); !t.empty()) {
    s.token = t;
    s.token_source = "HUGGING_FACE_HUB_TOKEN";
  } else {
    std::string path = first_set(env, {"HF_TOKEN_PATH"});
    const std::filesystem::path file = path.empty() ? hf_home / "token" : expand_user(path, env);
    std::ifstream in(file);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      s.token = clean_token(ss.str());
      if (!s.token.empty()) s.token_source = file.string();
    }
  }

  s.offline = env_flag_true(env("HF_HUB_OFFLINE")) || env_flag_true(env("TRANSFORMERS_OFFLINE"));
  s.progress = !env_flag_true(env("HF_HUB_DISABLE_PROGRESS_BARS"));
  s.https_proxy = first_set(env, {"HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"});
  s.http_proxy = first_set(env, {"HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"});
  s.no_proxy = first_set(env, {"NO_PROXY", "no_proxy"});
  return s;
}

}  // namespace gemstage::hub
