"""A saved model's ``config.json`` carries the model's current expert counts."""

from __future__ import annotations

import json
import os

from loguru import logger

from ..fileio import write_json_atomic
from ..models.config_keys import COUNT_KEYS
from ..models.moe_fields import config_sections

__all__ = ["fix_saved_expert_counts"]


def fix_saved_expert_counts(config, save_dir: str) -> None:
    """Make ``save_dir/config.json`` carry the model's current expert count: every count
    key that is present (top level and nested text configs) is taken from the live
    ``config``. Run after upstream's ``resave_config``
    (:func:`reap_modifier.compat.saving.patch_resave_config` says why).
    """
    path = os.path.join(save_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    live = config.to_dict()
    changed = False
    live_sections = dict(config_sections(live))
    for name, section_saved in config_sections(saved):
        section_live = live_sections.get(name)
        if not isinstance(section_live, dict):
            continue
        for key in COUNT_KEYS:
            if key in section_saved and key in section_live:
                if section_saved[key] != section_live[key]:
                    section_saved[key] = section_live[key]
                    changed = True
    if changed:
        write_json_atomic(path, saved, indent=2, sort_keys=True)
        logger.info(f"REAP: patched expert counts in {path} (upstream resave_config gap)")
