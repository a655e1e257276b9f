"""Worker for tests/test_distributed.py: REAP through oneshot, under torchrun or alone.

Usage: python dist_worker.py OUT_DIR [CASE ...]   (default: every case in ``CASES``)

Under ``torchrun --nproc-per-node 2`` every case runs data-parallel, the way a user
runs it: either every rank passes the *same* dataset (llm-compressor partitions it)
or each rank passes its own shard. Alone, each case runs the single-process
reference over the same samples: the same dataset and arguments, or the union of
the shards. Models are float64 with ``batch_invariant_numerics`` so that batches of
different composition (padding, other ranks) agree to ~1e-16; each case writes
``OUT_DIR/CASE/scores.safetensors`` (rank 0) and ``OUT_DIR/CASE/rank{r}.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
import paths  # noqa: E402,F401
from conftest import make_dataset, make_tokenizer  # noqa: E402
from tiny_models import batch_invariant_numerics, build_tiny, reload_class  # noqa: E402

from reap_modifier import REAPPruningModifier  # noqa: E402

torch.set_num_threads(1)

#: lengths of the varied-length samples (7 samples: 4 + 3 over two ranks)
VARIED = (12, 7, 9, 3, 12, 5, 10)

#: case -> family, data ("same": the same dataset on every rank; "shards": one per
#: rank, as ``shards`` sample counts), sample lengths, shuffle, batch size,
#: num_calibration_samples (None: all), and whether batches are padded
CASES: dict[str, dict] = {
    # the reported setup: 16 experts, top-4, 12 samples x 32 tokens, keep 8, no shuffle
    "qwen_same": dict(family="qwen3_moe", data="same", lengths=(32,) * 12, shuffle=False),
    "qwen_same_shuffle": dict(family="qwen3_moe", data="same", lengths=(32,) * 12, shuffle=True),
    # fewer samples requested than the dataset holds: the single process's choice
    "qwen_same_subset": dict(family="qwen3_moe", data="same", lengths=VARIED, num_samples=5),
    "qwen_same_subset_shuffle": dict(
        family="qwen3_moe", data="same", lengths=VARIED, num_samples=5, shuffle=True
    ),
    "qwen_same_varied": dict(family="qwen3_moe", data="same", lengths=VARIED),
    "qwen_same_pad4": dict(family="qwen3_moe", data="same", lengths=VARIED, batch_size=4),
    "qwen_shards_pad4": dict(
        family="qwen3_moe", data="shards", shards=(5, 2), lengths=VARIED, batch_size=4
    ),
    "kimi_same": dict(family="kimi_k3", data="same", lengths=(16,) * 6),
    "kimi_same_varied": dict(family="kimi_k3", data="same", lengths=VARIED),
    "kimi_same_pad4_shuffle": dict(
        family="kimi_k3", data="same", lengths=VARIED, batch_size=4, shuffle=True
    ),
    "kimi_shards": dict(family="kimi_k3", data="shards", shards=(3, 3), lengths=(12,) * 6),
    # a rank with a single 4-token sample: some experts get nothing locally
    "kimi_shards_uneven": dict(
        family="kimi_k3", data="shards", shards=(5, 1), lengths=(12,) * 5 + (4,), shuffle=True
    ),
    # the post-cut step (router fit + compensation, validated on held-out batches): the rows
    # of every rank gathered in one process's order, fitted on the first rank, held by all
    "kimi_same_fit": dict(family="kimi_k3", data="same", lengths=(16,) * 16, fit=True),
    # (equal lengths: one process over the union orders samples longest first, which for
    # unequal lengths is no concatenation of the shards)
    "kimi_shards_fit": dict(
        family="kimi_k3", data="shards", shards=(9, 7), lengths=(12,) * 16, fit=True
    ),
    # the worst-group block-error selection: each sample's group (a dataset column) told by
    # its tokens on every rank, in a shuffled draw
    "kimi_same_groups": dict(
        family="kimi_k3", data="same", lengths=(16,) * 12, shuffle=True, groups=True
    ),
}

#: groups of the samples of a ``groups`` case, by index in the whole dataset
GROUPS = ("en", "zh", "code")

#: padded case -> the case over the same samples at batch size 1 (no padding)
UNPADDED_TWIN = {
    "qwen_same_pad4": "qwen_same_varied",
    "qwen_shards_pad4": "qwen_same_varied",
    "kimi_same_pad4_shuffle": "kimi_same_varied",
}

FAMILY_OVERRIDES = {"qwen3_moe": dict(num_experts=16, num_experts_per_tok=4)}
SHUFFLE_SEED = 1234


def case_samples(case: dict, vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in case["lengths"]]


def rank_dataset(case: dict, samples: list[torch.Tensor], rank: int, world: int):
    """This rank's samples (the union when ``world == 1``)."""
    if case["data"] == "same" or world == 1:
        return samples
    bounds = [0]
    for n in case["shards"]:
        bounds.append(bounds[-1] + n)
    return samples[bounds[rank] : bounds[rank + 1]]


