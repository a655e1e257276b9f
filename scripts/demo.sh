#!/usr/bin/env bash
# The main job: install what it needs, then run it on the bundled default model and data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python examples/quickstart_tiny_k3.py "$@"
