#!/usr/bin/env bash
# Runs the whole test suite: the release build, the fuzz targets briefly, then the same tests
# under ASan + UBSan.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake --build --preset release
ctest --preset release -j 2
# Every parser of outside input under libFuzzer for a few seconds each (clang build included).
if [[ "${GEMSTAGE_SKIP_FUZZ:-0}" != "1" ]]; then
  scripts/fuzz.sh "${GEMSTAGE_FUZZ_SECONDS:-10}"
fi
if [[ "${GEMSTAGE_SKIP_ASAN:-0}" != "1" ]]; then
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ctest --preset asan -j 2
fi
