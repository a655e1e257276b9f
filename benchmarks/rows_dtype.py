"""Could the post-cut step's captured rows be stored narrower than the model computes them?
Measured for a bf16 checkpoint computed in float32 (weights bf16-exact, arithmetic float32).

1. For tiny random Kimi K3, Qwen3-MoE and DeepSeek-V3 built in bf16 and computed in float32
   (tests/helpers/tiny_models.py): the share of each MoE block's input and output elements
   (what the post-cut step stores) that bf16 represents exactly, and the largest relative error
   of rounding them to bf16 (bf16's unit roundoff is 2^-8 = 3.9e-3).
2. The post-cut recipe through ``oneshot`` on the Kimi K3 saved in bf16 and loaded in float32,
   with the rows stored as computed (the product) and rounded to bf16 (a patched
   ``RowStore.put``): with ``selection: block_error`` (whether it runs), and with
   ``calibrate_router``, ``calibrate_bias``, ``compensate`` (validated): each component's
   held-out KL and decision, and the largest difference of the fitted tensors.

    PYTHONPATH=src python benchmarks/rows_dtype.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)
from conftest import make_dataset, make_tokenizer  # noqa: E402
from tiny_models import (  # noqa: E402
    build_tiny,
    capture_block_io,
    reload_class,
    sample_input_ids,
)

from reap_modifier.models import find_moe_architecture  # noqa: E402


def representable(family: str) -> list[tuple[str, str, float, float]]:
    """``(layer, "inputs" | "outputs", share bf16-exact, max relative rounding error)``."""
    model, info = build_tiny(family, seed=3, dtype=torch.bfloat16)
    model = model.float()  # a bf16 checkpoint computed in float32
    arch = find_moe_architecture(model)
    ids = sample_input_ids(info.vocab_size, batch=4, seq=64, seed=1)
    with torch.no_grad():
        io = capture_block_io(model, arch, ids)
    out = []
    for name, pair in io.items():
        for what, t in zip(("inputs", "outputs"), pair, strict=True):
            r = t.to(torch.bfloat16).float()
            share = (r == t).double().mean().item()
            rel = ((r - t).abs() / t.abs().clamp_min(1e-30)).max().item()
            out.append((name, what, share, rel))
    return out


def post_cut(source: Path, bf16_rows: bool, selection: bool) -> dict:
    """The recipe on the float32 computation of ``source`` (the block-error selection alone,
    or the three fits); the rows rounded to bf16 when ``bf16_rows``; ``{"error": ...}`` when
    the step refuses."""
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier
    from reap_modifier.post_cut import rows

    put = rows.RowStore.put

    def rounded(self, name, x, y):
        return put(self, name, x.to(torch.bfloat16).float(), y.to(torch.bfloat16).float())

    rows.RowStore.put = rounded if bf16_rows else put
    try:
        model = reload_class("kimi_k3").from_pretrained(source, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(5)
        samples = [torch.randint(3, 128, (64,), generator=gen) for _ in range(32)]
        recipe = (
            dict(selection="block_error")
            if selection
            else dict(
                calibrate_router=True,
                calibrate_bias=True,
                compensate=True,
                router_fit_steps=30,
                compensation_steps=30,
            )
        )
        modifier = REAPPruningModifier(sparsity=0.5, **recipe)
        oneshot(
            model=model,
            recipe=[modifier],
            processor=make_tokenizer(128),
            dataset=make_dataset(samples),
            num_calibration_samples=len(samples),
            shuffle_calibration_samples=False,
        )
    except RuntimeError as exc:
        return {"error": str(exc)}
    finally:
        rows.RowStore.put = put
    record = modifier.router_fit
    return {
        "selection": record["selection"] and record["selection"]["end_to_end"],
        "components": [(c["name"], c["kept"], c["kl_after"]) for c in record["components"]],
        "kl_cut": record["validation"]["kl_cut"],
        "fitted": modifier._fitted_tensors,
    }


def main() -> None:
    torch.set_num_threads(1)
    print("| family | block | rows | bf16-exact share | max relative error |")
    print("|---|---|---|---:|---:|")
    for family in ("kimi_k3", "qwen3_moe", "deepseek_v3"):
        for name, what, share, rel in representable(family):
            print(f"| {family} | {name} | {what} | {share:.4f} | {rel:.2e} |")
    with tempfile.TemporaryDirectory() as tmp:
        model, _ = build_tiny("kimi_k3", seed=3, dtype=torch.bfloat16)
        model.save_pretrained(Path(tmp) / "src")
        src = Path(tmp) / "src"
        chosen = {b: post_cut(src, b, selection=True) for b in (False, True)}
        fits = {b: post_cut(src, b, selection=False) for b in (False, True)}
    print("\n`selection: block_error`")
    for b, r in chosen.items():
        label = "rounded to bf16" if b else "as computed (float32)"
        if "error" in r:
            print(f"- rows {label}: refused: {r['error']}")
        else:
            e2e = r["selection"]
            print(
                f"- rows {label}: applied {e2e['applied']}, KL {e2e.get('kl_ranking_cut')} "
                f"(REAP's cut) -> {e2e.get('kl_selection')} (selection)"
            )
    print("\n| rows stored | KL of the cut | component: kept, KL after |\n|---|---:|---|")
    for b, r in fits.items():
        label = "rounded to bf16" if b else "as computed (float32)"
        if "error" in r:
            print(f"| {label} | refused: {r['error']} | |")
            continue
        comps = "; ".join(f"{n}: {k}, {kl:.6g}" for n, k, kl in r["components"])
        print(f"| {label} | {r['kl_cut']:.6g} | {comps} |")
    a, b = fits[False], fits[True]
    if "error" not in a and "error" not in b:
        diffs = [
            (t.double() - b["fitted"][layer][n].double()).abs().max().item()
            / t.double().abs().max().item()
            for layer, named in a["fitted"].items()
            if layer in b["fitted"]
            for n, t in named.items()
            if n in b["fitted"][layer]
        ]
        print(
            f"\nfitted tensors kept in both: {len(diffs)}; largest difference "
            f"{max(diffs, default=0):.3g} of the tensor's largest entry"
        )


if __name__ == "__main__":
    main()
