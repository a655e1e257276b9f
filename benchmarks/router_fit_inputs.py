"""Does the router fit gain from fitting on the pruned model's own layer inputs?

``calibrate_router`` fits layer *i* on the inputs the *unpruned* model gives it (captured
during calibration, before the cut). At inference the pruned model feeds it inputs that
carry the error of the pruned layers before it. This fits the same cut both ways on the
same calibration tokens, with :func:`reap_modifier.post_cut.router_fit.fit_router` and the
unpruned block's output on the same input as the target:

``std``  inputs from the unpruned model (what the modifier does);
``seq``  layer by layer, inputs from the pruned model whose earlier routers are already fitted.

Judged on held-out windows (the development split by default: ``--split``,
:mod:`window_metrics`; KL to the unpruned model, paired over windows).
Needs the main job's output (``bash scripts/demo.sh``):

    PYTHONPATH=src python benchmarks/router_fit_inputs.py --cut reap_en_zh_code_75
"""

from __future__ import annotations

import argparse

import torch
from window_metrics import add_split_argument, held_out_windows, per_window_metrics

from reap_modifier.demo.config import LANGS


def main() -> None:
    from transformers import AutoTokenizer

    from reap_modifier.demo import data as D
    from reap_modifier.demo.config import DEFAULT_MODEL
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.evaluation import paired_difference
    from reap_modifier.models import find_moe_architecture
    from reap_modifier.post_cut.router_fit import fit_router

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--demo-out", default="out/demo")
    ap.add_argument("--cut", default="reap_en_zh_code")
    ap.add_argument("--tokens-per-lang", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.03)
    add_split_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    calib = {lang: D.load_split(None, lang, "calib") for lang in LANGS}
    dataset = D.calibration_dataset(calib, tokenizer, args.tokens_per_lang, 256)
    rows = [torch.tensor(r) for r in dataset["input_ids"]]
    windows = held_out_windows(tokenizer, 64, 256, split=args.split)

    def load(path):
        return load_model(path, packed=False, dtype="float32")

    unpruned = load(args.model)
    reference = find_moe_architecture(unpruned).layers

    def layer_inputs(model, index: int) -> torch.Tensor:
        block = find_moe_architecture(model).layers[index].block
        seen = []
        hook = block.register_forward_pre_hook(
            lambda _m, a: seen.append(a[0].reshape(-1, a[0].shape[-1]).detach())
        )
        with torch.no_grad():
            for ids in rows:
                model(input_ids=ids.unsqueeze(0))
        hook.remove()
        return torch.cat(seen)

    def fitted(sequential: bool):
        model = load(f"{args.demo_out}/pruned/{args.cut}")
        for i, layer in enumerate(find_moe_architecture(model).layers):
            x = layer_inputs(model if sequential else unpruned, i)
            with torch.no_grad():
                y = reference[i].block(x.unsqueeze(0)).reshape(x.shape)
            tensors, result = fit_router(layer, x, y, steps=args.steps, lr=args.lr)
            with torch.no_grad():
                for name, tensor in tensors.items():
                    getattr(layer.router, name).copy_(tensor)
            print(
                f"layer {i} {'seq' if sequential else 'std'}: held-out error "
                f"{result.holdout_before:.3f} -> {result.holdout_after:.3f}",
                flush=True,
            )
        return model

    models = {
        "unpruned": unpruned,
        "alone": load(f"{args.demo_out}/pruned/{args.cut}"),
        "std": fitted(False),
        "seq": fitted(True),
    }
    print("| cut | language | fit inputs | KL alone | KL fit | change | ΔKL ± SE |")
    print("|---|---|---|---:|---:|---:|---:|")
    for lang in LANGS:
        pw = per_window_metrics(models, windows[lang], "unpruned", 8)
        alone = pw["alone"]["kl"]
        base = sum(alone) / len(alone)
        for name in ("std", "seq"):
            kl = pw[name]["kl"]
            diff = paired_difference(alone, kl)
            mean = sum(kl) / len(kl)
            print(
                f"| {args.cut} | {lang} | {name} | {base:.4f} | {mean:.4f} | "
                f"{100 * (mean / base - 1):+.1f}% | {diff['mean']:+.4f} ± {diff['se']:.4f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
