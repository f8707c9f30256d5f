#include "hub/cache.h"

#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "io/file_writer.h"

namespace gemstage::hub {

namespace fs = std::filesystem;

namespace {

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : path) {
    if (c == '/') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A name for a temporary next to its target that no other process or thread picks.
std::string unique_suffix() {
  std::string s = ".";
  s += std::to_string(::getpid());
  s += '.';
  s += std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
  s += ".tmp";
  return s;
}

// Sizes of the regular files under dir (links not followed: each blob counted once).
uint64_t regular_bytes(const fs::path& dir) {
  uint64_t n = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it);
       it.increment(ec))
    if (it->is_regular_file(ec) && !it->is_symlink(ec)) n += it->file_size(ec);
  return n;
}

}  // namespace

std::string repo_folder_name(const ModelRef& ref) {
  return "models--" + ref.org + "--" + ref.name;
}

fs::path HubCache::repo_dir(const ModelRef& ref) const {
  return root_ / repo_folder_name(ref);
}
fs::path HubCache::blob_path(const ModelRef& ref, const std::string& etag) const {
  return repo_dir(ref) / "blobs" / etag;
}
fs::path HubCache::incomplete_path(const ModelRef& ref, const std::string& etag) const {
  return repo_dir(ref) / "blobs" / (etag + ".incomplete");
}
fs::path HubCache::locks_dir(const ModelRef& ref) const {
  return root_ / ".locks" / repo_folder_name(ref);
}
fs::path HubCache::lock_path(const ModelRef& ref, const std::string& etag) const {
  return locks_dir(ref) / (etag + ".lock");
}
fs::path HubCache::snapshot_dir(const ModelRef& ref, const std::string& commit) const {
  return repo_dir(ref) / "snapshots" / commit;
}
fs::path HubCache::ref_path(const ModelRef& ref, const std::string& revision) const {
  // A branch such as refs/pr/1 is a nested file, as the tools write it.
  return repo_dir(ref) / "refs" / revision;
}

std::optional<std::string> HubCache::read_ref(const ModelRef& ref,
                                              const std::string& revision) const {
  const fs::path p = ref_path(ref, revision);
  std::error_code ec;
  if (!fs::is_regular_file(p, ec)) return std::nullopt;
  std::string commit = read_text(p);
  // The tools write the bare hash; tolerate a line break a person may have added.
  while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r')) commit.pop_back();
  if (!is_commit_hash(commit))
    fail("the cache file ", p.string(), " should hold a 40-hex commit, it holds '",
         commit.substr(0, 64), "'");
  return commit;
}

void HubCache::write_ref(const ModelRef& ref, const std::string& revision,
                         const std::string& commit) const {
  const fs::path p = ref_path(ref, revision);
  try {
    if (read_ref(ref, revision) == commit) return;  // unchanged: the cache may be read-only
  } catch (const Error&) {
    // a damaged ref file is simply replaced
  }
  fs::create_directories(p.parent_path());
  const std::string tmp = p.string() + unique_suffix();
  write_file_synced(tmp, commit);  // no line break, like the tools
  rename_into_place(tmp, p.string());
}

bool HubCache::has_file(const ModelRef& ref, const std::string& commit,
                        const std::string& path) const {
  std::error_code ec;
  return fs::is_regular_file(snapshot_dir(ref, commit) / path, ec);
}

void HubCache::link_file(const ModelRef& ref, const std::string& commit, const std::string& path,
                         const std::string& etag) const {
  if (!safe_repo_path(path)) fail("refusing the repository path '", path, "'");
  const fs::path dst = snapshot_dir(ref, commit) / path;
  fs::create_directories(dst.parent_path());
  // From snapshots/<commit>/<a/b/file> up to the repository folder: one ".." for each component
  // of the path and one for the commit folder (huggingface_hub computes the same with relpath).
  std::string target;
  for (size_t i = 0, n = split_path(path).size() + 1; i < n; ++i) target += "../";
  target += "blobs/" + etag;
  std::error_code ec;
  if (fs::is_symlink(dst, ec) && fs::read_symlink(dst, ec).string() == target) return;
  const fs::path tmp = dst.string() + unique_suffix();
  fs::remove(tmp, ec);
  fs::create_symlink(target, tmp);
  fs::rename(tmp, dst);  // replaces a stale entry in one step
}