def spy_local_counts(result: dict) -> None:
    """Count experts this rank never routed to, just before the all-reduce."""
    from reap_modifier import modifier

    original = modifier.distributed.reduce_accumulators

    def spy(accumulators, group):
        result["local_never_routed"] = sum(
            int((acc.export()["count"] == 0).sum()) for acc in accumulators.values()
        )
        original(accumulators, group)

    modifier.distributed.reduce_accumulators = spy


def run_case(name: str, out: Path, rank: int, world: int) -> None:
    from llmcompressor import oneshot

    case = CASES[name]
    family = case["family"]
    out.mkdir(parents=True, exist_ok=True)
    model, info = build_tiny(
        family, seed=31, dtype=torch.float64, **FAMILY_OVERRIDES.get(family, {})
    )
    if rank == 0:  # transformers saves on the main process only
        model.save_pretrained(out / "src")
    if dist.is_initialized():
        dist.barrier()
    model = reload_class(family).from_pretrained(out / "src", dtype=torch.float64).eval()
    samples = case_samples(case, info.vocab_size)
    mine = rank_dataset(case, samples, rank, world)
    dataset = make_dataset(mine)
    groups = {}
    if case.get("groups"):
        labels = rank_dataset(case, [GROUPS[i % 3] for i in range(len(samples))], rank, world)
        dataset = dataset.add_column("language", labels)
        groups = dict(
            selection="block_error", selection_groups="language", selection_candidates=None
        )
    batch_size = case.get("batch_size", 1)
    fit = (
        dict(calibrate_router=True, compensate=True, router_fit_steps=10, compensation_steps=10)
        if case.get("fit")
        else {}
    )
    modifier = REAPPruningModifier(
        num_experts_to_keep=info.num_experts // 2,
        scores_path=str(out / "scores.safetensors"),
        manifest_path=str(out / "manifest.json"),
        **fit,
        **groups,
    )
    local: dict = {}
    spy_local_counts(local)
    torch.manual_seed(SHUFFLE_SEED)  # the shuffled draw: the same on rank 0 and alone
    oneshot(
        model=model,
        recipe=[modifier],
        processor=make_tokenizer(info.vocab_size),
        dataset=dataset,
        num_calibration_samples=case.get("num_samples") or len(mine),
        shuffle_calibration_samples=case.get("shuffle", False),
        batch_size=batch_size,
        data_collator="padding" if batch_size > 1 else "truncation",
    )
    arch = modifier.architecture
    result = {
        "kept": modifier.plan.kept,
        "router_rows": {layer.name: layer.router.weight.shape[0] for layer in arch.layers},
        **local,
    }
    if groups:
        selection = modifier.router_fit["selection"]
        result["selection"] = {
            "objective": selection["objective"],
            "groups": selection["groups"],
            "group_errors": {n: r["group_errors"] for n, r in selection["layers"].items()},
        }
    if fit:
        result["post_cut"] = modifier.router_fit["components"]
        fitted = modifier._fitted_tensors
        torch.save(fitted, out / f"fitted_rank{rank}.pt")
        # what this rank's model holds now, for every fitted tensor
        held = {
            layer: {n: model.get_submodule(layer).get_parameter(n).detach().clone() for n in named}
            for layer, named in fitted.items()
        }
        torch.save(held, out / f"model_rank{rank}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    with batch_invariant_numerics():
        for name in names:
            run_case(name, out / name, rank, world)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
