"""A tiny Kimi K3 that is K3-shaped where llama.cpp's K3 converter and graph look: the
real config keys and the parts the real model has, saved as compressed-tensors MXFP4
(routed experts only), with a BPE tokenizer llama.cpp accepts.

``build_k3_testbed(out)`` -> :class:`mxfp4_fixtures.Fixture`; ``prune_with_reap(src, dst)``
runs the modifier on it (``oneshot``, REAP at sparsity 0.5, the compressed save) and returns
the plan. ``python tests/helpers/k3_testbed.py DIR`` runs the whole GGUF walk-through
(build, prune, llama.cpp's converter on both, ``reap prune`` of the unpruned GGUF, compare).

Against the project's other
tiny K3 (``linear_attn_config: null``, ``silu``), it has:

- ``linear_attn_config`` present, every layer listed as full (MLA) attention: KDA layers
  need ``fla``'s GPU kernels in the modeling (``fla.ops.kda``), so ``kda_layers`` is empty;
- ``hidden_act: situ`` with K3's betas (4.0, 25.0: the values of llama.cpp's
  ``tests/test-llama-archs.cpp``), in the dense MLP, the shared and the routed experts;
- attention residuals (``attn_res_block_size`` 2 over 4 layers: two blocks);
- the MLA output gate (``mla_use_output_gate``), a ``q_lora_rank``, the latent MoE;
- one expert group: llama.cpp's converter reads the group count from ``n_group`` only
  (``conversion/base.py``), which a K3 config does not have, so grouped routing in the
  checkpoint would route ungrouped in llama.cpp.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles importable by name)

N_LAYERS = 4
#: the token ids the llama.cpp checks run
IDS = [1, 17, 5, 99, 42, 8, 63, 120, 3, 77, 31, 12]
#: max abs. logit difference allowed between llama.cpp and transformers on the test-bed: its
#: MXFP4 experts read q8_0-rounded inputs in llama.cpp (``test_gguf_k3.py`` checks that this
#: rounding alone stays under half of it, and that a wrong cut is far above it)
LLAMA_CPP_TOL = 2e-2

#: the K3 text-config keys the test-bed sets (on top of ``tiny_models``' Kimi sizes and
#: ``mxfp4_fixtures``' MXFP4-compatible widths)
K3_SHAPED = dict(
    num_hidden_layers=N_LAYERS,
    first_k_dense_replace=1,
    q_lora_rank=16,
    hidden_act="situ",
    activation_situ_beta=4.0,
    activation_situ_linear_beta=25.0,
    attn_res_block_size=2,
    mla_use_output_gate=True,
    moe_renormalize=True,
    moe_router_activation_func="sigmoid",
    num_expert_group=1,
    topk_group=1,
    linear_attn_config=dict(
        kda_layers=[],
        full_attn_layers=list(range(1, N_LAYERS + 1)),
        short_conv_kernel_size=4,
        head_dim=16,
        num_heads=2,
        gate_lower_bound=-5.0,
        use_full_rank_gate=True,
    ),
)

#: a one-line chat template: llama.cpp's K3 converter otherwise reads its bundled
#: ``models/templates/Kimi-K3.jinja``, which the extracted converter does not hold
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def build_k3_testbed(out: str | os.PathLike, *, seed: int = 0, **overrides):
    """Build, quantize (routed experts: MXFP4) and save the test-bed with its tokenizer."""
    from gguf_oracle import bpe_tokenizer
    from mxfp4_fixtures import build_mxfp4_checkpoint

    out = Path(out)
    kw = {**K3_SHAPED, **overrides}
    fixture = build_mxfp4_checkpoint("kimi_k3", out, seed=seed, **kw)
    tok = bpe_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(out)
    return fixture


def k3_text_config(path: str | os.PathLike) -> dict:
    """The saved ``text_config`` of a checkpoint."""
    return json.loads((Path(path) / "config.json").read_text())["text_config"]


def reference_logits(model_dir, ids: list[int], *, q8_0_expert_inputs: bool = False):
    """transformers' float32 logits ``[tokens, vocab]`` of a saved test-bed (experts
    dequantized on load); with ``q8_0_expert_inputs`` every routed expert projection reads
    its input rounded as llama.cpp's CPU MXFP4 kernel rounds it (``gguf_oracle``)."""
    import torch
    from gguf_oracle import q8_0_roundtrip
    from tiny_models import reload_class
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = reload_class("kimi_k3").from_pretrained(
        model_dir, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model = model.to(torch.float32).eval()
    hooks = []
    if q8_0_expert_inputs:
        for name, module in model.named_modules():
            if ".experts." in name and name.rsplit(".", 1)[-1] in ("w1", "w2", "w3"):
                hook = module.register_forward_pre_hook(lambda m, a: (q8_0_roundtrip(a[0]),))
                hooks.append(hook)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
    for hook in hooks:
        hook.remove()
    return logits.numpy()


def prune_with_reap(src: str | os.PathLike, dst: str | os.PathLike, *, sparsity: float = 0.5):
    """REAP on the MXFP4 checkpoint ``src`` through ``oneshot`` (the user's flow, the
    compressed save into ``dst``); returns the modifier's plan."""
    from conftest import calibration_samples, make_dataset
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from reap_modifier import REAPPruningModifier

    modifier = REAPPruningModifier(sparsity=sparsity)
    oneshot(
        model=str(src),
        recipe=[modifier],
        processor=AutoTokenizer.from_pretrained(src),
        dataset=make_dataset(calibration_samples(128, n=6, seed=3)),
        num_calibration_samples=6,
        output_dir=str(dst),
    )
    return modifier.plan


def walkthrough(root: Path, outtype: str = "f32") -> None:
    """Build, prune, convert both, prune the unpruned GGUF, compare: printed."""
    from badinput import cli
    from gguf_oracle import convert, field_values, tensor_bytes

    build_k3_testbed(root / "src")
    plan = prune_with_reap(root / "src", root / "pruned")
    plan.save(root / "plan.json")
    src = convert(root / "src", root / f"src-{outtype}.gguf", outtype)
    want = convert(root / "pruned", root / f"pruned-{outtype}.gguf", outtype)
    ours = root / f"ours-{outtype}.gguf"
    res = cli("prune", src, "--plan", root / "plan.json", "-o", ours, "--no-provenance", "-q")
    print(res.output.strip())
    keys = field_values(src)
    print({k: v for k, v in keys.items() if k.startswith("kimi-k3.") and "token" not in k})
    types = {n: t for n, (_, t, _) in tensor_bytes(src).items() if "_exps" in n}
    print(f"expert tensors: {len(types)}, ggml types {sorted(set(types.values()))}")
    print(f"kept: {plan.kept}")
    print(
        f"reap prune {src.name} == converter on the pruned checkpoint:",
        ours.read_bytes() == want.read_bytes(),
    )


if __name__ == "__main__":
    walkthrough(Path(sys.argv[1]), *sys.argv[2:3])
