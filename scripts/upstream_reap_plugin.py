"""pytest plugin: llm-compressor's own REAP tests, run against reap-modifier's modifier.

Loaded with ``-p upstream_reap_plugin`` by ``scripts/upstream_reap_tests.py``. Before
any test module is imported, the name ``REAPPruningModifier`` in llm-compressor's
packages (``llmcompressor.modifiers.pruning``, ``...pruning.reap``,
``...pruning.reap.base``) is rebound to :class:`reap_modifier.REAPPruningModifier`, so
upstream's ``from llmcompressor.modifiers.pruning.reap import REAPPruningModifier``
gets ours; importing ``reap_modifier`` also registers it with ``ModifierFactory``, so a
recipe or ``ModifierFactory.create("REAPPruningModifier")`` gets ours too. Upstream's
helper functions (``REAPSaliencyTracker``, ``get_moe_attrs``, ``prune_moe_layer``,
``update_model_config``) stay upstream's: their tests exercise upstream code.
"""

from __future__ import annotations

import importlib

_UPSTREAM_MODULES = (
    "llmcompressor.modifiers.pruning",
    "llmcompressor.modifiers.pruning.reap",
    "llmcompressor.modifiers.pruning.reap.base",
)


def pytest_configure(config) -> None:
    from reap_modifier import REAPPruningModifier

    for name in _UPSTREAM_MODULES:
        importlib.import_module(name).REAPPruningModifier = REAPPruningModifier
