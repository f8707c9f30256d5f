// core/platform.h: each function on the branch this build takes. A build with
// -DGEMSTAGE_PORTABLE_ONLY=ON runs the same tests on the portable fallbacks (the code a macOS or
// BSD build leans on where it has no branch of its own).
#include "core/platform.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

namespace gemstage::platform {
namespace {

TEST(Platform, BranchIsTheOneThisBuildAskedFor) {
  const std::string b = branch();
#if defined(GEMSTAGE_PORTABLE_ONLY)
  EXPECT_EQ(b, "portable");
#elif defined(__linux__)
  EXPECT_EQ(b, "linux");
#elif defined(__APPLE__)
  EXPECT_EQ(b, "darwin");
#else
  EXPECT_EQ(b, "portable");
#endif
}

TEST(Platform, PeakMemoryCoversABufferJustTouched) {
  constexpr size_t kBytes = size_t{96} << 20;
  std::vector<char> buf(kBytes);
  std::memset(buf.data(), 1, buf.size());  // every page resident
  const ProcessMemory m = process_memory();
  EXPECT_GE(m.peak_bytes, static_cast<int64_t>(kBytes));
  EXPECT_LT(m.peak_bytes, int64_t{1} << 40);  // a unit mix-up (bytes vs KiB) would show here
  if (std::string(branch()) == "linux") {
    EXPECT_GE(m.resident_anon_bytes, static_cast<int64_t>(kBytes));
    EXPECT_GE(m.resident_file_bytes, 0);
  } else {
    EXPECT_EQ(m.resident_anon_bytes, -1);
    EXPECT_EQ(m.resident_file_bytes, -1);
  }
  EXPECT_EQ(buf[kBytes - 1], 1);
}

std::vector<int> open_fds() {
  std::vector<int> fds;
  for_each_open_fd([&](int fd) {
    fds.push_back(fd);
    return true;
  });
  return fds;
}

bool contains(const std::vector<int>& v, int x) {
  for (int y : v)
    if (y == x) return true;
  return false;
}

TEST(Platform, OpenDescriptorsAreListedAndClosedOnesAreNot) {
  const std::string path = testing::temp_dir("platform_fds") + "/f";
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  const std::vector<int> with = open_fds();
  EXPECT_TRUE(contains(with, fd));
  EXPECT_TRUE(contains(with, STDERR_FILENO));
  ::close(fd);
  EXPECT_FALSE(contains(open_fds(), fd));
  int calls = 0;
  for_each_open_fd([&](int) { return ++calls < 2; });  // stops when told
  EXPECT_EQ(calls, 2);
}

TEST(Platform, RandomReadAdviceLeavesTheFileReadable) {
  const std::string path = testing::temp_dir("platform_advice") + "/f";
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "abc", 3), 3);
  advise_random_reads(fd);
  char c = 0;
  EXPECT_EQ(::pread(fd, &c, 1, 2), 1);
  EXPECT_EQ(c, 'c');
  ::close(fd);
  advise_random_reads(-1);  // a bad descriptor is ignored, as the advice is only a hint
}

TEST(Platform, SyncedDataIsThere) {
  const std::string path = testing::temp_dir("platform_sync") + "/f";
  const int fd = ::open(path.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "xyz", 3), 3);
  EXPECT_EQ(sync_file_data(fd), 0);
  ::close(fd);
  EXPECT_EQ(sync_file_data(fd), -1);  // closed: the error comes back
}

TEST(Platform, PeerCloseIsSeenWithoutConsumingPendingBytes) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  EXPECT_FALSE(socket_peer_closed(sv[0]));  // open and quiet
  ASSERT_EQ(::write(sv[1], "q", 1), 1);
  EXPECT_FALSE(socket_peer_closed(sv[0]));  // open with a byte waiting
  char c = 0;
  ASSERT_EQ(::read(sv[0], &c, 1), 1);  // the byte is still there to read
  EXPECT_EQ(c, 'q');
  ::close(sv[1]);
  EXPECT_TRUE(socket_peer_closed(sv[0]));
  ::close(sv[0]);
}

TEST(Platform, CpuExtensionsOnlyWhereTheBranchCanAsk) {
  const ArmExtensions arm = arm_extensions();
#if !defined(__aarch64__)
  EXPECT_FALSE(arm.dotprod);
  EXPECT_FALSE(arm.i8mm);
#endif
  if (std::string(branch()) == "portable") {
    EXPECT_FALSE(arm.dotprod);
    EXPECT_FALSE(arm.i8mm);
    EXPECT_FALSE(request_amx_tile_state());
  }
#if !defined(__x86_64__)
  EXPECT_FALSE(request_amx_tile_state());
#endif
}

}  // namespace
}  // namespace gemstage::platform
