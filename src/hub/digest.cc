#include "hub/digest.h"

#include <openssl/evp.h>

#include "core/error.h"

namespace gemstage::hub {

struct Digest::Ctx {
  EVP_MD_CTX* md = nullptr;
  ~Ctx() { EVP_MD_CTX_free(md); }
};

Digest::Digest(Kind kind) : kind_(kind), ctx_(std::make_unique<Ctx>()) {
  ctx_->md = EVP_MD_CTX_new();
  if (ctx_->md == nullptr) throw std::bad_alloc();
  reset();
}

Digest::~Digest() = default;

void Digest::reset() {
  const EVP_MD* md = kind_ == Kind::Sha256 ? EVP_sha256() : EVP_sha1();
  if (EVP_DigestInit_ex(ctx_->md, md, nullptr) != 1) fail("OpenSSL could not start a digest");
}

void Digest::update(const void* data, size_t n) {
  if (n > 0 && EVP_DigestUpdate(ctx_->md, data, n) != 1) fail("OpenSSL digest update failed");
}

std::string Digest::hex() {
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (EVP_DigestFinal_ex(ctx_->md, out, &len) != 1) fail("OpenSSL digest failed");
  static constexpr char digits[] = "0123456789abcdef";
  std::string s(2 * len, '0');
  for (unsigned i = 0; i < len; ++i) {
    s[2 * i] = digits[out[i] >> 4];
    s[2 * i + 1] = digits[out[i] & 15];
  }
  reset();
  return s;
}

std::string sha256_hex(std::string_view data) {
  Digest d(Digest::Kind::Sha256);
  d.update(data);
  return d.hex();
}

std::string git_blob_sha1_hex(std::string_view data) {
  Digest d(Digest::Kind::Sha1);
  const std::string header = "blob " + std::to_string(data.size());
  d.update(header.data(), header.size() + 1);  // with its terminating NUL
  d.update(data);
  return d.hex();
}

EtagKind etag_kind(std::string_view etag) {
  for (char c : etag)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return EtagKind::Opaque;
  if (etag.size() == 64) return EtagKind::Sha256;
  if (etag.size() == 40) return EtagKind::GitSha1;
  return EtagKind::Opaque;
}

}  // namespace gemstage::hub
