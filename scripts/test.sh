#!/usr/bin/env bash
# Install what the tests need, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
# vLLM in its own venv (./.venv-vllm; skipped when already installed): the vLLM tests
# drive it from this suite and fail, rather than skip, when it is missing
bash scripts/vllm_venv.sh
export REAP_VLLM_PYTHON="${REAP_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}" REAP_REQUIRE_VLLM=1
exec .venv/bin/python -m pytest -q "$@"
