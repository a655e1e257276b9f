"""Offset norms (``output * (1 + weight)``: Gemma, Qwen3-Next, Qwen3.5) around calibration.

Why: ``oneshot`` in llm-compressor 0.14.0.1 swaps every offset norm for a standard one
while calibrating (``weight + 1``) and writes ``weight - 1`` back afterwards, which in
float32 moves some weights by one ulp although no modifier changed them: a REAP-pruned
checkpoint of those families then differs from its source outside the MoE blocks. A
norm whose standard weight is unchanged when restored gets its original tensor back,
bit for bit; one a modifier changed (smoothing) is restored as upstream does.
"""

from __future__ import annotations

__all__ = ["patch_offset_norm_restore"]


def patch_offset_norm_restore() -> None:
    from llmcompressor.modeling.offset_norm import CalibrationOffsetNorm

    original_init = CalibrationOffsetNorm.__init__
    if getattr(original_init, "_reap_patched", False):
        return
    original_restore = CalibrationOffsetNorm.restore

    def __init__(self, original, config):
        original_init(self, original, config)
        # plain attributes (not buffers): never saved, never moved by offloading
        self.__dict__["_reap_source"] = (original.weight.data.clone(), self.weight.data.clone())

    def restore(self, original):
        source, standard = self.__dict__.get("_reap_source", (None, None))
        weight = self.weight.data
        if source is not None and weight.shape == standard.shape and weight.equal(standard):
            original.weight.data = source.to(weight.device)
            return original
        return original_restore(self, original)

    __init__._reap_patched = True
    CalibrationOffsetNorm.__init__ = __init__
    CalibrationOffsetNorm.restore = restore
