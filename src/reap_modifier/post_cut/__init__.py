"""The post-cut step: after REAP's cut, a block-error selection and the router, bias and
dense fits, each kept only where it lowers the whole model's KL on held-out calibration
batches (stages in order: :mod:`.step`).

This ``__init__`` is the only door the modifier uses. Inside, by room:

- the step: ``step`` (the stages, in order), ``settings`` (the recipe-field-to-stage
  table), ``rules`` (refusals before any model work), ``components`` (one record per
  fitted component), ``validation`` (the held-out check), ``ranks`` (data parallel);
- the algorithms, tensors in and tensors and a record out: ``block_selection``,
  ``router_fit``, ``bias_fit``, ``compensation``;
- what they share: ``block_fit`` (the fitting engine), ``dispatch`` (the per-kind swaps of
  a block's routed dispatch), ``routing`` (the one routing rule), ``errors``.
"""

from __future__ import annotations

from .errors import (
    BiasFitError,
    BlockSelectionError,
    CompensationError,
    PostCutError,
    RouterFitError,
)
from .rules import check_post_cut_request
from .settings import COMPONENTS, HOLDOUT_EVERY_BATCH, PostCutSettings, asks_post_cut, stage_fields
from .step import PostCutStep

__all__ = [
    "COMPONENTS",
    "HOLDOUT_EVERY_BATCH",
    "BiasFitError",
    "BlockSelectionError",
    "CompensationError",
    "PostCutError",
    "PostCutSettings",
    "PostCutStep",
    "RouterFitError",
    "asks_post_cut",
    "check_post_cut_request",
    "stage_fields",
]
