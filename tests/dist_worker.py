"""Worker for tests/test_distributed.py: REAP through oneshot, under torchrun or alone.

Usage: python dist_worker.py FAMILY OUT_DIR SPLIT   (SPLIT: all | even | uneven)
Under ``torchrun --nproc-per-node 2`` each rank calibrates on its shard of the same
samples; alone it calibrates on all of them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from conftest import calibration_samples, make_dataset, make_tokenizer  # noqa: E402
from tiny_models import build_tiny, reload_class  # noqa: E402

from reap_modifier import REAPPruningModifier  # noqa: E402

torch.set_num_threads(1)


def shard(samples, split: str, rank: int, world: int):
    """This rank's samples; with world == 1, the union of all shards."""
    if split == "even":
        return samples[rank::world]
    # uneven: rank 0 takes 5 samples, rank 1 a single 4-token one
    shards = [samples[:5], [samples[5][:4]]]
    return shards[0] + shards[1] if world == 1 else shards[rank]


def record_local_zero_counts(result: dict) -> None:
    """Count experts this rank never routed to, just before the all-reduce."""
    from reap_modifier import modifier
    from reap_modifier.calibration import distributed

    original = distributed.reduce_accumulators

    def spy(accumulators, group):
        result["local_never_routed"] = sum(
            int((acc.export()["count"] == 0).sum()) for acc in accumulators.values()
        )
        original(accumulators, group)

    modifier.distributed.reduce_accumulators = spy


def main() -> None:
    family, out, split = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        rank, world = 0, 1
    out.mkdir(parents=True, exist_ok=True)
    model, info = build_tiny(family, seed=31)
    if rank == 0:  # transformers saves on the main process only
        model.save_pretrained(out / "src")
    if dist.is_initialized():
        dist.barrier()
    model = reload_class(family).from_pretrained(out / "src").eval()
    samples = calibration_samples(info.vocab_size, n=6, seq=12, seed=4)
    mine = shard(samples, split, rank, world)
    modifier = REAPPruningModifier(
        sparsity=0.5,
        scores_path=str(out / "scores.safetensors"),
        manifest_path=str(out / "manifest.json"),
    )
    from llmcompressor import oneshot

    local: dict = {}
    record_local_zero_counts(local)
    oneshot(
        model=model, recipe=[modifier], processor=make_tokenizer(info.vocab_size),
        dataset=make_dataset(mine), num_calibration_samples=len(mine),
    )
    arch = modifier.architecture
    result = {
        "kept": modifier.plan.kept,
        "router_rows": {l.name: l.router.weight.shape[0] for l in arch.layers},
        "local_tokens": sum(len(s) for s in mine),
        **local,
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
