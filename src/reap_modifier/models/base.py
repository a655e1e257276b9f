"""The adapter protocol: how one dispatch shape of MoE block is recognised.

Every MoE family this package prunes has a block with a router (``gate`` /
``router``, one weight row per routed expert) and an ``experts`` module. What differs
is how the block dispatches tokens to its experts, which decides how calibration
observes them (see :mod:`reap_modifier.calibration.observer`) and how surgery cuts
them (:mod:`reap_modifier.surgery`). An adapter is a small class registered
with :func:`register_adapter`; adding a dispatch shape is one new file in this
package (plus its observation hooks). Families that share a shape need nothing:
they are recognised by structure, not by class name.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

__all__ = ["MoEAdapter", "adapter_for", "register_adapter", "registered_adapters"]


class MoEAdapter:
    """Recognises MoE blocks of one dispatch shape.

    :cvar kind: the name observation, surgery and the post-cut stages dispatch on (a new
        kind also needs its row in ``post_cut/dispatch.py``, else the fits refuse it)
    :cvar families: the model families known to have this shape (for messages/docs)
    """

    kind: ClassVar[str]
    families: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def matches(cls, block: nn.Module, experts: nn.Module, router: nn.Module) -> bool:
        """Whether ``block`` (with these experts and router) has this dispatch shape."""
        raise NotImplementedError


_ADAPTERS: list[type[MoEAdapter]] = []


def register_adapter(cls: type[MoEAdapter]) -> type[MoEAdapter]:
    """Class decorator: make ``cls`` one of the shapes :func:`adapter_for` tries, in
    registration order (the first match wins)."""
    if cls not in _ADAPTERS:
        _ADAPTERS.append(cls)
    return cls


def registered_adapters() -> tuple[type[MoEAdapter], ...]:
    return tuple(_ADAPTERS)


def adapter_for(block: nn.Module, experts: nn.Module, router: nn.Module) -> type[MoEAdapter] | None:
    """The first registered adapter whose shape ``block`` has, else ``None``."""
    for adapter in _ADAPTERS:
        if adapter.matches(block, experts, router):
            return adapter
    return None
