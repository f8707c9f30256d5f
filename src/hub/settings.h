// Where the cache lives, which Hub to ask, with which token, through which proxy: read once from
// the environment variables the Hugging Face tools read (docs/hf-hub.md "Environment") and passed
// down explicitly, so tests build their own without touching the process environment.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

namespace gemstage::hub {

struct HubSettings {
  std::string endpoint = "https://huggingface.co";  // HF_ENDPOINT, no trailing '/'
  std::filesystem::path cache_dir;                  // HF_HUB_CACHE and its fallbacks
  std::string token;                                // empty: requests go without one
  std::string token_source;  // where the token came from ("HF_TOKEN", a file), for messages
  bool offline = false;      // HF_HUB_OFFLINE: never touch the network
  bool progress = true;      // false under HF_HUB_DISABLE_PROGRESS_BARS
  // Proxies by the scheme of the URL asked for, and the hosts that bypass them.
  std::string http_proxy, https_proxy, no_proxy;
  int jobs = 8;         // files downloaded at once (huggingface_hub's snapshot_download: 8)
  int max_retries = 5;  // resumptions of a transfer cut without progress before giving up
  double retry_wait_seconds = 1.0;
  int connect_timeout_seconds = 10;
  int read_timeout_seconds = 60;
};

// getenv's shape: the value of a variable, or nullptr when it is not set.
using EnvLookup = std::function<const char*(const char*)>;

// Settings from the environment (the process's by default). Relative to the tools:
//   cache:  HF_HUB_CACHE, else HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else
//           XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub
//   token:  HF_TOKEN, else HUGGING_FACE_HUB_TOKEN, else the file HF_TOKEN_PATH, else HF_HOME/token
//   offline: HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) in 1/ON/YES/TRUE
//   proxies: HTTPS_PROXY / HTTP_PROXY / ALL_PROXY / NO_PROXY, upper or lower case
HubSettings settings_from_environment(const EnvLookup& env = nullptr);

// True for the values the Python tools read as true: 1, ON, YES, TRUE in any case.
bool env_flag_true(const char* value);

}  // namespace gemstage::hub
