"""What ``oneshot``'s default ``moe_calibrate_all_experts=True`` costs a REAP recipe,
measured side by side in one run.

Over the same model and the same calibration data (REAP alone, ``sparsity: 0.5``):

- ``defaults``: ``oneshot(...)`` as a user writes it (flag on; the modifier turns it
  off for its own calibration and puts it back);
- ``flag off``: ``oneshot(..., moe_calibrate_all_experts=False)``;
- ``all experts``: the flag on and honoured (what ``defaults`` cost before the
  modifier turned it off: a second, no-op modifier that needs data keeps it on);
- ``plain``: ``model(input_ids)`` over the same batches, no hooks, no pipeline.

``oneshot`` times include its sequential pipeline (tracing, caching, two passes per
layer); the model is loaded from disk before each timer starts. Target: ``defaults``
within 1.10x of ``flag off``.

Models: a Qwen3-MoE with 128 experts / top-8 (2 layers) and a Kimi-K3-shaped latent MoE
(``--k3-experts``, top-16).

Usage: ``python benchmarks/bench_calibrate_all.py [--samples 32] [--seq 128] [--repeats 1]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_calibration_overhead import k3_shaped
from llmcompressor.modifiers import Modifier

torch.set_num_threads(1)
VOCAB = 512


class NeedsData(Modifier):
    """A modifier that does nothing but asks for calibration data (keeps the flag on)."""

    requires_calibration_data: bool = True

    def on_initialize(self, state, **kwargs) -> bool:
        return True


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t0", pad_token="t0")


def qwen3_128(hidden: int):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=hidden // 4,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg).eval()


def timed_oneshot(load, data, processor, variant: str) -> float:
    from llmcompressor import oneshot

    from reap_modifier import REAPPruningModifier

    model = load()
    recipe = [REAPPruningModifier(sparsity=0.5)]
    kwargs = {}
    if variant == "flag off":
        kwargs["moe_calibrate_all_experts"] = False
    elif variant == "all experts":
        recipe.append(NeedsData())
        kwargs["pipeline"] = "sequential"  # one calibration for both modifiers
    start = time.perf_counter()
    oneshot(
        model=model,
        recipe=recipe,
        processor=processor,
        dataset=data,
        num_calibration_samples=len(data),
        **kwargs,
    )
    return time.perf_counter() - start


def timed_plain(load, batches) -> float:
    model = load()
    start = time.perf_counter()
    with torch.no_grad():
        for ids in batches:
            model(input_ids=ids, use_cache=False)
    return time.perf_counter() - start


def bench(name, build, args, processor, root: Path) -> tuple[str, dict[str, float]]:
    from datasets import Dataset

    model = build()
    path = root / name.split()[0]
    model.save_pretrained(path)
    cls = type(model)
    del model

    def load():
        return cls.from_pretrained(path).eval()

    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, VOCAB, (1, args.seq), generator=gen) for _ in range(args.samples)]
    ids = [b[0].tolist() for b in batches]
    data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
    timed_oneshot(
        load, data.select(range(2)), processor, "flag off"
    )  # warm-up: imports, first trace
    variants = ["defaults", "flag off", "all experts", "plain"]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            t = (
                timed_plain(load, batches)
                if v == "plain"
                else timed_oneshot(load, data, processor, v)
            )
            times[v].append(t)
            print(f"  {name}: {v}: {t:.2f} s", flush=True)
    return name, {v: statistics.median(ts) for v, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--k3-experts", type=int, default=256)
    args = parser.parse_args()

    from reap_modifier import compat  # noqa: F401  (registers kimi_k3)

    processor = tokenizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows.append(
            bench(
                "Qwen3-MoE 128 experts, top-8",
                lambda: qwen3_128(args.hidden),
                args,
                processor,
                Path(tmp),
            )
        )
        rows.append(
            bench(
                f"K3-shaped latent MoE, {args.k3_experts} experts, top-16",
                lambda: k3_shaped(args.hidden, args.k3_experts),
                args,
                processor,
                Path(tmp),
            )
        )
    print(
        f"\n{args.samples} samples x {args.seq} tokens, REAP alone (sparsity 0.5), "
        f"median of {args.repeats}, 1 thread"
    )
    head = f"{'model':<44} {'defaults':>9} {'flag off':>9} {'all exp.':>9} {'plain':>7} {'defaults/off':>13} {'all/off':>8}"
    print(head)
    for name, t in rows:
        print(
            f"{name:<44} {t['defaults']:8.2f}s {t['flag off']:8.2f}s {t['all experts']:8.2f}s "
            f"{t['plain']:6.2f}s {t['defaults'] / t['flag off']:12.3f}x "
            f"{t['all experts'] / t['flag off']:7.2f}x"
        )


if __name__ == "__main__":
    main()
