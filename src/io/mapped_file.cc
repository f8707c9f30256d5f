#include "io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "core/error.h"
#include "core/platform.h"

namespace gemstage {

namespace {

// The table of live mappings. Fixed slots, because the SIGBUS handler reads it and may not
// allocate or lock; a slot is published by storing `begin` last and retired by clearing it
// first. The mutex orders registration against check_mapped_files() (which uses the row fd).
struct MappingSlot {
  std::atomic<uintptr_t> begin{0};
  std::atomic<size_t> size{0};
  int fd = -1;
  char path[1024] = {};
};
constexpr size_t kMaxSlots = 4096;
MappingSlot g_slots[kMaxSlots];
std::mutex g_slots_mu;

int register_mapping(const uint8_t* data, size_t size, int fd, const std::string& path) {
  if (!data) return -1;
  std::lock_guard<std::mutex> lk(g_slots_mu);
  for (size_t i = 0; i < kMaxSlots; ++i) {
    MappingSlot& s = g_slots[i];
    if (s.begin.load(std::memory_order_relaxed) != 0) continue;
    s.fd = fd;
    const size_t n = std::min(path.size(), sizeof(s.path) - 1);
    std::memcpy(s.path, path.data(), n);
    s.path[n] = '\0';
    s.size.store(size, std::memory_order_relaxed);
    s.begin.store(reinterpret_cast<uintptr_t>(data), std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;  // table full: this mapping just gets no named report
}

void unregister_mapping(int slot) {
  if (slot < 0) return;
  std::lock_guard<std::mutex> lk(g_slots_mu);
  g_slots[slot].begin.store(0, std::memory_order_release);
  g_slots[slot].fd = -1;
}

void write_all(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void write_str(const char* s) {
  write_all(s, std::strlen(s));
}

void on_sigbus(int sig, siginfo_t* info, void*) {
  const auto addr = reinterpret_cast<uintptr_t>(info ? info->si_addr : nullptr);
  for (size_t i = 0; i < kMaxSlots; ++i) {
    const uintptr_t b = g_slots[i].begin.load(std::memory_order_acquire);
    if (b == 0 || addr < b || addr - b >= g_slots[i].size.load(std::memory_order_relaxed)) continue;
    write_str("error: ");
    write_str(g_slots[i].path);
    write_str(
        ": the file changed on disk while gemstage was reading it (it was truncated or "
        "rewritten in place, so part of its memory map no longer exists); gemstage cannot "
        "continue. Replace files only by writing a new file and renaming it over the old one "
        "(as 'gemstage export' does), then start gemstage again.\n");
    ::_exit(kMappedFileChangedExit);
  }
  // Not a mapped file of ours: let the default action (a core dump) describe it.
  ::signal(sig, SIG_DFL);
}

}  // namespace

void install_mapped_file_fault_handler() {
  struct sigaction sa {};
  sa.sa_sigaction = on_sigbus;
  sa.sa_flags = SA_SIGINFO | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGBUS, &sa, nullptr);
}

void check_mapped_files() {
  std::lock_guard<std::mutex> lk(g_slots_mu);
  for (const MappingSlot& s : g_slots) {
    if (s.begin.load(std::memory_order_relaxed) == 0 || s.fd < 0) continue;
    struct stat st {};
    if (::fstat(s.fd, &st) != 0) continue;
    const size_t mapped = s.size.load(std::memory_order_relaxed);
    if (static_cast<size_t>(st.st_size) < mapped)
      fail(s.path, ": the file shrank from ", mapped, " to ", st.st_size,
           " bytes while gemstage had it mapped (truncated or rewritten in place); its weights "
           "can no longer be read. Restore the file (write a new file and rename it over the "
           "old one, as 'gemstage export' does) and restart gemstage");
  }
}

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
  platform::advise_random_reads(row_fd_);
  slot_ = register_mapping(data_, size_, row_fd_, path_);
}

MappedFile::~MappedFile() {
  unregister_mapping(slot_);
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
