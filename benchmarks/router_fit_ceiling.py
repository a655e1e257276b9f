"""How far could any router-only change go? Oracle routers beside REAP alone and REAP +
router fit, per language, on the main job's checkpoints.

``calibrate_router`` changes only the kept router rows; the experts stay as they are. Two
oracles bound what any such change can reach, layer by layer, on the model's own inputs:
at every MoE block of the pruned model, the unpruned block is run on the same input and
its output ``y`` is the target; the kept experts' outputs (latent up-projection applied)
are combined with per-token least-squares weights, shared experts as they are:

``oracle free``
    the experts the pruned router selects, any weights (any sign, any sum): what the
    selection allows if weights were free, which no router of this model can give;
``oracle simplex``
    the same experts, weights ``>= 0`` summing to the routed scaling factor: every
    weighting a renormalised router (Kimi K3, DeepSeek-V3) can produce, so the best any
    router with the cut's selection can do;
``oracle simplex_all``
    every kept expert, weights on the same simplex: a lower bound on the error of any
    router of this routing function, whatever it selects (it may use more than top-k).

The oracles read the target while they run, so they are bounds, not models. Judged on
held-out windows (the development split by default: ``--split``, :mod:`window_metrics`),
KL(unpruned || model) per token, paired over windows.
Needs the main job's output (``bash scripts/demo.sh``):

    PYTHONPATH=src python benchmarks/router_fit_ceiling.py --demo-out out/demo
"""

from __future__ import annotations

import argparse
import json
import types
from pathlib import Path

import torch
from window_metrics import add_split_argument, held_out_windows, per_window_metrics

from reap_modifier.demo.config import LANGS


def _blocks(model) -> list:
    from reap_modifier.models import find_moe_architecture

    return [layer.block for layer in find_moe_architecture(model).layers]


