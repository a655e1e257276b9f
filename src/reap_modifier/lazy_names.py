"""Public names imported on first use (PEP 562).

A package lists, for each public name, the module that defines it; importing the package imports
none of them, and a name is looked up once, then held by the package. That keeps
``import reap_modifier`` and the ``reap`` commands that need no model (``reap --help``, a GGUF
prune from a plan) free of torch (``tests/test_cli_startup.py``), and ``checkpoint``'s GGUF
users free of compressed-tensors.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence


def lazy_names(
    package: str,
    where: Mapping[str, str],
    public: Sequence[str],
    first: Mapping[str, str] | None = None,
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``.

    :param where: public name -> the module that defines it, relative to ``package``
    :param public: the package's ``__all__``
    :param first: module -> a module to import before it (e.g. the one that fills a registry
        the first one holds)
    """
    first = first or {}

    def __getattr__(name: str) -> object:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name]
        if module in first:
            importlib.import_module(f"{package}.{first[module]}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        vars(sys.modules[package])[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *public})

    return __getattr__, __dir__
