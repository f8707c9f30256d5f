#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace gemstage {

MappedFile::MappedFile(const std::string& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, ": cannot open (", std::strerror(errno), ")");
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(path, ": not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail(path, ": mmap failed (", std::strerror(errno), ")");
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  row_fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (row_fd_ < 0) {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    fail(path, ": cannot open a second time for row reads (", std::strerror(errno), ")");
  }
  ::posix_fadvise(row_fd_, 0, 0, POSIX_FADV_RANDOM);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  if (row_fd_ >= 0) ::close(row_fd_);
}

std::string read_text_file(const std::string& path, size_t max_bytes) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(path, ": cannot open for reading");
  in.seekg(0, std::ios::end);
  const std::streamoff n = in.tellg();
  if (n < 0) fail(path, ": cannot determine size");
  if (static_cast<size_t>(n) > max_bytes)
    fail(path, ": file is ", n, " bytes, more than the limit of ", max_bytes);
  in.seekg(0);
  std::string s(static_cast<size_t>(n), '\0');
  in.read(s.data(), n);
  if (!in) fail(path, ": short read");
  return s;
}

}  // namespace gemstage
