"""A saved model's ``config.json`` carries the model's current expert counts, under every
alias it holds, and the router's scoring function where converters need it spelled out."""

from __future__ import annotations

import json
import os

from loguru import logger

from ..fileio import write_json_atomic
from ..models.config_keys import COUNT_KEYS
from ..models.moe_fields import config_sections

__all__ = ["SCORING_FUNC_DEFAULTS", "fix_saved_expert_counts", "spell_out_scoring_func"]

#: model types whose transformers config states no scoring function although the model
#: routes by it (transformers' DeepSeek-V3 always uses sigmoid + ``e_score_correction_bias``)
SCORING_FUNC_DEFAULTS = {"deepseek_v3": "sigmoid"}
SCORING_FUNC_KEY = "scoring_func"


def _live_count(section) -> int | None:
    """The live routed-expert count of a config section (a dict of ``to_dict()``)."""
    return next((section[k] for k in COUNT_KEYS if isinstance(section.get(k), int)), None)


def fix_saved_expert_counts(config, save_dir: str) -> None:
    """Make ``save_dir/config.json`` carry the model's current expert count: every count
    key that is present (top level and nested text configs), under whichever alias, is set
    to the live ``config``'s count. Run after upstream's ``resave_config``
    (:func:`reap_modifier.compat.saving.patch_resave_config` says why).

    Why every alias: transformers 5.17 saves Qwen3-MoE's count as ``num_local_experts``
    (its ``attribute_map`` alias) while an original config holds ``num_experts``;
    llama.cpp's converter reads ``num_local_experts`` first and transformers another, so a
    stale alias makes one of them wrong.
    """
    path = os.path.join(save_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    live_sections = dict(config_sections(config.to_dict()))
    changed = False
    for name, section_saved in config_sections(saved):
        section_live = live_sections.get(name)
        if not isinstance(section_live, dict):
            continue
        count = _live_count(section_live)
        for key in COUNT_KEYS:
            live = section_live.get(key, count)
            if key in section_saved and live is not None and section_saved[key] != live:
                section_saved[key] = live
                changed = True
    if changed:
        write_json_atomic(path, saved, indent=2, sort_keys=True)
        logger.info(f"REAP: patched expert counts in {path} (upstream resave_config gap)")


def spell_out_scoring_func(config, save_dir: str) -> None:
    """Write ``scoring_func`` into ``save_dir/config.json`` for the model types of
    :data:`SCORING_FUNC_DEFAULTS` whose saved config lacks it.

    Why: llama.cpp's ``convert_hf_to_gguf.py`` reads the router's gating function from
    ``scoring_func``; without it a DeepSeek-V3 GGUF routes by softmax and its logits are far
    from the model's. transformers ignores the key.
    """
    path = os.path.join(save_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    changed = False
    for _, section in config_sections(saved):
        default = SCORING_FUNC_DEFAULTS.get(section.get("model_type"))
        if default is not None and SCORING_FUNC_KEY not in section:
            section[SCORING_FUNC_KEY] = default
            changed = True
    if changed:
        write_json_atomic(path, saved, indent=2, sort_keys=True)
        logger.info(f"REAP: wrote scoring_func into {path} (llama.cpp's converter needs it)")
