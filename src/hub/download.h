// A model name to a checkpoint directory: from the Hugging Face cache when it holds the snapshot,
// else from the Hub, fetching only what gemstage reads, resumable, each file verified against the
// Hub's hash before it is linked into the snapshot (docs/models-by-name.md).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include "core/error.h"
#include "hub/model_ref.h"
#include "hub/settings.h"

namespace gemstage::hub {

// A failure the caller may want to tell apart (the CLI falls back to the cache on some).
class HubError : public Error {
 public:
  enum class Kind {
    Gated,             // 401/403 GatedRepo: licence not accepted, or no / wrong token
    RepoNotFound,      // 404 (or 401 without a token): no such repository, or a private one
    RevisionNotFound,  // 404 RevisionNotFound
    EntryNotFound,     // 404 EntryNotFound
    Denied,            // other 401/403
    Server,            // 5xx, 429 and other answers that say "not now"
    Network,           // no answer: connection, TLS, proxy, cut transfers
    Integrity,         // size or checksum mismatch
    Disk,              // writing the cache failed (full disk, permissions)
    NotCached,         // offline, and the cache lacks what was asked
    Refused,           // an answer gemstage will not use (bad names, a repo without safetensors)
  };
  HubError(Kind kind, const std::string& what) : Error(what), kind_(kind) {}
  Kind kind() const { return kind_; }

 private:
  Kind kind_;
};

// Whether gemstage fetches a repository file: top-level configs (*.json: config, generation,
// tokenizer, processor and chat-template files, the safetensors index), chat templates
// (*.jinja), tokenizer.model and *.safetensors weights. Never *.bin, *.gguf, ONNX, other weight
// formats, or anything in a subfolder (where repositories keep those).
bool wanted_file(const std::string& repo_path);

struct ResolvedModel {
  std::filesystem::path dir;  // <cache>/models--ORG--NAME/snapshots/<commit>
  std::string repo_id, revision, commit;
  bool used_network = false;  // asked the Hub (false: the cache alone answered)
  int files_downloaded = 0;
  uint64_t bytes_downloaded = 0;
};

// Messages for the person running the command (waits, resumptions, fallbacks); stderr when null.
using Notify = std::function<void(const std::string&)>;

// The snapshot the cache holds for ref, without the network; HubError(NotCached) says what is
// missing and what to run.
ResolvedModel resolve_cached(const ModelRef& ref, const HubSettings& settings);

// The snapshot of ref: from the cache alone under settings.offline, else after asking the Hub for
// the revision's commit and downloading whatever the snapshot lacks. When the Hub cannot be asked
// (no network, an outage, a refused token) a complete cached snapshot of the revision is used
// with a note, as the Python tools do; a missing revision is always an error.
ResolvedModel resolve_model(const ModelRef& ref, const HubSettings& settings,
                            const Notify& notify = nullptr);

}  // namespace gemstage::hub
