# Cross-compiling for 64-bit ARM Linux (the `aarch64` preset) with Debian's g++-aarch64-linux-gnu
# against Debian multiarch: the arm64 builds of the libraries (`apt-get install libpng-dev:arm64
# ...`, scripts/setup.sh) sit beside the host's, in /usr/lib/aarch64-linux-gnu, with their
# arch-specific headers in /usr/include/aarch64-linux-gnu. The cross compiler searches both on its
# own; CMake is told the library architecture so find_library and find_package(... CONFIG) look
# under lib/aarch64-linux-gnu (never the host's), and pkg-config is the cross wrapper that reads
# only the arm64 .pc files. Nothing here names the host's library directory.
#
# Test binaries run under qemu-aarch64 (Debian qemu-user). With the arm64 C library installed
# through multiarch (libc6:arm64, which the -dev packages pull in), qemu finds the loader at
# /lib/ld-linux-aarch64.so.1 and the libraries where the arm64 loader looks for them; without qemu
# the build still works and ctest has nothing to run the tests with.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)

# Look for libraries, headers and package configurations only in the target's places: the cross
# compiler's own tree and the multiarch directories under /usr (the latter through
# CMAKE_LIBRARY_ARCHITECTURE). Programs (qemu, node, pkg-config) are the host's.
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu /)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
# The host's x86-64 package configurations live in the same prefixes (/usr/lib/x86_64-linux-gnu);
# CMake would not pick them for this architecture, and an x86 mpicxx must not be mistaken for an
# arm64 MPI either (Debian's arm64 Open MPI cannot be installed beside the amd64 one).
set(CMAKE_DISABLE_FIND_PACKAGE_MPI ON CACHE BOOL "No MPI in the aarch64 cross build")

find_program(GEMSTAGE_CROSS_PKG_CONFIG NAMES aarch64-linux-gnu-pkg-config)
if(GEMSTAGE_CROSS_PKG_CONFIG)
  set(PKG_CONFIG_EXECUTABLE ${GEMSTAGE_CROSS_PKG_CONFIG} CACHE FILEPATH "pkg-config for arm64")
endif()

find_program(GEMSTAGE_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(GEMSTAGE_QEMU_AARCH64)
  if(EXISTS /lib/ld-linux-aarch64.so.1)
    set(CMAKE_CROSSCOMPILING_EMULATOR ${GEMSTAGE_QEMU_AARCH64})
  else()
    # Only the cross toolchain's C library (no multiarch libc6:arm64): point qemu at it.
    set(CMAKE_CROSSCOMPILING_EMULATOR ${GEMSTAGE_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
  endif()
endif()
