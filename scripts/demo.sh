#!/usr/bin/env bash
# The main job: install what it needs, build the corpora into data/ if missing, then
# calibrate, prune (bit-exact), verify and evaluate the bundled model -> out/demo/report.md
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m reap_modifier.demo "$@"
