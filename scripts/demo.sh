#!/usr/bin/env bash
# The main job: kvgate in front of two simulated GPU backends, bundled tokenizer, no services.
set -euo pipefail
cd "$(dirname "$0")/.."
KVGATE_EXTRAS=test KVGATE_NEED_REDIS=0 bash scripts/setup.sh
exec .venv/bin/kvgate demo "$@"
