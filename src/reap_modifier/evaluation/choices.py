"""The backends and compute dtypes an evaluation accepts (``reap eval --backend / --dtype``).
No torch: the CLI declares its options with them."""

from __future__ import annotations

__all__ = ["BACKENDS", "DTYPES"]

BACKENDS = ("transformers", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")
