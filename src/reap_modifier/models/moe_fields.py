"""The facts about a model's MoE, read from its config: the one reader of ``config.json``
and of a transformers config object for the expert count, top-k, groups and scaling.

A field is looked up at the top level first, then in the nested configs of multimodal
wrappers (:data:`NESTED_CONFIGS`), each key of a field in the order of
:mod:`reap_modifier.models.config_keys`. A config is a dict (``config.json``) or any
object with attributes (a transformers ``PretrainedConfig``); nothing here imports
transformers.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from .config_keys import (
    COUNT_KEYS,
    N_GROUP_KEYS,
    ROUTED_SCALING_KEYS,
    SHARED_COUNT_KEYS,
    TOP_K_KEYS,
    TOPK_GROUP_KEYS,
    group_limit,
)

__all__ = [
    "NESTED_CONFIGS",
    "MoEFields",
    "config_sections",
    "config_value",
    "moe_fields",
    "text_section",
]

#: nested configs searched after the top level (multimodal wrappers: K3, Llama-4, ...)
NESTED_CONFIGS = ("text_config", "language_config", "llm_config")


def _get(holder, key: str):
    if isinstance(holder, Mapping):
        return holder.get(key)
    return getattr(holder, key, None)


def config_sections(config) -> list[tuple[str, object]]:
    """``(name, section)`` for the top level (name ``""``) and each nested config present,
    in lookup order. Sections are dicts for a dict config, objects for an object."""
    out: list[tuple[str, object]] = [("", config)]
    for name in NESTED_CONFIGS:
        sub = _get(config, name)
        if sub is None or isinstance(sub, (str, int, float, bool, list)):
            continue
        if isinstance(config, Mapping) and not isinstance(sub, Mapping):
            continue
        out.append((name, sub))
    return out


def text_section(config):
    """The section holding the language model's fields: the first nested config present
    (a multimodal wrapper's text config), else the top level."""
    sections = config_sections(config)
    return sections[1][1] if len(sections) > 1 else config


def config_value(config, keys: Iterable[str]):
    """The first of ``keys`` set (not ``None``) in the first section holding one, else ``None``."""
    keys = tuple(keys)
    for _, section in config_sections(config):
        for key in keys:
            value = _get(section, key)
            if value is not None:
                return value
    return None


def _first_int(config, keys: Iterable[str]) -> tuple[str | None, str | None, int | None]:
    """``(section, key, value)`` of the first integer (not bool) of ``keys``."""
    keys = tuple(keys)
    for name, section in config_sections(config):
        for key in keys:
            value = _get(section, key)
            if isinstance(value, int) and not isinstance(value, bool):
                return name, key, int(value)
    return None, None, None


@dataclass(frozen=True)
class MoEFields:
    """A model's MoE facts from its config; a field the config lacks is ``None``."""

    #: routed experts per MoE layer (the first count key found)
    num_experts: int | None
    #: experts per token
    top_k: int | None
    #: expert groups, and how many groups each token's router picks (DeepSeek-V3, Kimi)
    n_group: int | None
    topk_group: int | None
    #: the factor routed experts' outputs are multiplied by
    routed_scaling_factor: float | None
    #: shared (always-on) experts
    n_shared_experts: int | None
    #: the key ``num_experts`` came from, and its nested config (``""``: the top level)
    count_key: str | None
    count_section: str | None
    #: every count key present -> its value, by dotted path (``text_config.num_experts``)
    count_keys: dict[str, int] = field(default_factory=dict)

    @property
    def group_limit(self) -> int | None:
        """Expert groups a cut must keep equally filled (:func:`config_keys.group_limit`)."""
        return group_limit(self.n_group, self.topk_group)

    @property
    def agreed_count(self) -> int | None:
        """The expert count when every count key agrees, else ``None``."""
        values = set(self.count_keys.values())
        return values.pop() if len(values) == 1 else None


def moe_fields(config) -> MoEFields:
    """The MoE facts of ``config`` (a ``config.json`` dict or a transformers config)."""
    count_keys: dict[str, int] = {}
    for name, section in config_sections(config):
        for key in COUNT_KEYS:
            value = _get(section, key)
            if isinstance(value, int) and not isinstance(value, bool):
                count_keys[f"{name}.{key}" if name else key] = value
    section, key, count = _first_int(config, COUNT_KEYS)
    scaling = config_value(config, ROUTED_SCALING_KEYS)
    return MoEFields(
        num_experts=count,
        top_k=_first_int(config, TOP_K_KEYS)[2],
        n_group=_first_int(config, N_GROUP_KEYS)[2],
        topk_group=_first_int(config, TOPK_GROUP_KEYS)[2],
        routed_scaling_factor=float(scaling) if isinstance(scaling, (int, float)) else None,
        n_shared_experts=_first_int(config, SHARED_COUNT_KEYS)[2],
        count_key=key,
        count_section=section,
        count_keys=count_keys,
    )
