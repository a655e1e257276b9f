"""Workarounds for upstream gaps (llm-compressor 0.14.0.1, transformers 5.17), each saying
why in its docstring; one module per area:

- :mod:`.saving`: expert counts in the saved ``config.json``, linearized experts repacked
  for saving, the GPT-OSS repack inverse, the Llama-4 repack;
- :mod:`.loading`: broken lazy transformers aliases, ``oneshot(model=<path>)`` loading
  packed;
- :mod:`.linear_experts`: post-load linearized experts built from the fused module's
  own intermediate size and constants;
- :mod:`.offset_norm`: offset norms restored bit-exactly after calibration when no
  modifier changed them;
- :mod:`.data_parallel`: the same dataset on every rank;
- :mod:`.sequential`: the sequential pipeline's batches (padding), attention mask and
  traced subgraphs.

This package is a leaf: it imports nothing of ours but :mod:`reap_modifier.registries`,
where the core registers what it needs and the patches publish to, and (the Llama-4 repack)
the config reader :mod:`reap_modifier.models.moe_fields`; each patch can be
deleted on its own once upstream fixes its gap. Applied once, idempotently, by
:func:`install` (called when the modifier module is imported). Two of them fix
llm-compressor for every ``oneshot`` in the process, not only REAP's: data-parallel
partitioning of a dataset every rank passed, and the sequential pipeline's attention mask.
The rest change nothing for models this package does not prune.

Patches outside this package (``docs/upstream-gaps.md`` lists them all):
:mod:`reap_modifier.checkpoint.upstream` (compressed-tensors' checkpoint conversion),
:mod:`reap_modifier.checkpoint.compressed_save` (a REAP-pruned model's
``save_pretrained``, routed through the rewriter), and
:mod:`reap_modifier.serving.vllm_load_probe` (vLLM, load check only).
"""

from __future__ import annotations

from ..registries import add_save_fixup
from .data_parallel import RankShareSampler, patch_rank_partition
from .linear_experts import patch_linear_experts_from_source
from .loading import drop_broken_lazy_aliases, load_packed_model, patch_oneshot_packed_load
from .offset_norm import patch_offset_norm_restore
from .saving import (
    patch_gpt_oss_repack,
    patch_llama4_repack,
    patch_resave_config,
    repack_linearized_experts,
)
from .sequential import (
    patch_calibration_cache,
    patch_traced_config_attention,
    patch_traced_subgraphs,
    rebuild_traced_config,
)

__all__ = [
    "RankShareSampler",
    "install",
    "load_packed_model",
    "rebuild_traced_config",
    "repack_linearized_experts",
]

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    patch_resave_config()
    patch_gpt_oss_repack()
    patch_llama4_repack()
    patch_rank_partition()
    patch_calibration_cache()
    patch_traced_config_attention()
    patch_traced_subgraphs()
    patch_linear_experts_from_source()
    patch_offset_norm_restore()
    patch_oneshot_packed_load()
    drop_broken_lazy_aliases()
    add_save_fixup(repack_linearized_experts)
    _INSTALLED = True
