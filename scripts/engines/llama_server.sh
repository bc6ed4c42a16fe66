#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the llama.cpp sources that the llama-cpp-python
# sdist on PyPI vendors, and prints the binary's path on stdout (everything else goes to
# stderr). Cached by version outside the repo, so a second run, or a fresh clone, only
# prints the path:
#   ${KVGATE_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-engines}/llama.cpp/<version>/bin/llama-server
# The gguf-py package from the same sources is kept beside it (…/<version>/gguf-py) for
# scripts/engines/tiny_qwen3_gguf.py.
#
# Needs: a Python with pip (PYTHON, default: the repo's .venv, else python3), cmake and a
# C++ compiler (installed with apt-get when missing). Fails loudly when it cannot build.
set -euo pipefail

VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${KVGATE_ENGINES_JOBS:-2}
repo=$(cd "$(dirname "$0")/../.." && pwd)
cache=${KVGATE_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-engines}
dest="$cache/llama.cpp/$VERSION"
bin="$dest/bin/llama-server"

log() { echo "llama_server.sh: $*" >&2; }

if [ -x "$bin" ] && [ -f "$dest/.complete" ]; then
  echo "$bin"
  exit 0
fi

if [ -z "${PYTHON:-}" ]; then
  if [ -x "$repo/.venv/bin/python" ]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
need=()
command -v cmake >/dev/null 2>&1 || need+=(cmake)
{ command -v c++ >/dev/null 2>&1 && command -v make >/dev/null 2>&1; } || need+=(build-essential)
if [ ${#need[@]} -gt 0 ]; then
  command -v apt-get >/dev/null 2>&1 || { log "please install: ${need[*]}"; exit 1; }
  log "installing ${need[*]}"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

mkdir -p "$cache/llama.cpp"
# One build at a time per cache; a second caller waits for the first and reuses it.
exec 9>"$cache/llama.cpp/.lock"
flock 9
if [ -x "$bin" ] && [ -f "$dest/.complete" ]; then
  echo "$bin"
  exit 0
fi

work=$(mktemp -d "$cache/llama.cpp/.build-$VERSION.XXXXXX")
trap 'rm -rf "$work"' EXIT
started=$(date +%s)

log "fetching the llama-cpp-python $VERSION sdist"
"$PYTHON" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$work/dl" >&2
tar -xzf "$work"/dl/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
[ -f "$src/CMakeLists.txt" ] || { log "no vendored llama.cpp in the sdist"; exit 1; }

log "configuring (cmake)"
# No web UI (prebuilt or built), no OpenSSL, no tests/examples; portable CPU code so the
# cached binary runs on any x86-64 machine of the same kind; one static binary.
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_CCACHE=OFF \
  -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
  >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log" >&2; log "cmake configure failed"; exit 1; }

log "building llama-server with -j$JOBS (about 10 minutes on 2 cores)"
cmake --build "$work/build" --target llama-server -j "$JOBS" >"$work/build.log" 2>&1 \
  || { tail -n 60 "$work/build.log" >&2; log "build failed"; exit 1; }

rm -rf "$dest.tmp"
mkdir -p "$dest.tmp/bin"
cp "$work/build/bin/llama-server" "$dest.tmp/bin/"
cp -r "$src/gguf-py" "$dest.tmp/gguf-py"
"$dest.tmp/bin/llama-server" --version >"$dest.tmp/version.txt" 2>&1 \
  || { cat "$dest.tmp/version.txt" >&2; log "the built llama-server does not run"; exit 1; }
rm -rf "$dest"
mv "$dest.tmp" "$dest"
touch "$dest/.complete"
log "built in $(( $(date +%s) - started ))s: $(grep -m1 version "$dest/version.txt" || true)"
echo "$bin"
