#!/usr/bin/env bash
# Installs every dependency (Debian packages, the chat page's and the tests' npm packages) and
# builds build/gemstage.
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
  # what it builds (scripts/test.sh, scripts/test_aarch64_full.sh).
  g++-aarch64-linux-gnu qemu-user
  # Stages on separate processes / hosts (src/distributed, issue 22): Open MPI, and iproute2's
  # `ip netns` for the two-host test (two network namespaces joined by a veth pair).
  libopenmpi-dev openmpi-bin iproute2
)

# The same libraries built for arm64, beside the host's (Debian multiarch), for the aarch64 preset
# (cmake/aarch64-linux-gnu.cmake). The header-only ones (nlohmann-json, CLI11) serve every
# architecture. Open MPI is left out: Debian's arm64 Open MPI cannot be installed beside the amd64
# one, so the cross build has no MPI transport (the native x86 build keeps it).
ARM64_PACKAGES=(
  libssl-dev libpng-dev libjpeg62-turbo-dev zlib1g-dev
  libsndfile1-dev libsamplerate0-dev libfftw3-dev
  libgtest-dev libgmock-dev libbenchmark-dev libcpp-httplib-dev
  libavformat-dev libavcodec-dev libswscale-dev libavutil-dev
)
for p in "${ARM64_PACKAGES[@]}"; do
  DEBIAN_PACKAGES+=("$p:arm64")
done

SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
need_update=0
if ! dpkg --print-foreign-architectures | grep -qx arm64; then
  echo "setup: enabling the arm64 architecture (Debian multiarch) for the aarch64 cross build"
  $SUDO dpkg --add-architecture arm64
  need_update=1
fi

missing=()
for p in "${DEBIAN_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node.js: this machine type ships nodejs with npm bundled; Debian's separate npm package conflicts
# with that build, so only ask for it where npm is absent.
command -v node >/dev/null 2>&1 || missing+=(nodejs)
command -v npm >/dev/null 2>&1 || missing+=(npm)
if ((${#missing[@]})) || ((need_update)); then
  echo "setup: installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The chat page's libraries and bundler (web/, pinned in web/package-lock.json): the build bundles
# them into the binary (src/server/CMakeLists.txt), so they come before the build. npm ci installs
# exactly the lockfile; it runs again only when the lockfile changed since the last install.
if [[ -f web/package-lock.json ]]; then
  if [[ ! -f web/node_modules/.package-lock.json ]] ||
     [[ web/package-lock.json -nt web/node_modules/.package-lock.json ]]; then
    echo "setup: installing the chat page's npm packages"
    (cd web && npm ci --no-audit --no-fund --loglevel=error)
  fi
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
