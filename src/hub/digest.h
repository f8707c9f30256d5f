// Content hashes through OpenSSL's EVP interface: the sha256 the Hub publishes for LFS files
// (X-Linked-Etag, the LFS oid) and the git blob sha1 it publishes as the ETag of small files.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

namespace gemstage::hub {

class Digest {
 public:
  enum class Kind { Sha256, Sha1 };
  explicit Digest(Kind kind);
  ~Digest();
  Digest(const Digest&) = delete;
  Digest& operator=(const Digest&) = delete;

  void update(const void* data, size_t n);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // Lowercase hex of everything given since construction or the last reset().
  std::string hex();
  void reset();

 private:
  Kind kind_;
  struct Ctx;
  std::unique_ptr<Ctx> ctx_;
};

std::string sha256_hex(std::string_view data);
// git's object id of a blob: sha1 over "blob <size>\0" and then the content.
std::string git_blob_sha1_hex(std::string_view data);

// How a file's ETag can be checked: a 64-hex ETag is the content's sha256 (LFS), a 40-hex one its
// git blob sha1; anything else names no hash we can recompute.
enum class EtagKind { Sha256, GitSha1, Opaque };
EtagKind etag_kind(std::string_view etag);

}  // namespace gemstage::hub
