// The Hugging Face cache folder, in the layout huggingface_hub writes and reads (docs/hf-hub.md
// "Cache layout"), so a model transformers downloaded runs here as is and what gemstage downloads
// transformers reads:
//
//   <cache>/models--ORG--NAME/blobs/<etag>                 content, named by its ETag
//   <cache>/models--ORG--NAME/blobs/<etag>.incomplete      a download in progress (resumable)
//   <cache>/models--ORG--NAME/refs/<revision>              the commit a branch or tag named
//   <cache>/models--ORG--NAME/snapshots/<commit>/<path>    relative symlink to ../../blobs/<etag>
//   <cache>/.locks/models--ORG--NAME/<etag>.lock           one writer per blob
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "hub/model_ref.h"

namespace gemstage::hub {

// "models--ORG--NAME": the folder of one model repository.
std::string repo_folder_name(const ModelRef& ref);

class HubCache {
 public:
  explicit HubCache(std::filesystem::path root) : root_(std::move(root)) {}
  const std::filesystem::path& root() const { return root_; }

  std::filesystem::path repo_dir(const ModelRef& ref) const;
  std::filesystem::path blob_path(const ModelRef& ref, const std::string& etag) const;
  std::filesystem::path incomplete_path(const ModelRef& ref, const std::string& etag) const;
  std::filesystem::path lock_path(const ModelRef& ref, const std::string& etag) const;
  std::filesystem::path locks_dir(const ModelRef& ref) const;
  std::filesystem::path snapshot_dir(const ModelRef& ref, const std::string& commit) const;
  std::filesystem::path ref_path(const ModelRef& ref, const std::string& revision) const;

  // The commit refs/<revision> holds (the file's text, no line break), or nullopt.
  std::optional<std::string> read_ref(const ModelRef& ref, const std::string& revision) const;
  // Writes refs/<revision> atomically (a reader never sees it half written).
  void write_ref(const ModelRef& ref, const std::string& revision, const std::string& commit) const;

  // Whether snapshots/<commit>/<path> is there and reaches its content (a dangling link is not).
  bool has_file(const ModelRef& ref, const std::string& commit, const std::string& path) const;
  // Points snapshots/<commit>/<path> at blobs/<etag> with a relative link, as the tools do.
  void link_file(const ModelRef& ref, const std::string& commit, const std::string& path,
                 const std::string& etag) const;

 private:
  std::filesystem::path root_;
};

// A repository file path the cache can hold: relative, '/'-separated, no empty, "." or ".."
// component (so a snapshot entry never lands outside its snapshot folder).
bool safe_repo_path(const std::string& path);

// What a snapshot folder lacks before gemstage can load it as a checkpoint: config.json, and the
// weights (every shard model.safetensors.index.json names, else a *.safetensors file). Empty when
// nothing is missing. A download in progress or cut short always lacks something here, because
// config.json is linked last.
std::vector<std::string> missing_for_load(const std::filesystem::path& snapshot);

// One snapshot in the cache, for `gemstage ls`.
struct CachedSnapshot {
  std::string repo_id;               // ORG/NAME
  std::string commit;                // empty for a repository with downloads but no snapshot yet
  std::filesystem::path dir;         // the snapshot folder (empty with commit)
  std::vector<std::string> refs;     // the branches and tags that point at it
  uint64_t bytes = 0;                // its files' sizes (shared blobs counted in each snapshot)
  uint64_t partial_bytes = 0;        // the repository's .incomplete downloads
  std::string model_type;            // config.json's model_type, empty when unreadable
  std::vector<std::string> missing;  // missing_for_load
};
std::vector<CachedSnapshot> list_cached_models(const std::filesystem::path& cache_root);

// Whether gemstage runs a checkpoint of this config.json model_type, and as what.
// "model", "drafter" (a gemma4_assistant, for -md) or "" when it does not.
std::string gemstage_role(const std::string& model_type);

struct RemoveReport {
  uint64_t bytes_freed = 0;
  std::vector<std::string> removed;  // the snapshots (ORG/NAME@commit) or "ORG/NAME" entirely
};
// ORG/NAME: the whole repository folder and its locks. ORG/NAME@REV: that snapshot, the refs that
// name it and the blobs no other snapshot uses (the whole folder when it was the last one).
RemoveReport remove_cached_model(const HubCache& cache, const ModelRef& ref);

}  // namespace gemstage::hub
