"""Where a model's MoE layers live: adapters per dispatch shape, architecture discovery
and the MoE config keys.

The names are imported on first use (PEP 562): the plain-config modules
(:mod:`.config_keys`, :mod:`.moe_fields`, :mod:`.tensor_names`) need no torch. The
adapters register when :mod:`.architecture` (the one user of the registry) is imported.
"""

from __future__ import annotations

from ..lazy_names import lazy_names

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

__all__ = sorted(_LAZY)


# the registry (``base``) is handed out with the built-in adapters in it
__getattr__, __dir__ = lazy_names(__name__, _LAZY, __all__, first={"base": "architecture"})
