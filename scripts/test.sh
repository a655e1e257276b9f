#!/usr/bin/env bash
# Install what the tests need, check lint, format and the import contracts, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# vLLM goes into its own venv (./.venv-vllm; skipped when already installed). It installs in
# the background while ./.venv is set up and the suite runs; the vLLM tests, which run last,
# wait for it and fail (rather than skip) when it is missing.
mkdir -p build
status="$PWD/build/vllm-venv.rc"
rm -f "$status"
( rc=0; bash scripts/vllm_venv.sh > build/vllm-venv.log 2>&1 || rc=$?; echo "$rc" > "$status" ) &
bash scripts/bootstrap.sh
# the corpora (Debian / PyPI / CPython, into the ignored data/; a no-op once built): the corpus
# checks and the model card's held-out losses run on them, and fail (rather than skip) without them
.venv/bin/python scripts/build_corpora.py
export REAP_REQUIRE_CORPORA=1
# llama.cpp's HF -> GGUF converter, extracted from the llama-cpp-python sdist (into the ignored
# build/; ~30 s once, a no-op after): the GGUF oracle tests fail (rather than skip) without it
bash scripts/llama_cpp_converter.sh
export REAP_REQUIRE_GGUF_CONVERTER=1
# the package map (pyproject.toml's import-linter contracts), lint and format, before any test
.venv/bin/lint-imports
.venv/bin/ruff check .
.venv/bin/ruff format --check .
export REAP_VLLM_PYTHON="${REAP_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}" REAP_REQUIRE_VLLM=1
export REAP_VLLM_INSTALL_STATUS="$status"
exec .venv/bin/python -m pytest -q "$@"
