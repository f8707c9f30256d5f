#include "hub/download.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <iostream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "hub/cache.h"
#include "hub/digest.h"
#include "hub/file_lock.h"
#include "hub/http.h"
#include "hub/transfer_progress.h"
#include "io/file_writer.h"

namespace gemstage::hub {

namespace fs = std::filesystem;

namespace {

using Kind = HubError::Kind;

// The revision listing is JSON with one entry per file; far below this for any real repository.
constexpr size_t kMaxListingBytes = 64u << 20;
// A sanity bound on one file's size as the Hub states it (the Hub's own limit is 50 GB).
constexpr uint64_t kMaxFileBytes = uint64_t{1} << 40;

void say(const Notify& notify, const std::string& msg) {
  if (notify)
    notify(msg);
  else
    std::cerr << (msg + "\n");  // one write, so lines from several threads do not interleave
}

std::string page_of(const HubSettings& s, const ModelRef& ref) {
  return s.endpoint + "/" + ref.repo_id();
}

std::string token_hint(const HubSettings& s) {
  return "set HF_TOKEN to a read token (" + s.endpoint +
         "/settings/tokens) or save it in $HF_HOME/token (what `hf auth login` does)";
}

// What the Hub said, as an error that says what to do (docs/hf-hub.md "Errors").
HubError answer_error(const HttpReply& r, const HubSettings& s, const ModelRef& ref,
                      const std::string& what) {
  const std::string code = r.header("x-error-code");
  std::string detail = r.header("x-error-message");
  if (detail.empty() && !r.body.empty() && r.body.size() < 2000) {
    try {
      const auto j = nlohmann::json::parse(r.body);
      if (j.is_object() && j.contains("error") && j["error"].is_string())
        detail = j["error"].get<std::string>();
    } catch (const std::exception&) {
    }
  }
  const std::string said =
      " (HTTP " + std::to_string(r.status) + (detail.empty() ? "" : ": " + detail) + ")";
  const std::string page = page_of(s, ref);
  const std::string sent = s.token.empty() ? "" : "the token from " + s.token_source;
  if (code == "GatedRepo")
    return HubError(Kind::Gated,
                    ref.repo_id() + " is gated: accept its licence at " + page +
                        " while logged in to the Hub, then " +
                        (s.token.empty() ? "set HF_TOKEN to a read token of that account (" +
                                               s.endpoint + "/settings/tokens)"
                                         : "make sure " + sent +
                                               " belongs to that account (the Hub refused it)") +
                        said);
  if (code == "RevisionNotFound")
    return HubError(Kind::RevisionNotFound,
                    ref.repo_id() + " has no revision '" + ref.revision_or_default() +
                        "' (a branch, tag or commit; " + page + " lists them)" + said);
  if (code == "EntryNotFound")
    return HubError(Kind::EntryNotFound, ref.repo_id() + " has no " + what + said);
  if (code == "RepoNotFound" || r.status == 404 || (r.status == 401 && s.token.empty()))
    return HubError(
        Kind::RepoNotFound,
        ref.repo_id() + " was not found on " + s.endpoint + " (" + page + ")" + said +
            (s.token.empty()
                 ? ": check the name; a private or gated repository answers the same "
                   "without a token, so if it is one, " +
                       token_hint(s)
                 : ": check the name; if it is private, " + sent + " may not have access to it"));
  if (r.status == 401 || r.status == 403)
    return HubError(Kind::Denied, "the Hub refused " + what + " of " + ref.repo_id() + said +
                                      (s.token.empty() ? "; " + token_hint(s)
                                                       : "; check " + sent + " (" + page + ")"));
  return HubError(Kind::Server, "the Hub answered " + r.url.str() + " with an error" + said +
                                    "; try again later");
}

HubError transport_error(const HttpReply& r, const std::string& what) {
  return HubError(Kind::Network, what + " failed: " + r.transport_error +
                                     " (check the network and HTTPS_PROXY / NO_PROXY, or set "
                                     "HF_HUB_OFFLINE=1 to use the cache alone)");
}

struct Listing {
  std::string commit;
  std::vector<std::string> files;
};

// GET {endpoint}/api/models/{repo}/revision/{rev}: the commit a revision names and its files.
Listing list_revision(const HttpClient& http, const HubSettings& s, const ModelRef& ref) {
  const std::string rev = ref.revision_or_default();
  const std::string url = s.endpoint + "/api/models/" + ref.org + "/" + ref.name + "/revision/" +
                          percent_encode(rev, false);
  const HttpReply r = http.get(url, kMaxListingBytes);
  if (r.status == 0) throw transport_error(r, "asking " + s.endpoint + " for " + ref.display());
  if (r.status != 200) throw answer_error(r, s, ref, "the file list");
  Listing out;
  try {
    const auto j = nlohmann::json::parse(r.body);
    out.commit = j.at("sha").get<std::string>();
    for (const auto& sib : j.at("siblings"))
      out.files.push_back(sib.at("rfilename").get<std::string>());
  } catch (const std::exception& e) {
    throw HubError(Kind::Refused, "the Hub's file list for " + ref.display() + " (" + url +
                                      ") is not the JSON expected: " + e.what());
  }
  if (!is_commit_hash(out.commit))
    throw HubError(Kind::Refused, "the Hub named commit '" + out.commit.substr(0, 80) + "' for " +
                                      ref.display() + ", not a 40-hex hash");
  return out;
}

struct RemoteFile {
  std::string path;
  std::string etag;  // the blob's name: sha256 for LFS files, else the git blob sha1
  uint64_t size = 0;
  std::string url;          // where the content is: the CDN's signed URL, or the resolve URL itself
  std::string resolve_url;  // the Hub's URL for it, which redirects to a freshly signed one
};

std::string normalize_etag(std::string e) {
  if (e.rfind("W/", 0) == 0) e = e.substr(2);
  e.erase(std::remove(e.begin(), e.end(), '"'), e.end());
  return e;
}

// A blob name that is safe as a file name and cannot be mistaken for a path.
bool safe_etag(const std::string& e) {
  if (e.empty() || e.size() > 128 || e[0] == '.') return false;
  return std::all_of(e.begin(), e.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

std::optional<uint64_t> parse_size(const std::string& s) {
  if (s.empty() || s.size() > 19 || !std::all_of(s.begin(), s.end(), ::isdigit))
    return std::nullopt;
  return std::stoull(s);
}

// HEAD {endpoint}/{repo}/resolve/{commit}/{path}: etag, size and where the content lives.
RemoteFile file_metadata(const HttpClient& http, const HubSettings& s, const ModelRef& ref,
                         const std::string& commit, const std::string& path) {
  const std::string url = s.endpoint + "/" + ref.org + "/" + ref.name + "/resolve/" + commit + "/" +
                          percent_encode(path, true);
  const HttpReply r = http.head(url);
  const std::string what = "file " + path + " at commit " + commit;
  if (r.status == 0) throw transport_error(r, "asking the Hub about " + path);
  if (r.status >= 400) throw answer_error(r, s, ref, what);
  if (r.status >= 300 && r.header("location").empty())
    throw HubError(Kind::Refused, "the Hub redirected " + url + " without a Location");
  RemoteFile f;
  f.path = path;
  f.resolve_url = url;
  const std::string linked = r.header("x-linked-etag");
  f.etag = normalize_etag(linked.empty() ? r.header("etag") : linked);
  if (f.etag.empty())
    throw HubError(Kind::Refused, "the Hub sent no ETag for " + path + " of " + ref.repo_id() +
                                      " (" + url + "): a proxy in between may strip it");
  if (!safe_etag(f.etag) || (!linked.empty() && etag_kind(f.etag) != EtagKind::Sha256))
    throw HubError(Kind::Refused, "the Hub's ETag for " + path + " ('" + f.etag.substr(0, 80) +
                                      "') is not a hash gemstage can name a blob by");
  const std::string commit_sent = r.header("x-repo-commit");
  if (!commit_sent.empty() && commit_sent != commit)
    throw HubError(Kind::Refused, "the Hub answered for " + path + " at commit " + commit_sent +
                                      ", asked for " + commit);
  std::string size_text = r.header("x-linked-size");
  if (size_text.empty() && r.status < 300) size_text = r.header("content-length");
  const auto size = parse_size(size_text);
  if (!size || *size > kMaxFileBytes)
    throw HubError(Kind::Refused, "the Hub sent no usable size for " + path + " ('" +
                                      size_text.substr(0, 40) + "')");
  f.size = *size;
  if (r.status >= 300) {
    const auto loc = resolve_location(r.url, r.header("location"));
    if (!loc) throw HubError(Kind::Refused, "unusable Location for " + path);
    f.url = loc->str();
  } else {
    f.url = r.url.str();
  }
  return f;
}

struct Shared {
  const HttpClient& http;
  const HubSettings& settings;
  const HubCache& cache;
  const ModelRef& ref;
  const std::string& commit;
  TransferProgress& progress;
  const Notify& notify;
  std::atomic<bool> cancel{false};
  std::atomic<uint64_t> bytes{0};
  std::atomic<int> files{0};
};

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return false;
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

HubError disk_error(int err, const fs::path& incomplete, uint64_t kept, const std::string& what) {
  std::string msg = what + " " + incomplete.string() + " failed: " + std::strerror(err);
  if (err == ENOSPC || err == EDQUOT) msg += " (the disk is full)";
  msg += "; the " + std::to_string(kept) +
         " bytes downloaded so far stay in that file and the next run resumes from there once "
         "there is room (the snapshot was not touched)";
  return HubError(Kind::Disk, msg);
}

// "bytes START-END/TOTAL" -> START.
std::optional<uint64_t> content_range_start(const std::string& v) {
  if (v.rfind("bytes ", 0) != 0) return std::nullopt;
  const size_t dash = v.find('-', 6);
  if (dash == std::string::npos) return std::nullopt;
  return parse_size(v.substr(6, dash - 6));
}

class ContentCheck {
 public:
  explicit ContentCheck(const RemoteFile& f)
      : kind_(etag_kind(f.etag)),
        digest_(kind_ == EtagKind::Sha256 ? Digest::Kind::Sha256 : Digest::Kind::Sha1),
        size_(f.size) {
    reset();
  }
  void reset() {
    digest_.reset();
    // git names a blob by the sha1 of "blob <size>\0" + content.
    if (kind_ == EtagKind::GitSha1) {
      const std::string header = "blob " + std::to_string(size_);
      digest_.update(header.data(), header.size() + 1);
    }
  }
  void update(const char* p, size_t n) { digest_.update(p, n); }
  // "" when the content matches the ETag, else what it hashes to.
  std::string mismatch(const std::string& etag) {
    if (kind_ == EtagKind::Opaque) return "";  // nothing to recompute; the size was checked
    const std::string got = digest_.hex();
    return got == etag ? "" : got;
  }
  const char* name() const { return kind_ == EtagKind::Sha256 ? "sha256" : "git blob sha1"; }

 private:
  EtagKind kind_;
  Digest digest_;
  uint64_t size_;
};

// Downloads one blob into blobs/<etag>.incomplete (resuming what is there), checks it and renames
// it to blobs/<etag>. The caller holds the blob's lock.
void download_blob(Shared& sh, RemoteFile f) {
  const fs::path blob = sh.cache.blob_path(sh.ref, f.etag);
  const fs::path incomplete = sh.cache.incomplete_path(sh.ref, f.etag);
  fs::create_directories(blob.parent_path());
  Fd out;
  out.fd = ::open(incomplete.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0666);
  if (out.fd < 0) throw disk_error(errno, incomplete, 0, "opening");
  struct stat st {};
  if (::fstat(out.fd, &st) != 0) throw disk_error(errno, incomplete, 0, "reading the size of");
  uint64_t have = static_cast<uint64_t>(st.st_size);
  ContentCheck check(f);
  if (have > f.size) {
    if (::ftruncate(out.fd, 0) != 0) throw disk_error(errno, incomplete, 0, "truncating");
    have = 0;
  }
  if (have > 0) {
    // Resuming: the bytes on disk count towards the hash too.
    Fd in;
    in.fd = ::open(incomplete.c_str(), O_RDONLY | O_CLOEXEC);
    if (in.fd < 0) throw disk_error(errno, incomplete, have, "reading");
    std::vector<char> buf(1 << 20);
    uint64_t left = have;
    while (left > 0) {
      const ssize_t n = ::read(in.fd, buf.data(), std::min<uint64_t>(buf.size(), left));
      if (n <= 0) throw disk_error(n < 0 ? errno : EIO, incomplete, have, "reading");
      check.update(buf.data(), static_cast<size_t>(n));
      left -= static_cast<uint64_t>(n);
    }
    sh.progress.resumed(have);
    say(sh.notify, "resuming " + f.path + " of " + sh.ref.repo_id() + " at " + human_bytes(have) +
                       " of " + human_bytes(f.size));
  }

  int stalls = 0;
  while (have < f.size) {
    if (sh.cancel) return;
    const uint64_t before = have;
    int write_errno = 0;
    bool overflow = false, bad_range = false;
    const HttpReply r = sh.http.get_stream(
        f.url, have,
        [&](const HttpReply& a) {
          if (a.status == 200) {
            if (have > 0) {  // the server ignored the Range: start over rather than append
              if (::ftruncate(out.fd, 0) != 0) {
                write_errno = errno;
                return false;
              }
              check.reset();
              sh.progress.rewind(have);
              have = 0;
            }
            return true;
          }
          if (a.status == 206) {
            if (content_range_start(a.header("content-range")) != have) {
              bad_range = true;
              return false;
            }
            return true;
          }
          if (a.status == 416) bad_range = true;
          return false;
        },
        [&](const char* p, size_t n) {
          if (sh.cancel) return false;
          if (have + n > f.size) {
            overflow = true;
            return false;
          }
          if (!write_all(out.fd, p, n)) {
            write_errno = errno;
            return false;
          }
          check.update(p, n);
          have += n;
          sh.bytes += n;
          sh.progress.add(n);
          return true;
        });
    if (write_errno != 0) throw disk_error(write_errno, incomplete, have, "writing");
    if (sh.cancel) return;
    if (overflow) {
      std::error_code ec;
      fs::remove(incomplete, ec);
      throw HubError(Kind::Integrity, "the server sent more than the " + std::to_string(f.size) +
                                          " bytes the Hub announced for " + f.path + " of " +
                                          sh.ref.repo_id() + "; the partial download was deleted");
    }
    if (bad_range) {
      // The server and the partial file disagree about where to go on: start the file over.
      if (::ftruncate(out.fd, 0) != 0) throw disk_error(errno, incomplete, have, "truncating");
      check.reset();
      sh.progress.rewind(have);
      have = 0;
    } else if (r.status >= 400 && r.status != 408 && r.status != 429 && r.status < 500) {
      // A signed CDN URL expires (a long download, a resume the next day): ask the Hub again,
      // which redirects to a fresh one. The Hub's own refusals are final.
      if (r.url.origin() == sh.http.endpoint().origin() || f.url == f.resolve_url)
        throw answer_error(r, sh.settings, sh.ref, "file " + f.path);
      say(sh.notify, "the CDN refused " + f.path + " (HTTP " + std::to_string(r.status) +
                         "); asking the Hub for a new link");
      f.url = f.resolve_url;
    }
    if (have >= f.size) break;
    // Cut connection, short body, 408/429/5xx: resume from what arrived; give up only after
    // max_retries tries in a row that brought nothing.
    stalls = have > before ? 0 : stalls + 1;
    const std::string why = r.status == 0 || !r.transport_error.empty()
                                ? r.transport_error
                                : "HTTP " + std::to_string(r.status);
    if (stalls > sh.settings.max_retries)
      throw HubError(
          r.status >= 500 || r.status == 429 || r.status == 408 ? Kind::Server : Kind::Network,
          "downloading " + f.path + " of " + sh.ref.repo_id() + " failed after " +
              std::to_string(stalls) + " tries without progress (" +
              (why.empty() ? "the connection closed early" : why) + "); the " +
              std::to_string(have) + " bytes received stay in " + incomplete.string() +
              " and the next run resumes from there");
    say(sh.notify, "the download of " + f.path + " stopped at " + std::to_string(have) + " of " +
                       std::to_string(f.size) + " bytes (" +
                       (why.empty() ? "the connection closed early" : why) + "); resuming");
    const double wait = sh.settings.retry_wait_seconds * std::min(stalls, 10);
    if (wait > 0) std::this_thread::sleep_for(std::chrono::duration<double>(wait));
  }
  if (::fsync(out.fd) != 0) throw disk_error(errno, incomplete, have, "syncing");
  const int fd = out.fd;
  out.fd = -1;
  if (::close(fd) != 0) throw disk_error(errno, incomplete, have, "closing");
  if (const std::string got = check.mismatch(f.etag); !got.empty()) {
    std::error_code ec;
    fs::remove(incomplete, ec);
    throw HubError(Kind::Integrity,
                   "checksum mismatch for " + f.path + " of " + sh.ref.repo_id() + "@" + sh.commit +
                       ": the Hub gives " + check.name() + " " + f.etag + ", the " +
                       std::to_string(f.size) + " bytes received hash to " + got +
                       "; the bad download was deleted, run the command again to fetch it afresh");
  }
  rename_into_place(incomplete.string(), blob.string());
  sh.files += 1;
}

// Makes blobs/<etag> hold the file, downloading it unless this or another process already did.
void ensure_blob(Shared& sh, const RemoteFile& f) {
  const fs::path blob = sh.cache.blob_path(sh.ref, f.etag);
  std::error_code ec;
  const auto complete = [&] {
    return fs::is_regular_file(blob, ec) && fs::file_size(blob, ec) == f.size;
  };
  if (complete()) return;
  FileLock lock(sh.cache.lock_path(sh.ref, f.etag), [&] {
    say(sh.notify, "waiting for another download of " + f.path + " of " + sh.ref.repo_id() +
                       " (it holds " + sh.cache.lock_path(sh.ref, f.etag).string() + ")");
  });
  if (complete()) return;
  if (fs::exists(blob, ec)) {
    say(sh.notify, "the cached " + blob.string() + " is not the size the Hub gives (" +
                       std::to_string(f.size) + " bytes); downloading it again");
    fs::remove(blob, ec);
  }
  download_blob(sh, f);
}

// Runs fn(i) for i in [0, n) on up to jobs threads; the first error stops the others (through
// cancel) and is rethrown once all have returned.
void run_parallel(size_t n, int jobs, std::atomic<bool>& cancel,
                  const std::function<void(size_t)>& fn) {
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::exception_ptr first;
  const auto worker = [&] {
    for (size_t i = next++; i < n; i = next++) {
      if (cancel) return;
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
        cancel = true;
        return;
      }
    }
  };
  const size_t threads = std::min<size_t>(n, static_cast<size_t>(std::max(1, jobs)));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < threads; ++t) pool.emplace_back(worker);
  worker();
  for (auto& t : pool) t.join();
  if (first) std::rethrow_exception(first);
}

void warn_if_short_of_space(const fs::path& dir, uint64_t need, const Notify& notify) {
  struct statvfs v {};
  if (::statvfs(dir.c_str(), &v) != 0) return;
  const uint64_t free_bytes = static_cast<uint64_t>(v.f_bavail) * v.f_frsize;
  if (free_bytes < need)
    say(notify, "warning: " + dir.string() + " has " + human_bytes(free_bytes) +
                    " free and the download needs " + human_bytes(need) +
                    "; what fits is kept and the next run resumes");
}

}  // namespace

bool wanted_file(const std::string& p) {
  if (p.empty() || p.find('/') != std::string::npos) return false;
  const size_t dot = p.rfind('.');
  if (dot == std::string::npos) return false;
  const std::string ext = p.substr(dot + 1);
  return ext == "json" || ext == "jinja" || ext == "safetensors" || p == "tokenizer.model";
}

ResolvedModel resolve_cached(const ModelRef& ref, const HubSettings& settings) {
  const HubCache cache(settings.cache_dir);
  const std::string rev = ref.revision_or_default();
  const fs::path repo = cache.repo_dir(ref);
  std::error_code ec;
  const std::string how = "run `gemstage pull " + ref.display() +
                          "` with network access (without HF_HUB_OFFLINE), or point HF_HUB_CACHE "
                          "at a cache that holds it";
  if (!fs::is_directory(repo, ec))
    throw HubError(Kind::NotCached, ref.display() + " is not in the Hugging Face cache " +
                                        settings.cache_dir.string() + ": " + how);
  std::string commit = rev;
  if (!is_commit_hash(rev)) {
    const auto c = cache.read_ref(ref, rev);
    if (!c)
      throw HubError(Kind::NotCached, "the cache " + repo.string() + " has no refs/" + rev +
                                          ": revision '" + rev + "' of " + ref.repo_id() +
                                          " was never downloaded; " + how);
    commit = *c;
  }
  const fs::path snap = cache.snapshot_dir(ref, commit);
  if (!fs::is_directory(snap, ec))
    throw HubError(Kind::NotCached, "the cache holds no snapshot " + commit + " of " +
                                        ref.repo_id() + " (" + snap.string() + "); " + how);
  const auto missing = missing_for_load(snap);
  if (!missing.empty()) {
    std::string list;
    for (const auto& m : missing) list += (list.empty() ? "" : ", ") + m;
    throw HubError(Kind::NotCached, "the cached snapshot " + snap.string() + " of " +
                                        ref.display() +
                                        " is incomplete (a download cut short?): "
                                        "it lacks " +
                                        list + "; " + how);
  }
  ResolvedModel m;
  m.dir = snap;
  m.repo_id = ref.repo_id();
  m.revision = rev;
  m.commit = commit;
  return m;
}

ResolvedModel resolve_model(const ModelRef& ref, const HubSettings& settings,
                            const Notify& notify) {
  if (settings.offline) return resolve_cached(ref, settings);
  const HubCache cache(settings.cache_dir);
  const std::string rev = ref.revision_or_default();
  std::error_code ec;
  // A commit names content that never changes: a complete snapshot of it needs no network.
  if (is_commit_hash(rev) && fs::is_directory(cache.snapshot_dir(ref, rev), ec) &&
      missing_for_load(cache.snapshot_dir(ref, rev)).empty())
    return resolve_cached(ref, settings);

  const HttpClient http(settings);
  Listing listing;
  try {
    listing = list_revision(http, settings, ref);
  } catch (const HubError& e) {
    if (e.kind() == Kind::RevisionNotFound || e.kind() == Kind::Refused) throw;
    ResolvedModel cached;
    try {
      cached = resolve_cached(ref, settings);
    } catch (const HubError&) {
      throw e;
    }
    say(notify, "note: could not ask the Hub about " + ref.display() + " (" + e.what() +
                    "); using the cached snapshot " + cached.commit);
    return cached;
  }
  const std::string& commit = listing.commit;
  std::vector<std::string> wanted;
  bool any_weights = false;
  for (const std::string& f : listing.files) {
    if (!wanted_file(f)) continue;
    if (!safe_repo_path(f))
      throw HubError(Kind::Refused, "the Hub lists the file '" + f + "' in " + ref.display() +
                                        ", which cannot be stored safely");
    wanted.push_back(f);
    any_weights |= f.size() > 12 && f.compare(f.size() - 12, 12, ".safetensors") == 0;
  }
  if (std::find(wanted.begin(), wanted.end(), "config.json") == wanted.end())
    throw HubError(Kind::Refused, ref.display() + " (commit " + commit +
                                      ") has no config.json: it is not a transformers checkpoint");
  if (!any_weights)
    throw HubError(Kind::Refused,
                   ref.display() + " (commit " + commit +
                       ") has no *.safetensors weights; gemstage reads safetensors checkpoints "
                       "(not *.gguf, *.bin or ONNX)");

  ResolvedModel m;
  m.dir = cache.snapshot_dir(ref, commit);
  m.repo_id = ref.repo_id();
  m.revision = rev;
  m.commit = commit;
  m.used_network = true;

  std::vector<std::string> missing;
  for (const std::string& f : wanted)
    if (!cache.has_file(ref, commit, f)) missing.push_back(f);
  if (!missing.empty()) {
    std::atomic<bool> cancel{false};
    std::vector<RemoteFile> files(missing.size());
    run_parallel(missing.size(), settings.jobs, cancel, [&](size_t i) {
      files[i] = file_metadata(http, settings, ref, commit, missing[i]);
    });
    // The largest first, so the long transfers start at once and the small ones fill in.
    std::stable_sort(files.begin(), files.end(),
                     [](const RemoteFile& a, const RemoteFile& b) { return a.size > b.size; });
    uint64_t total = 0;
    for (const RemoteFile& f : files)
      if (!(fs::is_regular_file(cache.blob_path(ref, f.etag), ec) &&
            fs::file_size(cache.blob_path(ref, f.etag), ec) == f.size))
        total += f.size;
    fs::create_directories(cache.repo_dir(ref) / "blobs");
    warn_if_short_of_space(cache.repo_dir(ref) / "blobs", total, notify);
    TransferProgress progress(ref.display(), total, settings.progress && total > 0);
    Shared sh{http, settings, cache, ref, commit, progress, notify};
    run_parallel(files.size(), settings.jobs, sh.cancel, [&](size_t i) {
      ensure_blob(sh, files[i]);
      if (sh.cancel) return;
      // config.json last: until it is there the snapshot never looks loadable (missing_for_load).
      if (files[i].path != "config.json")
        cache.link_file(ref, commit, files[i].path, files[i].etag);
    });
    progress.finish();
    for (const RemoteFile& f : files)
      if (f.path == "config.json") cache.link_file(ref, commit, f.path, f.etag);
    m.files_downloaded = sh.files;
    m.bytes_downloaded = sh.bytes;
  }
  // The ref moves only once its snapshot is whole, so an interrupted update leaves the branch
  // naming the snapshot that was complete before.
  if (rev != commit) cache.write_ref(ref, rev, commit);
  return m;
}

}  // namespace gemstage::hub
