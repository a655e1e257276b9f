"""The whole user flow for one family: tiny model -> ``oneshot`` +
``REAPPruningModifier(sparsity=0.5)`` (default sequential pipeline) -> ``output_dir``
-> ``from_pretrained`` -> logits equal to the unpruned model with the dropped experts
masked out of routing (:mod:`generic_oracle`, whose routers and biases come from the
hand-written :mod:`family_routing`). A refusal must come before anything is written to
``output_dir``. Discovery (``find_moe_architecture``) is called only to report what the
product found (the coverage table's router / experts / count key columns)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from conftest import calibration_samples, make_dataset
from family_routing import moe_blocks, spread_biases_
from family_zoo import build_family
from generic_oracle import generic_masked_routing

from reap_modifier import REAPPruningModifier
from reap_modifier.models import find_moe_architecture

__all__ = ["REFUSALS", "FlowResult", "run_family"]

#: the product's clear refusals (anything else raised in the flow is a failure)
REFUSALS = ("NoMoEError", "UnsupportedMoEError", "WholenessError", "PlanError", "ValueError")


@dataclasses.dataclass
class FlowResult:
    family: str
    model_class: str = ""
    status: str = ""  # "pruned" | "refused"
    error: str = ""
    max_diff: float | None = None
    count_key: str = ""
    router: str = ""
    experts: str = ""
    written: list[str] = dataclasses.field(default_factory=list)
    #: the MoE blocks' module names the product found
    moe_layers: list[str] = dataclasses.field(default_factory=list)
    #: tensors (parameters and buffers, by module path) outside the MoE blocks (by
    #: :mod:`family_routing`),
    #: and those of them that differ between the reloaded source and pruned checkpoints
    outside: list[str] = dataclasses.field(default_factory=list)
    changed_outside: list[str] = dataclasses.field(default_factory=list)


def _layout(arch) -> tuple[str, str]:
    layer = arch.layers[0]
    router = type(layer.router).__name__
    experts = layer.experts
    if isinstance(experts, torch.nn.ModuleList):
        return router, "ModuleList"
    return router, f"fused {type(experts).__name__}"


def run_family(
    family: str, root: Path, tokenizer, dataset=None, prepare=None, pipeline=None, **overrides
) -> FlowResult:
    """:param prepare: called on the loaded model before ``oneshot`` (tests that plant
    a defect)
    :param pipeline: ``oneshot``'s pipeline (``None``: its default, sequential)"""
    from llmcompressor import oneshot

    result = FlowResult(family)
    model, vocab = build_family(family, seed=13, **overrides)
    spread_biases_(model, family)
    result.model_class = type(model).__name__
    src = root / f"{family}-src"
    model.save_pretrained(src)
    cls = type(model)
    model = cls.from_pretrained(src, dtype=torch.float32).eval()
    if prepare is not None:
        prepare(model)
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(5))
    dst = root / f"{family}-out"
    modifier = REAPPruningModifier(sparsity=0.5)
    if dataset is None:
        dataset = make_dataset(calibration_samples(vocab, n=4, seed=1))
    try:
        arch = find_moe_architecture(model)
        result.count_key = arch.count_keys[0]
        result.moe_layers = arch.layer_names
        result.router, result.experts = _layout(arch)
        oneshot(
            model=model,
            recipe=[modifier],
            processor=tokenizer,
            dataset=dataset,
            num_calibration_samples=len(dataset),
            output_dir=str(dst),
            **({"pipeline": pipeline} if pipeline is not None else {}),
        )
    except Exception as exc:  # a refusal by the product, or a failure
        result.status = "refused" if type(exc).__name__ in REFUSALS else "fails"
        result.error = f"{type(exc).__name__}: {exc}"
        result.written = sorted(
            p.name for p in dst.glob("*") if p.suffix in (".safetensors", ".bin", ".json")
        )
        return result
    plan = modifier.plan
    dropped = {
        name: sorted(set(range(plan.num_experts)) - set(kept)) for name, kept in plan.kept.items()
    }
    source = cls.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        plain = source(input_ids=ids, use_cache=False).logits
        with generic_masked_routing(source, family, dropped):
            expected = source(input_ids=ids, use_cache=False).logits
        pruned = cls.from_pretrained(dst, dtype=torch.float32).eval()
        got = pruned(input_ids=ids, use_cache=False).logits
    assert not torch.equal(plain, expected), f"{family}: masking changed nothing"
    result.status = "pruned"
    blocks = tuple(name + "." for name in moe_blocks(source, family))
    before, after = source.state_dict(), pruned.state_dict()
    result.outside = [k for k in before if not k.startswith(blocks)]
    result.changed_outside = [
        k for k in result.outside if k not in after or not torch.equal(before[k], after[k])
    ]
    result.max_diff = float((got - expected).abs().max())
    return result
