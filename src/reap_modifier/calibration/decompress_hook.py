"""compressed-tensors' decompress-on-first-forward hook: run it now, or pause it.

``from_pretrained`` of a compressed checkpoint registers a pre-hook on the top module that
decompresses *every* compressed module on the model's first forward
(``ModelCompressor.add_decompress_hook``)."""

from __future__ import annotations

from loguru import logger

__all__ = ["decompress_loaded_model", "pause_decompress_hook"]


def decompress_loaded_model(model) -> bool:
    """Decompress a model that ``from_pretrained`` left compressed; returns whether it did.

    Why: llm-compressor's sequential pipeline calls decoder-layer subgraphs directly, so
    the hook never fires and calibration meets packed weights (``'Linear' object has no
    attribute 'weight'``). Run that same hook now.
    """
    handle = getattr(model, "ct_decompress_hook", None)
    hook = model._forward_pre_hooks.get(handle.id) if handle is not None else None
    if hook is None:
        return False
    logger.info("REAP: decompressing the compressed-tensors model before calibration")
    hook(model, ())
    return True


def pause_decompress_hook(model):
    """Stop the hook of ``model`` from firing; returns a function that puts it back (a
    no-op when the model has none).

    Calibration on packed experts must keep them packed whichever pipeline runs (the basic
    pipeline calls the model itself); after calibration the hook is restored so later use
    of the model behaves as loaded.
    """
    handle = getattr(model, "ct_decompress_hook", None)
    if handle is None or handle.id not in model._forward_pre_hooks:
        return lambda: None
    hook = model._forward_pre_hooks.pop(handle.id)

    def resume() -> None:
        model._forward_pre_hooks[handle.id] = hook

    return resume