bool safe_repo_path(const std::string& path) {
  if (path.empty() || path.size() > 4096 || path.front() == '/') return false;
  for (const std::string& part : split_path(path))
    if (part.empty() || part == "." || part == ".." || part.find('\0') != std::string::npos)
      return false;
  return true;
}

std::vector<std::string> missing_for_load(const fs::path& snapshot) {
  std::vector<std::string> missing;
  std::error_code ec;
  const auto present = [&](const std::string& name) {
    return fs::is_regular_file(snapshot / name, ec);
  };
  if (!present("config.json")) missing.push_back("config.json");
  if (present("model.safetensors.index.json")) {
    std::set<std::string> shards;
    try {
      const auto index =
          nlohmann::json::parse(read_text(snapshot / "model.safetensors.index.json"));
      for (const auto& [tensor, file] : index.at("weight_map").items())
        shards.insert(file.get<std::string>());
    } catch (const std::exception& e) {
      missing.push_back("model.safetensors.index.json (unreadable: " + std::string(e.what()) + ")");
    }
    for (const std::string& s : shards)
      if (!safe_repo_path(s) || !present(s)) missing.push_back(s);
  } else {
    bool any = false;
    for (auto it = fs::directory_iterator(snapshot, ec); !ec && it != fs::end(it); it.increment(ec))
      if (it->path().extension() == ".safetensors" && fs::is_regular_file(it->path(), ec))
        any = true;
    if (!any) missing.push_back("model.safetensors");
  }
  return missing;
}

std::string gemstage_role(const std::string& model_type) {
  if (model_type == "gemma4" || model_type == "gemma4_text" || model_type == "gemma4_unified")
    return "model";
  if (model_type == "gemma4_assistant") return "drafter";
  return "";
}

std::vector<CachedSnapshot> list_cached_models(const fs::path& root) {
  std::vector<CachedSnapshot> out;
  std::error_code ec;
  std::vector<fs::path> repos;
  for (auto it = fs::directory_iterator(root, ec); !ec && it != fs::end(it); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind("models--", 0) == 0 && it->is_directory(ec)) repos.push_back(it->path());
  }
  std::sort(repos.begin(), repos.end());
  for (const fs::path& repo : repos) {
    // models--ORG--NAME: neither part may hold "--", so the split is unambiguous.
    const std::string folder = repo.filename().string().substr(8);
    const size_t sep = folder.find("--");
    if (sep == std::string::npos) continue;
    const std::string repo_id = folder.substr(0, sep) + "/" + folder.substr(sep + 2);

    std::map<std::string, std::vector<std::string>> refs_of;  // commit -> names
    const fs::path refs = repo / "refs";
    for (auto it = fs::recursive_directory_iterator(refs, ec); !ec && it != fs::end(it);
         it.increment(ec)) {
      if (!it->is_regular_file(ec)) continue;
      std::string commit = read_text(it->path());
      while (!commit.empty() && (commit.back() == '\n' || commit.back() == '\r')) commit.pop_back();
      refs_of[commit].push_back(fs::relative(it->path(), refs, ec).generic_string());
    }
    uint64_t partial = 0;
    for (auto it = fs::directory_iterator(repo / "blobs", ec); !ec && it != fs::end(it);
         it.increment(ec))
      if (it->path().extension() == ".incomplete") partial += it->file_size(ec);

    std::vector<fs::path> snaps;
    for (auto it = fs::directory_iterator(repo / "snapshots", ec); !ec && it != fs::end(it);
         it.increment(ec))
      if (it->is_directory(ec)) snaps.push_back(it->path());
    std::sort(snaps.begin(), snaps.end());
    if (snaps.empty()) ec.clear();
    for (const fs::path& snap : snaps) {
      CachedSnapshot s;
      s.repo_id = repo_id;
      s.commit = snap.filename().string();
      s.dir = snap;
      s.refs = refs_of[s.commit];
      std::sort(s.refs.begin(), s.refs.end());
      s.partial_bytes = partial;
      for (auto it = fs::recursive_directory_iterator(snap, ec); !ec && it != fs::end(it);
           it.increment(ec))
        if (fs::is_regular_file(it->path(), ec)) s.bytes += fs::file_size(it->path(), ec);
      ec.clear();
      try {
        const auto cfg = nlohmann::json::parse(read_text(snap / "config.json"));
        if (cfg.is_object() && cfg.contains("model_type") && cfg["model_type"].is_string())
          s.model_type = cfg["model_type"].get<std::string>();
      } catch (const std::exception&) {
        // missing or unreadable: model_type stays empty and `missing` says why
      }
      s.missing = missing_for_load(snap);
      out.push_back(std::move(s));
    }
    if (snaps.empty() && partial > 0) {
      CachedSnapshot s;
      s.repo_id = repo_id;
      s.partial_bytes = partial;
      s.missing = {"config.json"};
      out.push_back(std::move(s));
    }
  }
  return out;
}

