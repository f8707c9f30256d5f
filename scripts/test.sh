#!/usr/bin/env bash
# Runs the whole test suite: the release build, the kernel tests cross-built for aarch64 under
# qemu, the fuzz targets briefly, then the same tests under ASan + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release
ctest --preset release -j 2
# The kernels and their tests cross-built for aarch64 (NEON tier) and run under qemu-aarch64.
if [[ "${GEMSTAGE_SKIP_AARCH64:-0}" == "1" ]]; then
  echo "test.sh: aarch64 kernel tests skipped (GEMSTAGE_SKIP_AARCH64=1)"
elif ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  echo "test.sh: SKIPPING the aarch64 kernel tests: aarch64-linux-gnu-g++ or qemu-aarch64 is not" \
       "installed (Debian g++-aarch64-linux-gnu, qemu-user; scripts/setup.sh installs both)"
else
  cmake --preset aarch64 >/dev/null
  cmake --build --preset aarch64
  ctest --preset aarch64
fi
# Every parser of outside input under libFuzzer for a few seconds each (clang build included).
if [[ "${GEMSTAGE_SKIP_FUZZ:-0}" != "1" ]]; then
  scripts/fuzz.sh "${GEMSTAGE_FUZZ_SECONDS:-10}"
fi
if [[ "${GEMSTAGE_SKIP_ASAN:-0}" != "1" ]]; then
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ctest --preset asan -j 2
fi
