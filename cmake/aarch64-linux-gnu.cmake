# Cross-compiling for 64-bit ARM Linux with Debian's g++-aarch64-linux-gnu (the `aarch64` preset).
# Test binaries run under qemu-aarch64 (Debian qemu-user) with the target's libraries from
# /usr/aarch64-linux-gnu; without qemu the build still works and ctest has nothing to run them.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE ONLY)
find_program(GEMSTAGE_QEMU_AARCH64 NAMES qemu-aarch64 qemu-aarch64-static)
if(GEMSTAGE_QEMU_AARCH64)
  set(CMAKE_CROSSCOMPILING_EMULATOR ${GEMSTAGE_QEMU_AARCH64} -L /usr/aarch64-linux-gnu)
endif()
