"""Where a model's MoE layers live: adapters per dispatch shape, architecture discovery
and the MoE config keys."""

# register the adapters; the first match wins, so input-side gating (whose experts are
# also fused 3-D tensors) before the `experts(hidden, ids, weights)` shape
from . import input_gated, experts_call, kimi  # noqa: F401  # isort: skip
from .architecture import MoEArchitecture, MoELayer, NoMoEError, find_moe_architecture
from .base import MoEAdapter, register_adapter, registered_adapters
from .config_keys import COUNT_KEYS, text_config

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
