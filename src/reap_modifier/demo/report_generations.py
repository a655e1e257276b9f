"""The generation sections: the longest repeat runs of the greedy continuations (the degeneration
check) and the continuations themselves."""

from __future__ import annotations

import unicodedata

from .config import LANGS
from .records import Results


def degeneration_section(res: Results) -> list[str]:
    run = res.run
    lines = [
        "",
        "## Degeneration check (the seed's)",
        "",
        f"Greedy continuations of {run.prompts_per_lang} held-out prompt(s) per language"
        f" ({run.prompt_tokens} prompt tokens, {run.new_tokens} new tokens): the longest"
        " run of back-to-back copies of one substring (the seed: 3 in healthy output, thousands in a collapsed"
        " one): the maximum over the prompts in tokens / in characters, and the mean over prompts in tokens."
        " Read it against the unpruned row: greedy decoding of a model this small loops on its own.",
        "",
        "| model | en max tok / chr | zh max tok / chr | code max tok / chr | en mean | zh mean | code mean |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for m in res.models:
        lines.append(
            f"| {m.label} | "
            + " | ".join(f"{m.repeats[l].max_tokens} / {m.repeats[l].max_chars}" for l in LANGS)
            + " | "
            + " | ".join(f"{m.repeats[l].mean_tokens:.1f}" for l in LANGS)
            + " |"
        )
    return lines


def generations_section(res: Results) -> list[str]:
    lines = ["", "## Generations", ""]
    for lang in LANGS:
        for i, p in enumerate(res.prompts[lang][:1]):
            lines += [f"**{lang}**, prompt ({p.source}): `{_md(p.text)}`", ""]
            for m in res.models:
                row = next(r for r in res.generations[m.name] if r.lang == lang and r.prompt == i)
                lines.append(f"- {m.label} (run {row.repeat_run_tokens} tok): `{_md(row.text)}`")
            lines.append("")
    return lines


def _md(text: str) -> str:
    """``text`` on one markdown line: newlines as a visible arrow, any other control or line
    separator character (a generation may hold ``\\r``, which a reader's universal newlines
    would turn into a line break) as its ``\\uXXXX`` escape."""
    text = text.replace("`", "'").replace("\n", " \u21b5 ").replace("|", "\\|")
    return "".join(
        f"\\u{ord(c):04x}" if c != "\t" and unicodedata.category(c) in ("Cc", "Zl", "Zp") else c
        for c in text
    )
