"""Where a model's MoE layers live: adapters per dispatch shape, architecture discovery
and the MoE config keys.

The names are imported on first use (PEP 562): the plain-config modules
(:mod:`.config_keys`, :mod:`.moe_fields`, :mod:`.tensor_names`) need no torch. The
adapters register when :mod:`.architecture` (the one user of the registry) is imported.
"""

from __future__ import annotations

import importlib

__all__ = [
    "COUNT_KEYS",
    "MoEAdapter",
    "MoEArchitecture",
    "MoELayer",
    "NoMoEError",
    "find_moe_architecture",
    "register_adapter",
    "registered_adapters",
    "text_config",
]

#: public name -> the module that defines it, imported on first use
_LAZY = {
    "COUNT_KEYS": "config_keys",
    "MoEAdapter": "base",
    "MoEArchitecture": "architecture",
    "MoELayer": "architecture",
    "NoMoEError": "architecture",
    "find_moe_architecture": "architecture",
    "register_adapter": "base",
    "registered_adapters": "base",
    "text_config": "config_keys",
}


def __getattr__(name: str):
    if name in _LAZY:
        if _LAZY[name] == "base":  # the registry: with the built-in adapters in it
            importlib.import_module(f"{__name__}.architecture")
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
