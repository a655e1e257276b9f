"""Workarounds for upstream gaps (llm-compressor 0.14.0.1, transformers 5.17), all in this
package, each saying why in its docstring; one module per area:

- :mod:`.saving`: expert counts in the saved ``config.json``, linearized experts repacked
  for saving, the GPT-OSS repack inverse;
- :mod:`.loading`: Kimi K3 auto classes, broken lazy transformers aliases, the
  decompress-on-first-forward hook, ``oneshot(model=<path>)`` loading packed;
- :mod:`.data_parallel`: the same dataset on every rank;
- :mod:`.sequential`: the sequential pipeline's batches (padding) and attention mask.

Applied once, idempotently, by :func:`install` (called when the modifier module is
imported). Two of them fix llm-compressor for every ``oneshot`` in the process, not only
REAP's: data-parallel partitioning of a dataset every rank passed, and the sequential
pipeline's attention mask. The rest change nothing for models this package does not
prune. (Workarounds for compressed-tensors' checkpoint conversion live beside the
rewriter, in :mod:`reap_modifier.checkpoint.upstream`.)
"""

from __future__ import annotations

from loguru import logger

from .data_parallel import RankShareSampler, patch_rank_partition
from .loading import (
    decompress_loaded_model,
    drop_broken_lazy_aliases,
    load_checkpoint_model,
    load_packed_model,
    patch_oneshot_packed_load,
    pause_decompress_hook,
    recipe_keeps_experts_packed,
    register_kimi_auto_classes,
)
from .saving import (
    fix_saved_expert_counts,
    patch_gpt_oss_repack,
    patch_resave_config,
    repack_linearized_experts,
)
from .sequential import (
    add_calibration_batch_listener,
    patch_calibration_cache,
    patch_traced_config_attention,
    rebuild_traced_config,
    remove_calibration_batch_listener,
)

__all__ = [
    "RankShareSampler",
    "add_calibration_batch_listener",
    "decompress_loaded_model",
    "fix_saved_expert_counts",
    "install",
    "load_checkpoint_model",
    "load_packed_model",
    "pause_decompress_hook",
    "rebuild_traced_config",
    "recipe_keeps_experts_packed",
    "register_kimi_auto_classes",
    "remove_calibration_batch_listener",
    "repack_linearized_experts",
]

_INSTALLED = False


def install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    patch_resave_config()
    patch_gpt_oss_repack()
    patch_rank_partition()
    patch_calibration_cache()
    patch_traced_config_attention()
    patch_oneshot_packed_load()
    drop_broken_lazy_aliases()
    try:
        register_kimi_auto_classes()
    except Exception as exc:  # noqa: BLE001 - K3 support is optional at import
        logger.debug(f"REAP: Kimi K3 auto-class registration skipped: {exc}")
    _INSTALLED = True
