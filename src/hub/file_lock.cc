#include "hub/file_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace gemstage::hub {

FileLock::FileLock(const std::filesystem::path& path, const std::function<void()>& on_wait) {
  std::filesystem::create_directories(path.parent_path());
  // 0664 like the Python tools, so users sharing a cache folder can wait on each other's locks.
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0664);
  if (fd_ < 0) fail("cannot open the lock file ", path.string(), ": ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) == 0) return;
  if (errno != EWOULDBLOCK) {
    const int err = errno;
    ::close(fd_);
    fail("cannot lock ", path.string(), ": ", std::strerror(err));
  }
  if (on_wait) on_wait();
  while (::flock(fd_, LOCK_EX) != 0) {
    if (errno == EINTR) continue;
    const int err = errno;
    ::close(fd_);
    fail("cannot lock ", path.string(), ": ", std::strerror(err));
  }
}

FileLock::~FileLock() {
  if (fd_ >= 0) {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }
}

}  // namespace gemstage::hub
