#!/usr/bin/env bash
# Create ./.venv (Python 3.11) and install reap-modifier with its pinned stack.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.reap-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  # the CPU wheel of torch 2.13.0 (a plain `torch` requirement would pull a CUDA build)
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test,eval]"
  touch "$stamp"
fi
