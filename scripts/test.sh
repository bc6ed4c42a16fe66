#!/usr/bin/env bash
# The full check: lint, strict types, then every test. Installs what it needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
KVGATE_NEED_ENGINES=${KVGATE_NEED_ENGINES:-1} bash scripts/setup.sh
.venv/bin/ruff check proxy policies tests benchmarks
.venv/bin/mypy --strict proxy policies
.venv/bin/python -m pytest "$@"
