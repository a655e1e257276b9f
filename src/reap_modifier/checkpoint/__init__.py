"""Checkpoints on disk: the bit-exact rewriter (``reap prune``), ``reap verify``, the
pruning manifest, and the modifier's save path through the rewriter.

Stages of a rewrite, one module each: :mod:`.layout` reads a checkpoint's headers,
:mod:`.moe_blocks` finds its MoE blocks and classifies their tensors, :mod:`.quantization`
reads its quantization config; :mod:`.binding` maps a plan onto them; :mod:`.converter` is the
compressed-tensors ``Converter`` that applies it; :mod:`.byte_copy` streams kept byte
ranges; :mod:`.source_hashes` hashes the source alongside; :mod:`.upstream` holds the
workarounds for compressed-tensors' ``convert_checkpoint``; :mod:`.destination` claims
the output and makes it atomic; :mod:`.scores_cut` cuts a plan from a scores file against the
checkpoint; :mod:`.rewrite` is the entry point (``prepare_rewrite`` checks, ``RewriteJob.run``
writes).
(:mod:`reap_modifier.pause_points` is the test hook that stops a rewrite at a named point.)

The names below are imported on first use (PEP 562), so that importing one module of the
package (the GGUF tools use :mod:`.destination`) does not import compressed-tensors.
"""

from __future__ import annotations

from ..lazy_names import lazy_names

#: public name -> the module of this package that defines it
_EXPORTS = {
    "bind_plan": "binding",
    "build_plan_from_scores": "scores_cut",
    "check_destination": "destination",
    "check_packed_scales": "quantization",
    "CheckpointError": "errors",
    "CheckpointLayout": "layout",
    "COUNT_KEY_CONTAINERS": "layout",
    "default_hash_cache": "source_hashes",
    "DEFAULT_METHOD": "rewrite",
    "default_output_checksum": "byte_copy",
    "DestinationClaim": "destination",
    "DestinationError": "errors",
    "ExpertPlanPruner": "converter",
    "ExpertRemap": "binding",
    "find_count_keys": "layout",
    "inspect_checkpoint": "layout",
    "inspect_source": "rewrite",
    "MoEBlock": "moe_blocks",
    "new_hasher": "byte_copy",
    "prepare_rewrite": "rewrite",
    "read_safetensors_header": "safetensors_header",
    "renumber_module_names": "binding",
    "resolve_block": "binding",
    "rewrite_checkpoint": "rewrite",
    "RewriteJob": "rewrite",
    "RewriteSpec": "binding",
    "ScoresCut": "scores_cut",
    "ShardHeader": "safetensors_header",
    "SourceHasher": "source_hashes",
    "TensorEntry": "safetensors_header",
    "work_dir_kind": "destination",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_names(__name__, _EXPORTS, __all__)