def _expert_outputs(block, hidden: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """``[N, len(ids), H]``: each listed expert's output in the hidden space."""
    z = block.routed_expert_down_proj(hidden) if block.use_latent_moe else hidden
    outs = torch.stack([block.experts[j](z) for j in ids], dim=1)
    return block.routed_expert_up_proj(outs) if block.use_latent_moe else outs


def _least_squares(outs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per token ``sum_j w_j outs[:, j]`` closest to ``target``, any weights (float64)."""
    a = outs.double().transpose(1, 2)  # [N, H, K]
    w = torch.linalg.lstsq(a, target.double().unsqueeze(-1)).solution  # [N, K, 1]
    return (a @ w).squeeze(-1).to(target.dtype)


def _project_simplex(v: torch.Tensor, total: float) -> torch.Tensor:
    """Rows of ``v`` projected onto ``{w >= 0, sum w = total}`` (sort-based)."""
    u, _ = torch.sort(v, dim=-1, descending=True)
    css = u.cumsum(-1) - total
    k = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype, device=v.device)
    rho = ((u - css / k) > 0).sum(-1, keepdim=True).clamp(min=1)
    theta = css.gather(-1, rho - 1) / rho.to(v.dtype)
    return (v - theta).clamp(min=0)


def _simplex_least_squares(
    outs: torch.Tensor, target: torch.Tensor, total: float, iters: int = 300
) -> torch.Tensor:
    """Per token ``sum_j w_j outs[:, j]`` closest to ``target`` with ``w >= 0`` and
    ``sum w = total``: the weights a renormalised router scaled by ``total`` can give
    (accelerated projected gradient, float64)."""
    a = outs.double()  # [N, K, H]
    t = target.double()
    gram = a @ a.transpose(1, 2)  # [N, K, K]
    lin = (a @ t.unsqueeze(-1)).squeeze(-1)  # [N, K]
    step = 1.0 / torch.linalg.eigvalsh(gram)[:, -1:].clamp(min=1e-12)
    w = torch.full(lin.shape, total / lin.shape[-1], dtype=a.dtype)
    z, m = w.clone(), 1.0
    for _ in range(iters):
        grad = (gram @ z.unsqueeze(-1)).squeeze(-1) - lin
        w_next = _project_simplex(z - step * grad, total)
        m_next = (1 + (1 + 4 * m * m) ** 0.5) / 2
        z = w_next + ((m - 1) / m_next) * (w_next - w)
        w, m = w_next, m_next
    return (w.unsqueeze(1) @ a).squeeze(1).to(target.dtype)


def _patch_oracle(pruned_block, unpruned_block, mode: str) -> None:
    assert not getattr(pruned_block.config, "latent_moe_use_norm", False)

    def forward(self, hidden_states):
        shape = hidden_states.shape
        y = unpruned_block(hidden_states)
        shared = self.shared_experts(hidden_states) if hasattr(self, "shared_experts") else 0
        target = (y - shared).reshape(-1, shape[-1])
        flat = hidden_states.reshape(-1, shape[-1])
        n_kept = len(self.experts)
        outs = _expert_outputs(self, flat, list(range(n_kept)))  # [N, K, H]
        if mode in ("free", "simplex"):
            idx, _ = self.gate(hidden_states)  # the pruned router's selection
            outs = outs.gather(1, idx.unsqueeze(-1).expand(-1, -1, outs.shape[-1]))
        if mode == "free":
            routed = _least_squares(outs, target)
        else:
            gate = self.gate
            total = gate.routed_scaling_factor if gate.moe_renormalize else None
            assert total is not None, "the simplex oracle needs a renormalised router"
            routed = _simplex_least_squares(outs, target, float(total))
        return routed.reshape(shape) + shared

    pruned_block.forward = types.MethodType(forward, pruned_block)


def main() -> None:
    from transformers import AutoTokenizer

    from reap_modifier.demo.config import DEFAULT_MODEL
    from reap_modifier.demo.workspace import load_model
    from reap_modifier.evaluation import paired_difference

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--demo-out", default="out/demo")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--cuts", nargs="+", default=["reap_en_zh_code", "reap_en_zh_code_75"])
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8)
    ap.add_argument("--out", default=None)
    add_split_argument(ap)
    args = ap.parse_args()
    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    windows = held_out_windows(
        tokenizer, args.eval_windows, args.seq_len, args.data_dir, split=args.split
    )
    pruned_dir = Path(args.demo_out) / "pruned"

    def load(path):
        return load_model(path, packed=False, dtype="float32")

    unpruned = load(args.model)
    rows, results = [], {}
    for cut in args.cuts:
        base_name, _, tier = cut.rpartition("_")
        fit_name = f"{base_name}_fit_{tier}" if tier.isdigit() else f"{cut}_fit"
        models = {"unpruned": unpruned, "alone": load(pruned_dir / cut)}
        if (pruned_dir / fit_name).exists():
            models["fit"] = load(pruned_dir / fit_name)
        for mode in ("free", "simplex", "simplex_all"):
            model = load(pruned_dir / cut)
            for pb, ub in zip(_blocks(model), _blocks(unpruned), strict=True):
                _patch_oracle(pb, ub, mode)
            models[f"oracle {mode}"] = model
        results[cut] = {}
        for lang in LANGS:
            pw = per_window_metrics(models, windows[lang], "unpruned", args.chunk)
            alone = pw["alone"]["kl"]
            base = sum(alone) / len(alone)
            rec = {}
            for name in models:
                if name in ("unpruned", "alone"):
                    continue
                kl = pw[name]["kl"]
                diff = paired_difference(alone, kl)
                rec[name] = {"kl": sum(kl) / len(kl), "diff": diff}
                rows.append(
                    f"| {cut} | {lang} | {name} | {base:.4f} | {rec[name]['kl']:.4f} | "
                    f"{100 * (rec[name]['kl'] / base - 1):+.1f}% | "
                    f"{diff['mean']:+.4f} ± {diff['se']:.4f} |"
                )
                print("row:", rows[-1], flush=True)
            results[cut][lang] = {"alone": base, **rec}
    print("| cut | language | model | KL alone | KL model | change | ΔKL ± SE |")
    print("|---|---|---|---:|---:|---:|---:|")
    print("\n".join(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
