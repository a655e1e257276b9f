"""GGUF models (llama.cpp's format) pruned in place of safetensors: the same plan, each kept
expert's slab copied verbatim, byte-identical to converting the pruned safetensors.

- :mod:`.layout`: the parts, fields and tensors of a GGUF file (headers only);
- :mod:`.binding`: a plan bound to the file's layers and tensors, every refusal;
- :mod:`.scores_cut`: a plan cut from a scores file against the file;
- :mod:`.provenance`: the keys that change and the ``reap.*`` keys written;
- :mod:`.writer`: the streaming writer (kernel copies of byte ranges);
- :mod:`.imatrix`: an importance matrix sliced like its model;
- :mod:`.routers`: router rows of a GGUF for the calibration-free baselines;
- :mod:`.rewrite`: ``prepare_gguf_rewrite`` checks once, ``GGUFRewriteJob.run`` writes;
- :mod:`.verify`: a pruned file against its source, slab by slab;
- :mod:`.export`: HF -> GGUF with llama.cpp's converter, run with :mod:`.mxfp4_repack` (MXFP4
  compressed-tensors experts repacked bit for bit).
"""

from __future__ import annotations

from .errors import GGUFError
from .layout import inspect_gguf, is_gguf
from .rewrite import GGUFRewriteJob, prepare_gguf_rewrite

__all__ = ["GGUFError", "GGUFRewriteJob", "inspect_gguf", "is_gguf", "prepare_gguf_rewrite"]
