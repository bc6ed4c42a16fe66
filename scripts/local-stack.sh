#!/usr/bin/env bash
# compose.yaml's stack without containers: redis, two simulated backends, two kvgate
# replicas sharing the Redis ledger, nginx in front. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
KVGATE_EXTRAS=test bash scripts/setup.sh
exec .venv/bin/kvgate local-stack "$@"
