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
"""

from .binding import (
    ExpertRemap,
    RewriteSpec,
    bind_plan,
    renumber_module_names,
    resolve_block,
)
from .byte_copy import default_output_checksum, new_hasher
from .converter import ExpertPlanPruner
from .destination import DestinationClaim, check_destination, work_dir_kind
from .errors import CheckpointError, DestinationError
from .layout import COUNT_KEY_CONTAINERS, CheckpointLayout, find_count_keys, inspect_checkpoint
from .moe_blocks import MoEBlock
from .quantization import check_packed_scales
from .rewrite import (
    DEFAULT_METHOD,
    RewriteJob,
    inspect_source,
    prepare_rewrite,
    rewrite_checkpoint,
)
from .safetensors_header import ShardHeader, TensorEntry, read_safetensors_header
from .scores_cut import ScoresCut, build_plan_from_scores
from .source_hashes import SourceHasher, default_hash_cache

__all__ = [
    "COUNT_KEY_CONTAINERS",
    "CheckpointError",
    "CheckpointLayout",
    "DEFAULT_METHOD",
    "DestinationClaim",
    "DestinationError",
    "ExpertPlanPruner",
    "ExpertRemap",
    "MoEBlock",
    "RewriteJob",
    "RewriteSpec",
    "ScoresCut",
    "ShardHeader",
    "SourceHasher",
    "TensorEntry",
    "bind_plan",
    "build_plan_from_scores",
    "check_destination",
    "check_packed_scales",
    "default_hash_cache",
    "default_output_checksum",
    "find_count_keys",
    "inspect_checkpoint",
    "inspect_source",
    "new_hasher",
    "prepare_rewrite",
    "read_safetensors_header",
    "renumber_module_names",
    "resolve_block",
    "rewrite_checkpoint",
    "work_dir_kind",
]
