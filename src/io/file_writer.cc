#include "io/file_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"
#include "core/platform.h"

namespace gemstage {

namespace {
constexpr size_t kBufferBytes = size_t{4} << 20;

// What the user can do about the usual ways a write fails.
const char* advice_for(int err) {
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      return "free space on that disk or write somewhere else, then run the command again";
    case EFBIG:
      return "the file size limit (ulimit -f) or the file system's maximum file size was "
             "reached; raise the limit or write somewhere else, then run the command again";
    case EACCES:
    case EPERM:
    case EROFS:
      return "choose a folder you can write to";
    default:
      return "check the disk and run the command again";
  }
}
}  // namespace

FileWriter::~FileWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void FileWriter::fail_errno(const char* what, int err) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (written_ > 0 || used_ > 0)
    fail(path_, ": ", what, " failed after ", written_, " bytes (", std::strerror(err), "); ",
         advice_for(err));
  fail(path_, ": ", what, " failed (", std::strerror(err), "); ", advice_for(err));
}

void FileWriter::open(const std::string& path) {
  if (fd_ >= 0) ::close(fd_);
  path_ = path;
  written_ = 0;
  used_ = 0;
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail_errno("opening for writing", errno);
  buf_.resize(kBufferBytes);
}

void FileWriter::flush_buffer() {
  size_t done = 0;
  while (done < used_) {
    const ssize_t n = ::write(fd_, buf_.data() + done, used_ - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail_errno("writing", n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
    written_ += static_cast<uint64_t>(n);
  }
  used_ = 0;
}

void FileWriter::write(const void* data, size_t n) {
  if (fd_ < 0) fail(path_, ": write after the file was closed or failed");
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const size_t take = std::min(n, buf_.size() - used_);
    std::memcpy(buf_.data() + used_, p, take);
    used_ += take;
    p += take;
    n -= take;
    if (used_ == buf_.size()) flush_buffer();
  }
}

void FileWriter::commit() {
  if (fd_ < 0) fail(path_, ": commit after the file was closed or failed");
  flush_buffer();
  if (platform::sync_file_data(fd_) != 0 && errno != EINVAL && errno != EROFS)
    fail_errno("syncing", errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    fail(path_, ": closing failed (", std::strerror(err), "); ", advice_for(err));
  }
  buf_.clear();
  buf_.shrink_to_fit();
}

void write_file_synced(const std::string& path, const std::string& contents) {
  FileWriter w(path);
  w.write(contents);
  w.commit();
}

void rename_into_place(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    fail("renaming ", from, " to ", to, " failed (", std::strerror(errno), ")");
}

void sync_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace gemstage
