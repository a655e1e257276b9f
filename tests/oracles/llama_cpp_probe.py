"""Logits of a GGUF model in llama.cpp, for the llama.cpp oracle tests: a standalone script
run by the Python that has llama-cpp-python (``scripts/llama_cpp_venv.sh``), never by the
test process.

    python llama_cpp_probe.py MODEL.gguf '[token ids]' OUT.npy

One sequence, every position's logits (float32 ``[tokens, vocab]``), f32 KV cache, one
thread, no flash attention."""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import Llama

GGML_TYPE_F32 = 0


def main() -> None:
    path, ids_json, out = sys.argv[1:4]
    ids = json.loads(ids_json)
    llm = Llama(
        model_path=path,
        n_ctx=max(64, len(ids)),
        n_batch=max(64, len(ids)),
        logits_all=True,
        n_threads=1,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    llm.eval(ids)
    np.save(out, np.asarray(llm.scores[: len(ids)], dtype=np.float32))


if __name__ == "__main__":
    main()
