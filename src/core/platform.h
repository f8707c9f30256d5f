// What gemstage asks of the operating system beyond ISO C++ and POSIX, in one place.
//
// Each function has a Linux branch, a Darwin (macOS) branch and a portable POSIX fallback that
// any other system takes. Building with -DGEMSTAGE_PORTABLE_ONLY=ON makes every function take
// the fallback on Linux too, so the code paths a port relies on run in this project's own tests
// (docs/arm-and-macos.md says which branches were compiled and run where). Nothing else in the
// project may use a Linux-only interface (mallopt, /proc, getauxval, arch_prctl, posix_fadvise,
// ...): it belongs here, with a fallback.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

namespace gemstage::platform {

// Which branch the functions below take in this build: "linux", "darwin" or "portable".
const char* branch();

// Keeps the few-megabyte buffers a forward pass allocates and frees in the heap instead of
// fresh mmaps that the kernel must fault in and zero every time (glibc's mallopt; the other
// allocators need no such setting). Call once, first thing in main.
void tune_allocator_for_reused_buffers();

// Memory of this process. peak_bytes is the resident high-water mark (getrusage everywhere, whose
// unit differs between Linux and Darwin); the resident file-backed and anonymous split is known
// only on Linux (/proc/self/status) and is -1 elsewhere.
struct ProcessMemory {
  int64_t peak_bytes = -1;
  int64_t resident_file_bytes = -1;
  int64_t resident_anon_bytes = -1;
};
ProcessMemory process_memory();

// Tells the kernel that `fd` is read at scattered offsets (row gathers from embedding tables),
// so it does not read ahead (posix_fadvise on Linux, F_RDAHEAD on Darwin, nothing elsewhere).
void advise_random_reads(int fd);

// Calls fn(fd) for each descriptor open in this process, in increasing order, until fn returns
// false (/proc/self/fd on Linux, /dev/fd on Darwin; elsewhere every descriptor below the
// RLIMIT_NOFILE limit, capped at 1 << 16, is asked with fcntl).
void for_each_open_fd(const std::function<bool(int)>& fn);

// Writes the file's data (not necessarily its metadata) to stable storage before a rename
// publishes it: fdatasync on Linux, fsync (POSIX) elsewhere. 0 or -1 with errno, as they return.
int sync_file_data(int fd);

// Whether the other end of a connected socket has closed or reset it, without consuming any byte
// it sent: poll with POLLRDHUP on Linux; elsewhere poll for POLLIN and peek one byte (0 from
// recv is an orderly close). False when it cannot tell.
bool socket_peer_closed(int fd);

// The Arm extensions the kernels use, as the operating system reports them (getauxval on Linux,
// sysctlbyname on Darwin; none elsewhere, which leaves the plain NEON kernels).
struct ArmExtensions {
  bool dotprod = false;  // SDOT/UDOT (FEAT_DotProd)
  bool i8mm = false;     // SMMLA/UMMLA/USDOT (FEAT_I8MM)
};
ArmExtensions arm_extensions();

// Asks the operating system for the AMX tile state (Linux hands the 8 KiB of tile registers to a
// process only on request, arch_prctl ARCH_REQ_XCOMP_PERM); true when granted. False on every
// other system, where the AMX kernels are then not offered.
bool request_amx_tile_state();

}  // namespace gemstage::platform
