"""Hooks into llama.cpp's converter when ``reap export-gguf`` runs it in its own interpreter:
a ``sitecustomize.py`` (put on ``PYTHONPATH``) that patches ``conversion.base`` as it is
imported.

- always: the tiny word-level tokenizer's pre-tokenizer is named ``default`` (its hash is in
  no table of llama.cpp's; only the tokenizer keys depend on it), as ``gguf_oracle`` does;
- with ``REAP_TEST_BREAK_REPACK=1``: the converter's ``repack_mxfp4_blocks`` swaps the two
  nibbles of every code byte (the mutation the lossless tests must catch).
"""

from __future__ import annotations

import os
from pathlib import Path

_SITE = """
import importlib.abc, importlib.machinery, os, sys


def _patch(base):
    base.TextModel.get_vocab_base_pre = lambda self, tok: "default"
    if os.environ.get("REAP_TEST_BREAK_REPACK"):
        stock = base.ModelBase.repack_mxfp4_blocks

        def broken(packed, scale):
            raw = stock(packed, scale).copy()
            qs = raw.reshape(raw.shape[0], -1, 17)[:, :, 1:]
            raw.reshape(raw.shape[0], -1, 17)[:, :, 1:] = (qs << 4) | (qs >> 4)
            return raw

        base.ModelBase.repack_mxfp4_blocks = staticmethod(broken)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "conversion.base":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        stock = spec.loader.exec_module

        def exec_module(module):
            stock(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""


def converter_site(folder: Path) -> dict[str, str]:
    """Write the ``sitecustomize.py`` into ``folder``; the environment variables that put it
    on the converter's path."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_SITE)
    pythonpath = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH")) if p)
    return {"PYTHONPATH": pythonpath}
