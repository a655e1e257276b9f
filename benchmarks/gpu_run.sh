#!/usr/bin/env bash
# Run benchmarks/gpu_k3_layer.py on a machine with torch + transformers and no internet.
#
# Installs, from the wheels in $WHEELS (default build/gpu_wheels, made on a connected
# machine; see docs/upstream-compatibility.md), with --no-deps and no index:
# llm-compressor 0.14.0.1, compressed-tensors 0.19.0, this package, and the pure-Python
# (or per-Python-version) dependencies they import that a torch + transformers image may
# lack: loguru, pydantic (+ pydantic-core, annotated-types, typing-inspection,
# typing-extensions), accelerate, psutil, nvidia-ml-py. A module that already imports is
# left alone. `datasets` is not installed: the script stands in for it if missing.
#
#   bash benchmarks/gpu_run.sh [script options, e.g. --tokens 4096 --repeats 3]
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-build/gpu_wheels}
PY=${PYTHON:-python}

"$PY" -c "import sys, torch, transformers; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

install() {  # install <module to test> <wheel name glob>...
  local module=$1; shift
  if "$PY" -c "import $module" 2>/dev/null; then
    echo "have $module"
    return
  fi
  for glob in "$@"; do
    "$PY" -m pip install -q --no-index --no-deps --ignore-requires-python \
      --find-links "$WHEELS" "$glob"
  done
  echo "installed $module"
}

install typing_extensions typing_extensions
install annotated_types annotated-types
install typing_inspection typing-inspection
install pydantic_core pydantic-core
install pydantic pydantic
install loguru loguru
install psutil psutil
install pynvml nvidia-ml-py
install accelerate accelerate
# pinned versions of the stack itself, always from the folder
"$PY" -m pip install -q --no-index --no-deps --ignore-requires-python --force-reinstall \
  "$WHEELS"/compressed_tensors-0.19.0-*.whl "$WHEELS"/llmcompressor-0.14.0.1-*.whl \
  "$WHEELS"/reap_modifier-*.whl

"$PY" benchmarks/gpu_k3_layer.py --device cuda "$@"
