// An exclusive flock(2) on a lock file, held for the life of the object. The Python tools lock
// the same files (.locks/models--ORG--NAME/<etag>.lock, through the filelock package's flock), so
// gemstage, transformers and a second gemstage never write one blob at the same time.
#pragma once

#include <filesystem>
#include <functional>

namespace gemstage::hub {

class FileLock {
 public:
  // Creates the lock file (and its folder) when missing, then waits for the lock; on_wait runs
  // once, before waiting, when another process holds it.
  FileLock(const std::filesystem::path& path, const std::function<void()>& on_wait = nullptr);
  ~FileLock();
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace gemstage::hub
