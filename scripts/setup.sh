#!/usr/bin/env bash
# Installs every dependency (Debian packages, npm test packages) and builds build/gemstage.
# Idempotent: safe to run again; it only installs what is missing and rebuilds incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."

DEBIAN_PACKAGES=(
  build-essential cmake ninja-build pkg-config git
  nlohmann-json3-dev libcli11-dev libcpp-httplib-dev libssl-dev
  libpng-dev libjpeg62-turbo-dev zlib1g-dev
  # audio: decoding (WAV, FLAC, OGG, MP3), resampling to 16 kHz, the log-mel FFT.
  libsndfile1-dev libsamplerate0-dev libfftw3-dev
  # video: demuxing (MP4/MOV, Matroska/WebM, GIF), decoding and RGB conversion (src/video).
  libavformat-dev libavcodec-dev libswscale-dev libavutil-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  clang-format librsvg2-bin chromium
  # libFuzzer targets (fuzz/, scripts/fuzz.sh): clang and its runtime (libFuzzer, ASan, UBSan).
  clang libclang-rt-14-dev
  # The aarch64 preset: cross compiler (with the arm64 libc/libstdc++) and qemu-aarch64 to run
  # the kernel tests it builds (scripts/test.sh).
  g++-aarch64-linux-gnu qemu-user
  # Stages on separate processes / hosts (src/distributed, issue 22): Open MPI.
  libopenmpi-dev openmpi-bin
)

missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js: this machine type ships nodejs with npm bundled; Debian's separate npm package conflicts
# with that build, so only ask for it where npm is absent.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((${#missing[@]})); then
  echo "setup: installing Debian packages: ${missing[*]}"
  SUDO=""
  [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# JavaScript packages used only by the tests (tokenizer parity, OpenAI client, browser).
if [[ -f tests/js/package.json ]]; then
  if [[ ! -d tests/js/node_modules ]] || [[ tests/js/package.json -nt tests/js/node_modules ]]; then
    echo "setup: installing npm test packages"
    (cd tests/js && npm install --no-audit --no-fund --loglevel=error && touch node_modules)
  fi
fi

cmake --preset release >/dev/null
cmake --build --preset release
echo "setup: done; the CLI is build/gemstage"
