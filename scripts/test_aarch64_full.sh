#!/usr/bin/env bash
# Everything the aarch64 cross build can prove under qemu-aarch64, beyond what scripts/test.sh
# runs in CI (the `ci` label: kernel tests on three CPU models, the golden-fixture parity tests,
# `gemstage parity` of every fixture set):
#   - the `full` label: the whole gemstage_tests binary in shards, the golden tests on the scalar
#     tier, the node tests (the OpenAI, Anthropic and Responses clients against `serve`, the
#     tokenizer parity, the chat page in Chromium, load and soak);
#   - `generate`'s greedy ids on every fixture model, aarch64 against the x86 build of the same
#     tree (build/, the release preset).
# Prints how long each part took. Needs scripts/setup.sh's packages (cross compiler, qemu-user,
# the arm64 libraries, node). GEMSTAGE_ARM_CPU picks the qemu CPU model for the last part (max).
set -euo pipefail
cd "$(dirname "$0")/.."

timings=()
timed() {
  local name="$1"
  shift
  local t0=$SECONDS
  "$@"
  timings+=("$(printf '%-44s %5d s' "$name" $((SECONDS - t0)))")
}

configure_and_build() {
  cmake --preset aarch64 >/dev/null
  cmake --build --preset aarch64
}
timed "aarch64 build (incremental)" configure_and_build
timed "ctest label ci (kernels x3, golden, parity)" \
  ctest --test-dir build-aarch64 -L ci -j 2 --output-on-failure
timed "ctest label full (whole suite, node tests)" \
  ctest --test-dir build-aarch64 -L full -j 2 --output-on-failure

# The same greedy ids from the x86 and the aarch64 CLI, on every fixture model, text and (where
# the model has the tower) an image or audio prompt.
compare_with_x86() {
  cmake --preset release >/dev/null
  cmake --build --preset release --target gemstage
  local fx=tests/fixtures arm=build-aarch64/gemstage-emulated x86=build/gemstage failed=0
  local cases=(
    "gemma4-tiny/model|"
    "gemma4-tiny/model|--image $fx/gemma4-tiny/multimodal/image.png"
    "gemma4-tiny-moe/model|"
    "gemma4-tiny-dense/model|--image $fx/gemma4-tiny-dense/multimodal/image.png"
    "gemma4-tiny-audio/model|--audio $fx/gemma4-tiny-audio/audio/audio.wav"
    "gemma4-tiny-unified/model|--image $fx/gemma4-tiny-unified/image/image.png"
  )
  for c in "${cases[@]}"; do
    local model="$fx/${c%%|*}" extra="${c#*|}"
    # shellcheck disable=SC2086
    local args=(generate -m "$model" -p "Describe what you see and hear." -n 16 --temp 0 --json -t 2 $extra)
    local want got
    want=$("$x86" "${args[@]}" 2>/dev/null | head -1 | node -e \
      'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.stringify(JSON.parse(s).tokens)))')
    got=$(QEMU_CPU="${GEMSTAGE_ARM_CPU:-max}" "$arm" "${args[@]}" 2>/dev/null | head -1 | node -e \
      'let s="";process.stdin.on("data",d=>s+=d).on("end",()=>console.log(JSON.stringify(JSON.parse(s).tokens)))')
    if [[ "$want" == "$got" && -n "$want" && "$want" != "[]" ]]; then
      echo "greedy ids equal x86's: ${c%%|*} $extra: $got"
    else
      echo "MISMATCH: ${c%%|*} $extra: x86 $want, aarch64 $got"
      failed=1
    fi
  done
  return $failed
}
timed "generate greedy ids, aarch64 vs x86" compare_with_x86

echo
echo "test_aarch64_full.sh: every part passed; wall time per part:"
printf '  %s\n' "${timings[@]}"
