#!/usr/bin/env bash
# Put llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, its conversion/ package and
# its gguf-py) into ./build/llama-cpp/converter (or $REAP_GGUF_CONVERTER), extracted from the
# llama-cpp-python sdist on PyPI, which vendors llama.cpp. Only the GGUF tests use it: they
# compare `reap prune SRC.gguf` with converting the pruned safetensors. Nothing is built.
# Idempotent: a second run only checks the stamp (~0 s); the first downloads 77 MB (~30 s).
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
DIR=${REAP_GGUF_CONVERTER:-build/llama-cpp/converter}
want="llama-cpp-python==$VERSION"
stamp="$DIR/.reap-converter"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -f "$DIR/convert_hf_to_gguf.py" ]; then
  exit 0
fi
cache=build/llama-cpp/sdist
mkdir -p "$cache"
tarball="$cache/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$tarball" ]; then
  .venv/bin/pip download -q --no-deps --no-binary :all: "$want" -d "$cache"
fi
rm -rf "$DIR"
mkdir -p "$DIR"
top="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar xzf "$tarball" -C "$DIR" --strip-components=3 \
  "$top/convert_hf_to_gguf.py" "$top/conversion" "$top/gguf-py"
echo "$want" > "$stamp"
