#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/, clang + ASan + UBSan) and runs each for SECONDS (default
# 60) on its seed corpus, then prints executions, coverage and corpus size per target.
#   scripts/fuzz.sh [SECONDS] [TARGET...]
# Seeds live in fuzz/corpus/<target>/ and are never modified; what a run discovers goes to
# fuzz/corpus-run/<target>/ (ignored by git) and is reused by the next run. A crash, leak,
# sanitizer report or uncaught exception fails the script and leaves the input under
# build-fuzz/findings/; turn each into a regression test in tests/ (see tests/fuzz_regression_test.cc).
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_PER_TARGET="${1:-60}"
shift || true
TARGETS=("$@")
if ((${#TARGETS[@]} == 0)); then
  TARGETS=(fuzz_safetensors fuzz_weights_file fuzz_config fuzz_npy fuzz_tokenizer
           fuzz_tokenizer_files fuzz_image fuzz_openai_request fuzz_bundle_manifest fuzz_audio
           fuzz_video fuzz_tool_calls fuzz_chat_template fuzz_json_schema fuzz_wire_message)
fi

launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# A unity build: the parsers' sources in batches per compiler run, half the compile time of one
# run per source (docs/testing.md).
cmake -S fuzz -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_UNITY_BUILD=ON \
  "${launcher[@]}" >/dev/null
cmake --build build-fuzz --target "${TARGETS[@]}"

mkdir -p build-fuzz/findings
summary=()
failed=0
for t in "${TARGETS[@]}"; do
  work="fuzz/corpus-run/$t"
  mkdir -p "$work"
  log="build-fuzz/$t.log"
  echo "fuzz: $t for ${SECONDS_PER_TARGET}s"
  # -rss_limit_mb: a parser that allocates what a hostile size field asks for is a finding.
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
      "build-fuzz/$t" -max_total_time="$SECONDS_PER_TARGET" -timeout=20 -rss_limit_mb=2048 \
      -print_final_stats=1 -artifact_prefix="build-fuzz/findings/$t-" "$work" "fuzz/corpus/$t" \
      >"$log" 2>&1; then
    echo "fuzz: $t FAILED; the end of $log:" >&2
    tail -40 "$log" >&2
    failed=1
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  cov=$(grep -o 'cov: [0-9]* ft: [0-9]* corp: [0-9]*/[0-9]*[a-zA-Z]*' "$log" | tail -1 || true)
  summary+=("$(printf '%-22s execs %-10s %s' "$t" "$execs" "$cov")")
done
echo "fuzz: summary (${SECONDS_PER_TARGET}s each)"
printf '  %s\n' "${summary[@]}"
exit "$failed"
