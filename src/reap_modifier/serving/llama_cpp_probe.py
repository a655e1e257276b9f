"""llama.cpp logits probe: run by a Python that has llama-cpp-python, never imported by
reap-modifier.

``python llama_cpp_probe.py MODEL.gguf PROMPTS.json OUT.npz``

For each prompt (a list of token ids) the logits of every position, with an f32 KV cache,
one thread and no flash attention, saved as ``p0``, ``p1``, ... Only numpy and
llama-cpp-python are imported."""

from __future__ import annotations

import json
import sys

import numpy as np
from llama_cpp import Llama

GGML_TYPE_F32 = 0


def main() -> None:
    path, prompts_path, out = sys.argv[1:4]
    with open(prompts_path) as f:
        prompts = json.load(f)
    longest = max(len(p) for p in prompts)
    llm = Llama(
        model_path=path,
        n_ctx=max(64, longest),
        n_batch=max(64, longest),
        logits_all=True,
        n_threads=1,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
        flash_attn=False,
        verbose=False,
    )
    result = {}
    for i, ids in enumerate(prompts):
        llm.reset()
        llm.eval(ids)
        # a copy: ``scores`` is overwritten by the next prompt
        result[f"p{i}"] = np.array(llm.scores[: len(ids)], dtype=np.float32, copy=True)
    np.savez(out, **result)


if __name__ == "__main__":
    main()
