#include "core/platform.h"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <fstream>
#include <sstream>

// One of three branches per build (core/platform.h). GEMSTAGE_PORTABLE_ONLY (a CMake option)
// forces the portable one so a Linux build runs the code other systems take.
#if defined(GEMSTAGE_PORTABLE_ONLY)
#define GEMSTAGE_PLATFORM_PORTABLE 1
#elif defined(__linux__)
#define GEMSTAGE_PLATFORM_LINUX 1
#elif defined(__APPLE__)
#define GEMSTAGE_PLATFORM_DARWIN 1
#else
#define GEMSTAGE_PLATFORM_PORTABLE 1
#endif

#if defined(GEMSTAGE_PLATFORM_LINUX)
#if defined(__GLIBC__)
#include <malloc.h>
#endif
#if defined(__aarch64__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#endif
#if defined(__x86_64__)
#include <sys/syscall.h>
#endif
#endif
#if defined(GEMSTAGE_PLATFORM_DARWIN)
#include <sys/sysctl.h>
#endif

namespace gemstage::platform {

namespace {

// Walks a directory of descriptor numbers (/proc/self/fd, /dev/fd), skipping the one that
// reads the directory itself. False when the directory cannot be opened.
[[maybe_unused]] bool walk_fd_directory(const char* path, const std::function<bool(int)>& fn) {
  DIR* dir = opendir(path);
  if (!dir) return false;
  const int own = dirfd(dir);
  while (const dirent* e = readdir(dir)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == own) continue;
    if (!fn(static_cast<int>(fd))) break;
  }
  closedir(dir);
  return true;
}

// POSIX: ask every descriptor number below the process limit. Bounded, so a huge or unlimited
// RLIMIT_NOFILE costs at most 65536 fcntl calls.
[[maybe_unused]] void probe_every_fd(const std::function<bool(int)>& fn) {
  rlimit lim{};
  rlim_t n = 1024;
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) n = lim.rlim_cur;
  n = std::min<rlim_t>(n, rlim_t{1} << 16);
  for (rlim_t fd = 0; fd < n; ++fd)
    if (fcntl(static_cast<int>(fd), F_GETFD) != -1 && !fn(static_cast<int>(fd))) return;
}

}  // namespace

const char* branch() {
#if defined(GEMSTAGE_PLATFORM_LINUX)
  return "linux";
#elif defined(GEMSTAGE_PLATFORM_DARWIN)
  return "darwin";
#else
  return "portable";
#endif
}

void tune_allocator_for_reused_buffers() {
#if defined(GEMSTAGE_PLATFORM_LINUX) && defined(__GLIBC__)
  // Each forward pass allocates and frees the same few-MB activation buffers. glibc's defaults
  // serve those from fresh mmaps or trim them back to the kernel, so every layer paid page
  // faults and page zeroing again (pp128 on the E2B-shape bundle: 108-118 t/s by default,
  // 124-126 t/s with these). Keep them in the heap instead: mmap only above 32 MiB (glibc's
  // ceiling for this setting) and trim only beyond 1 GiB of free top-of-heap.
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  mallopt(M_TOP_PAD, 64 << 20);
#endif
}

ProcessMemory process_memory() {
  ProcessMemory m;
  rusage ru{};
  if (getrusage(RUSAGE_SELF, &ru) == 0) {
#if defined(GEMSTAGE_PLATFORM_DARWIN)
    m.peak_bytes = static_cast<int64_t>(ru.ru_maxrss);  // bytes on Darwin
#else
    m.peak_bytes = static_cast<int64_t>(ru.ru_maxrss) * 1024;  // KiB on Linux and the BSDs
#endif
  }
#if defined(GEMSTAGE_PLATFORM_LINUX)
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream fields(line);
    std::string key;
    int64_t kb = 0;
    if (!(fields >> key >> kb)) continue;
    if (key == "RssFile:") m.resident_file_bytes = kb * 1024;
    if (key == "RssAnon:") m.resident_anon_bytes = kb * 1024;
  }
#endif
  return m;
}

void advise_random_reads([[maybe_unused]] int fd) {
#if defined(GEMSTAGE_PLATFORM_LINUX)
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
#elif defined(GEMSTAGE_PLATFORM_DARWIN)
  ::fcntl(fd, F_RDAHEAD, 0);
#endif
}

void for_each_open_fd(const std::function<bool(int)>& fn) {
#if defined(GEMSTAGE_PLATFORM_LINUX)
  if (walk_fd_directory("/proc/self/fd", fn)) return;
#elif defined(GEMSTAGE_PLATFORM_DARWIN)
  if (walk_fd_directory("/dev/fd", fn)) return;
#endif
  probe_every_fd(fn);
}

int sync_file_data(int fd) {
#if defined(GEMSTAGE_PLATFORM_LINUX)
  return ::fdatasync(fd);
#else
  return ::fsync(fd);
#endif
}

bool socket_peer_closed(int fd) {
#if defined(GEMSTAGE_PLATFORM_LINUX)
  pollfd p{fd, POLLRDHUP, 0};
  if (::poll(&p, 1, 0) < 0) return false;
  return (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
#else
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, 0) < 0) return false;
  if (p.revents & (POLLHUP | POLLERR)) return true;
  if (!(p.revents & POLLIN)) return false;
  char c = 0;
  const ssize_t n = ::recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
#endif
}

ArmExtensions arm_extensions() {
  ArmExtensions a;
#if defined(GEMSTAGE_PLATFORM_LINUX) && defined(__aarch64__)
  a.dotprod = (getauxval(AT_HWCAP) & HWCAP_ASIMDDP) != 0;
#if defined(HWCAP2_I8MM)
  a.i8mm = (getauxval(AT_HWCAP2) & HWCAP2_I8MM) != 0;
#endif
#elif defined(GEMSTAGE_PLATFORM_DARWIN) && defined(__aarch64__)
  auto has = [](const char* name) {
    int v = 0;
    size_t n = sizeof(v);
    return sysctlbyname(name, &v, &n, nullptr, 0) == 0 && v != 0;
  };
  a.dotprod = has("hw.optional.arm.FEAT_DotProd");
  a.i8mm = has("hw.optional.arm.FEAT_I8MM");
#endif
  return a;
}

bool request_amx_tile_state() {
#if defined(GEMSTAGE_PLATFORM_LINUX) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023;  // arch_prctl code, asm/prctl.h
  constexpr long kXfeatureXtiledata = 18;     // the tile data state component
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

}  // namespace gemstage::platform
