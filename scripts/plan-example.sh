#!/usr/bin/env bash
# The worked example: a 70B model with 4-bit weights on one 80 GiB GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
KVGATE_EXTRAS=test KVGATE_NEED_REDIS=0 bash scripts/setup.sh
exec .venv/bin/kvgate plan --layers 80 --kv-heads 8 --head-dim 128 --kv-bits 16 \
  --params 70e9 --weight-bits 4 --usable-memory 80GiB \
  --tokens 8192 --concurrency 15 --overhead 0.12 "$@"