RemoveReport remove_cached_model(const HubCache& cache, const ModelRef& ref) {
  RemoveReport report;
  const fs::path repo = cache.repo_dir(ref);
  std::error_code ec;
  if (!fs::is_directory(repo, ec))
    fail(ref.repo_id(), " is not in the cache ", cache.root().string(),
         " (`gemstage ls` lists what is)");
  const auto remove_repo = [&] {
    report.bytes_freed += regular_bytes(repo);
    fs::remove_all(repo);
    fs::remove_all(cache.locks_dir(ref), ec);
    report.removed.push_back(ref.repo_id());
  };
  if (ref.revision.empty()) {
    remove_repo();
    return report;
  }
  std::string commit = ref.revision;
  if (!is_commit_hash(commit)) {
    const auto c = cache.read_ref(ref, ref.revision);
    if (!c)
      fail("the cache holds no revision '", ref.revision, "' of ", ref.repo_id(),
           " (`gemstage ls` lists what it holds)");
    commit = *c;
  }
  const fs::path snap = cache.snapshot_dir(ref, commit);
  if (!fs::is_directory(snap, ec))
    fail("the cache holds no snapshot ", commit, " of ", ref.repo_id(),
         " (`gemstage ls` lists what it holds)");
  fs::remove_all(snap);
  report.removed.push_back(ref.repo_id() + "@" + commit);
  // refs that named it
  const fs::path refs = repo / "refs";
  std::vector<fs::path> stale;
  for (auto it = fs::recursive_directory_iterator(refs, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (!it->is_regular_file(ec)) continue;
    std::string c = read_text(it->path());
    while (!c.empty() && (c.back() == '\n' || c.back() == '\r')) c.pop_back();
    if (c == commit) stale.push_back(it->path());
  }
  ec.clear();
  for (const fs::path& p : stale) fs::remove(p, ec);

  // Blobs the remaining snapshots still reach stay.
  std::set<std::string> used;
  bool any_left = false;
  for (auto it = fs::directory_iterator(repo / "snapshots", ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    any_left = true;
    for (auto f = fs::recursive_directory_iterator(it->path(), ec); !ec && f != fs::end(f);
         f.increment(ec))
      if (f->is_symlink(ec)) used.insert(fs::read_symlink(f->path(), ec).filename().string());
  }
  ec.clear();
  if (!any_left) {  // the last snapshot: nothing else needs the blobs, refs or locks
    report.bytes_freed += regular_bytes(repo);
    fs::remove_all(repo);
    fs::remove_all(cache.locks_dir(ref), ec);
    return report;
  }
  for (auto it = fs::directory_iterator(repo / "blobs", ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (it->path().extension() == ".incomplete" || used.count(name)) continue;
    report.bytes_freed += it->file_size(ec);
    fs::remove(it->path(), ec);
  }
  return report;
}

}  // namespace gemstage::hub
