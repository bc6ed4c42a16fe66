#!/usr/bin/env bash
# The real-engine stage: install what it needs (scripts/engines/setup.sh, cached outside
# the repo), then run its tests with the repo's .venv (scripts/setup.sh makes it; PYTHON
# to use another). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/../.."
bash scripts/engines/setup.sh
tests=(tests/test_real_llamacpp.py)
[[ ",${KVGATE_ENGINES:-llama.cpp,vllm}," == *",vllm,"* ]] && tests+=(tests/test_real_vllm.py tests/test_real_vllm_limits.py tests/test_real_vllm_sharing.py)
exec "${PYTHON:-.venv/bin/python}" -m pytest "${tests[@]}" "$@"
