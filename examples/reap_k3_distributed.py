"""REAP on a Kimi-K3-class checkpoint, data-parallel over every GPU of a node.

    torchrun --nproc-per-node 8 examples/reap_k3_distributed.py \
        --model /models/Kimi-K3 --data calib.jsonl --samples 64 \
        --recipe recipes/reap_keep_448.yaml --out /models/Kimi-K3-REAP-448

Each rank loads its own disjoint slice of the calibration set; the model is loaded
once with compressed-tensors' offloading, its MXFP4 experts packed, and onloaded layer
by layer by the sequential pipeline, where REAP dequantizes one MoE layer at a time. Statistics are all-reduced before the decision; rank 0 writes the
scores file, the manifest and the checkpoint. Works on CPU too (gloo), as the tests do.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from datasets import load_dataset
from llmcompressor import oneshot
from transformers import AutoModelForCausalLM, AutoTokenizer

import reap_modifier  # noqa: F401  registers REAPPruningModifier and kimi_k3


def init_distributed() -> None:
    if torch.accelerator.is_available():
        from compressed_tensors.distributed import init_dist

        init_dist()
    else:
        dist.init_process_group("gloo")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="jsonl with a 'text' field")
    parser.add_argument(
        "--samples", type=int, default=64, help="calibration samples over all ranks"
    )
    parser.add_argument("--max-seq-length", type=int, default=32768)
    parser.add_argument("--recipe", default="recipes/reap_keep_448.yaml")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if "RANK" in os.environ:
        init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    from compressed_tensors.offload import load_offloaded_model

    with load_offloaded_model():
        model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype="auto", device_map="auto_offload", trust_remote_code=True
        )
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)

    start, end = args.samples * rank // world, args.samples * (rank + 1) // world
    data = load_dataset("json", data_files=args.data, split=f"train[{start}:{end}]")
    data = data.map(
        lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_seq_length),
        remove_columns=data.column_names,
    )
    oneshot(
        model=model,
        processor=tokenizer,
        dataset=data,
        recipe=args.recipe,
        num_calibration_samples=len(data),
        max_seq_length=args.max_seq_length,
        moe_calibrate_all_experts=False,
        output_dir=args.out,
    )
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
