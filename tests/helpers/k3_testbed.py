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
  need ``fla``'s GPU kernels in the modeling (``fla.ops.kda``), so ``kda_layers`` is empty
  (``with_kda_layer`` makes one layer KDA in a saved copy, for llama.cpp, which cannot run a
  K3 without a KDA layer);
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


#: the layer (0-based) :func:`with_kda_layer` makes a KDA layer by default: a MoE layer, so
#: every later router reads a KDA layer's output
KDA_LAYER = 1


def with_kda_layer(
    src: str | os.PathLike, dst: str | os.PathLike, layer: int = KDA_LAYER, *, seed: int = 0
) -> Path:
    """A copy of the saved test-bed ``src`` in ``dst`` whose ``layer`` is a KDA layer with
    random weights (the names and shapes of the K3 modeling's ``KimiDeltaAttention``, the
    full-rank gate): for llama.cpp only. llama.cpp cannot run a K3 without a KDA layer (its
    hybrid memory's ``rs_s_copy`` graph input is read by KDA layers only, so it is never
    allocated and ``set_input`` aborts on ``GGML_ASSERT(buffer)``), and transformers cannot
    run one on CPU (the modeling's KDA needs ``fla``)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    text = cfg["text_config"]
    lin = text["linear_attn_config"]
    lin["kda_layers"] = sorted(set(lin["kda_layers"]) | {layer + 1})  # 1-based lists
    lin["full_attn_layers"] = [i for i in lin["full_attn_layers"] if i != layer + 1]
    hidden, n_head, head_dim = text["hidden_size"], lin["num_heads"], lin["head_dim"]
    d_inner, d_conv = n_head * head_dim, lin["short_conv_kernel_size"]
    prefix = f"language_model.model.layers.{layer}.self_attn."
    quant = cfg.get("quantization_config") or {}
    if "ignore" in quant:  # the plain (unquantized) linears, as the compressed save lists them
        kept = [n for n in quant["ignore"] if not n.startswith(prefix)]
        kda_linears = "q_proj k_proj v_proj f_a_proj f_b_proj b_proj g_proj o_proj".split()
        quant["ignore"] = kept + [prefix + n for n in kda_linears]
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))

    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale):
        return torch.randn(*shape, generator=gen) * scale

    shapes = {
        "q_proj.weight": rand(d_inner, hidden, scale=hidden**-0.5),
        "k_proj.weight": rand(d_inner, hidden, scale=hidden**-0.5),
        "v_proj.weight": rand(d_inner, hidden, scale=hidden**-0.5),
        "q_conv1d.weight": rand(d_inner, 1, d_conv, scale=0.5),
        "k_conv1d.weight": rand(d_inner, 1, d_conv, scale=0.5),
        "v_conv1d.weight": rand(d_inner, 1, d_conv, scale=0.5),
        "A_log": torch.log(torch.rand(n_head, generator=gen) * 15 + 1),
        "f_a_proj.weight": rand(head_dim, hidden, scale=hidden**-0.5),
        "f_b_proj.weight": rand(d_inner, head_dim, scale=head_dim**-0.5),
        "dt_bias": rand(d_inner, scale=0.5),
        "b_proj.weight": rand(n_head, hidden, scale=hidden**-0.5),
        "g_proj.weight": rand(d_inner, hidden, scale=hidden**-0.5),
        "o_norm.weight": 1 + rand(head_dim, scale=0.1),
        "o_proj.weight": rand(hidden, d_inner, scale=d_inner**-0.5),
    }
    path = dst / "model.safetensors"
    tensors = load_file(path)
    dtype = tensors[f"language_model.model.layers.{layer}.input_layernorm.weight"].dtype
    tensors = {n: t for n, t in tensors.items() if not n.startswith(prefix)}
    for name, t in shapes.items():
        tensors[prefix + name] = t.to(torch.float32 if name in ("A_log", "dt_bias") else dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    return dst


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
