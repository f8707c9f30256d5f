#!/usr/bin/env bash
# Runs the whole test suite: the release build, then the same tests under ASan + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release
ctest --preset release -j 2
if [[ "${GEMSTAGE_SKIP_ASAN:-0}" != "1" ]]; then
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ctest --preset asan -j 2
fi
