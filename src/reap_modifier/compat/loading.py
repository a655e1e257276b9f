"""Loading workarounds: transformers' broken lazy aliases, and ``oneshot(model=<path>)``
loading a REAP-only recipe's model with its experts packed (the rule for when lives in
the core, :class:`reap_modifier.registries.PackedLoadRule`)."""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import sys

from loguru import logger

from ..registries import PackedLoadRule, packed_load_rule

__all__ = [
    "drop_broken_lazy_aliases",
    "load_packed_model",
    "patch_oneshot_packed_load",
]


def drop_broken_lazy_aliases(resolve: bool = False) -> None:
    """Why: with transformers 5.17 and no torchvision, walking ``sys.modules`` (as
    llm-compressor's ``load_context`` / ``load_quantizable_moe`` do) touches lazy
    alias modules whose import fails. Dropping the unimportable ones avoids the crash.

    :param resolve: also ``dir()`` every alias module (transformers' legacy-path
        aliases resolve their target on ``dir``), as transformers' ``apply_patches``
        does when ``load_quantizable_moe`` registers a class patch; costs the imports
        that walk would make anyway
    """
    for name, module in list(sys.modules.items()):
        if not name.startswith("transformers") or module is None:
            continue
        try:
            _ = module.__dict__  # a lazy alias module raises here when unusable
            if resolve and "__dir__" in module.__dict__:
                dir(module)
        except Exception:  # noqa: BLE001 - any failure means unusable alias
            sys.modules.pop(name, None)


#: the rule, while ``Oneshot.__init__`` runs a recipe that calibrates on packed experts
_PACKED_LOAD: contextvars.ContextVar[PackedLoadRule | None] = contextvars.ContextVar(
    "reap_packed_load", default=None
)


@contextlib.contextmanager
def _restore_conversion_mappings():
    """Why: llm-compressor's ``load_quantizable_moe`` registers its linearized (2-D)
    conversion mapping for the model type *globally* and leaves it there, so every later
    ``from_pretrained`` of that model type in the process would load a fused-expert
    checkpoint with the wrong mapping. Put the registry back after our load (the loaded
    model keeps its own save mapping in ``_weight_conversions``)."""
    from transformers import conversion_mapping as cm

    cm.get_checkpoint_conversion_mapping("llama")  # builds the cache if needed
    saved = dict(cm._checkpoint_conversion_mapping_cache)
    user = set(cm.USER_REGISTERED_MAPPINGS)
    try:
        yield
    finally:
        cm._checkpoint_conversion_mapping_cache.clear()
        cm._checkpoint_conversion_mapping_cache.update(saved)
        cm.USER_REGISTERED_MAPPINGS.clear()
        cm.USER_REGISTERED_MAPPINGS.update(user)


def load_packed_model(model_args, original_load, rule: PackedLoadRule):
    """Run llm-compressor's ``initialize_model_from_path`` keeping compressed modules
    packed: no ``dequantize=True``, and per-expert (2-D) checkpoints loaded linearized
    through ``load_quantizable_moe`` so their experts stay per-expert ``Linear`` modules
    (transformers would otherwise dequantize them while fusing them into 3-D experts).
    """
    from compressed_tensors.utils import patch_attr
    from llmcompressor.entrypoints import utils as entry_utils
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    path = str(model_args.model)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            rule.check_config(json.load(f))

    def keep_packed(**kwargs):
        kwargs["dequantize"] = False
        return CompressedTensorsConfig(**kwargs)

    drop_broken_lazy_aliases(resolve=True)
    logger.info(
        f"REAP: loading {path} with its compressed modules packed (the recipe only runs "
        "REAP, which dequantizes one MoE layer at a time)"
    )
    with (
        _restore_conversion_mappings(),
        patch_attr(entry_utils, "CompressedTensorsConfig", keep_packed),
        load_quantizable_moe(AutoModelForCausalLM),
    ):
        return original_load(model_args)


def patch_oneshot_packed_load() -> None:
    """Why: ``oneshot(model=<path>)`` loads every compressed-tensors checkpoint with
    ``CompressedTensorsConfig(dequantize=True)`` (``initialize_model_from_path``), i.e.
    fully dense, before any modifier exists. When the registered rule says the recipe only
    runs REAP, load it packed instead; any other recipe gets upstream's load unchanged."""
    import importlib

    from llmcompressor.entrypoints import utils as entry_utils
    from llmcompressor.transformers.utils.helpers import is_model_ct_quantized_from_path

    # the package re-exports the *function* ``oneshot`` under the submodule's name
    cls = importlib.import_module("llmcompressor.entrypoints.oneshot").Oneshot
    if getattr(cls.__init__, "_reap_patched", False):
        return
    original_init = cls.__init__
    original_load = entry_utils.initialize_model_from_path

    def __init__(self, log_dir=None, **kwargs):
        rule = packed_load_rule()
        token = _PACKED_LOAD.set(rule if rule and rule.keeps_packed(kwargs.get("recipe")) else None)
        try:
            original_init(self, log_dir=log_dir, **kwargs)
        finally:
            _PACKED_LOAD.reset(token)

    def initialize_model_from_path(model_args):
        rule = _PACKED_LOAD.get()
        if rule is not None and is_model_ct_quantized_from_path(model_args.model):
            return load_packed_model(model_args, original_load, rule)
        return original_load(model_args)

    __init__._reap_patched = True
    cls.__init__ = __init__
    entry_utils.initialize_model_from_path = initialize_model_from_path
