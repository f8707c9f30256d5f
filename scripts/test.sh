#!/usr/bin/env bash
# Runs the whole test suite: the source checks, the release build, the kernel tests cross-built
# for aarch64 under qemu, the fuzz targets briefly, the same tests under ASan + UBSan, then the
# concurrency tests under ThreadSanitizer. Each phase's duration is printed as it ends.
set -euo pipefail
cd "$(dirname "$0")/.."
phase_start=$SECONDS
phase() {  # phase NAME: prints how long the phase that just ended took
  echo "test.sh: phase $1 took $((SECONDS - phase_start)) s"
  phase_start=$SECONDS
}
scripts/check_globals.sh
cmake --build --preset release
ctest --preset release -j 2
phase release
# The CLI and the ci label's tests cross-built for aarch64 and run under qemu-aarch64 (kernels on
# three CPU models, every golden fixture, `gemstage parity` of every fixture set).
if [[ "${GEMSTAGE_SKIP_AARCH64:-0}" == "1" ]]; then
  echo "test.sh: aarch64 kernel tests skipped (GEMSTAGE_SKIP_AARCH64=1)"
elif ! command -v aarch64-linux-gnu-g++ >/dev/null || ! command -v qemu-aarch64 >/dev/null; then
  echo "test.sh: SKIPPING the aarch64 kernel tests: aarch64-linux-gnu-g++ or qemu-aarch64 is not" \
       "installed (Debian g++-aarch64-linux-gnu, qemu-user; scripts/setup.sh installs both)"
else
  cmake --preset aarch64 >/dev/null
  # What the `ci` label runs: the CLI and the binary of its suites (scripts/test_aarch64_full.sh
  # builds and runs everything).
  cmake --build --preset aarch64 --target gemstage gemstage_ci_tests
  ctest --preset aarch64
fi
phase aarch64
# Every parser of outside input under libFuzzer for a few seconds each (clang build included).
if [[ "${GEMSTAGE_SKIP_FUZZ:-0}" != "1" ]]; then
  scripts/fuzz.sh "${GEMSTAGE_FUZZ_SECONDS:-5}"
fi
phase fuzz
if [[ "${GEMSTAGE_SKIP_ASAN:-0}" != "1" ]]; then
  cmake --preset asan >/dev/null
  cmake --build --preset asan
  ctest --preset asan -j 2
fi
phase asan
if [[ "${GEMSTAGE_SKIP_TSAN:-0}" != "1" ]]; then
  cmake --preset tsan >/dev/null
  cmake --build --preset tsan
  ctest --preset tsan -j 2
fi
phase tsan
if [[ "${GEMSTAGE_ALLOW_MPI_SKIP:-0}" == "1" ]]; then
  echo "test.sh: WARNING: GEMSTAGE_ALLOW_MPI_SKIP=1: the MPI tests this machine cannot run" \
       "(two hosts in network namespaces, or mpirun itself) were SKIPPED, not passed" >&2
fi
if [[ ! -f tests/fixtures/chat-template/chat_template.jinja ]]; then
  echo "test.sh: NOTE: the 27 checkpoint-template cases (tests/chat_template_cases_test.cc) did" \
       "NOT run: Google's chat_template.jinja is not in the repository (it is gated and under the" \
       "Gemma terms); put it at tests/fixtures/chat-template/chat_template.jinja and set" \
       "GEMSTAGE_REQUIRE_CHECKPOINT_TEMPLATE=1 to run them" >&2
fi
