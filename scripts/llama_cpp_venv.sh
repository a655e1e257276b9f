#!/usr/bin/env bash
# Create ./.venv-llama-cpp (or $REAP_LLAMA_CPP_VENV): llama-cpp-python 0.3.36 built from its
# sdist for this CPU, in its own environment, for the optional llama.cpp checks
# (tests/test_gguf_llama_cpp.py). The build takes minutes (one core, low priority), so
# scripts/test.sh does not run it: the tests skip without it unless REAP_REQUIRE_LLAMA_CPP=1.
# Idempotent: a second run only checks the stamp and that `import llama_cpp` works.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${REAP_LLAMA_CPP_VENV:-.venv-llama-cpp}
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
want="llama-cpp-python==0.3.36"
stamp="$VENV/.reap-llama-cpp-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import llama_cpp" >/dev/null 2>&1; then
  exit 0
fi
echo "building llama-cpp-python into $VENV (minutes) ..." >&2
if [ -f "$VENV/pyvenv.cfg" ]; then rm -rf "$VENV"; fi
"$PY" -m venv "$VENV"
# portable CPU build, no server/tools/tests; one compile job at low priority (shared machines)
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}
nice -n 19 "$VENV/bin/python" -m pip install -q --no-binary llama-cpp-python "$want" numpy
"$VENV/bin/python" -c "import llama_cpp" >/dev/null
echo "$want" > "$stamp"
