"""Serving checks: does vLLM load and serve a pruned checkpoint as transformers reads it?

- :mod:`.vllm_check`: the check (``reap verify --vllm``), run from reap-modifier's
  environment against a separate Python that has vLLM;
- :mod:`.server`: vLLM's OpenAI server started, queried and stopped by pid on 127.0.0.1;
- :mod:`.reference`: transformers' greedy tokens on the same checkpoint;
- :mod:`.vllm_dtype`: the dtype vLLM can serve a model in (bfloat16 only for MLA models on
  vLLM's CPU backend on an AMX CPU), for the check and the vLLM eval backend;
- :mod:`.vllm_load_probe`: a standalone script run *by the vLLM Python* (weight loading
  only, every tensor placed), never imported here.
"""

from .vllm_check import (
    INSTALL_HINT,
    VllmCheckReport,
    VllmNotFound,
    check_with_vllm,
    find_vllm_python,
)

__all__ = ["INSTALL_HINT", "VllmCheckReport", "VllmNotFound", "check_with_vllm", "find_vllm_python"]
