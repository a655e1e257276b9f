"""Tiny MXFP4 (compressed-tensors ``mxfp4-pack-quantized``) checkpoints for the
checkpoint-rewriter tests, plus the helpers those tests share.

``build_mxfp4_checkpoint(family, out)`` builds a tiny random model of ``family``
(``qwen3_moe``, ``deepseek_v3``, ``kimi_k3``) with :mod:`tiny_models`, linearizes its
experts, quantizes *only the routed experts* with llm-compressor
``QuantizationModifier(scheme="MXFP4A16")`` and saves it compressed (optionally in
several shards).  ``build_plain_checkpoint`` saves an unquantized one (GPT-OSS: fused
3-D experts, router bias, single ``model.safetensors``).

Run as a script (``python tests/helpers/mxfp4_fixtures.py reload-check CASES.json``) it
reloads checkpoints in a fresh process and compares logits with the masked-routing
oracle; the tests call it through :func:`reload_check`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import paths  # noqa: E402

#: routed-expert Linear layers after linearize_moe (Qwen3/DeepSeek: gate/up/down_proj,
#: Kimi: w1/w2/w3); shared experts and dense MLPs are not matched
EXPERT_TARGETS = [r"re:.*\.experts\.\d+\.(gate_proj|up_proj|down_proj|w1|w2|w3)$"]

#: overrides making expert dims multiples of 32 (MXFP4 groups)
_OVERRIDES = {
    "qwen3_moe": dict(moe_intermediate_size=32),
    "deepseek_v3": dict(moe_intermediate_size=32, num_nextn_predict_layers=0),
    "kimi_k3": dict(moe_intermediate_size=32, routed_expert_hidden_size=32),
}

MXFP4_FAMILIES = tuple(_OVERRIDES)


@dataclass
class Fixture:
    family: str
    path: Path
    moe_blocks: list[str]  # module paths of the MoE blocks (= plan layer keys)
    num_experts: int
    top_k: int
    count_key: str
    n_group: int | None = None
    topk_group: int | None = None


def _count_key(family: str) -> str:
    return {
        "qwen3_moe": "num_local_experts",
        "deepseek_v3": "n_routed_experts",
        "kimi_k3": "text_config.num_experts",
        "gpt_oss": "num_local_experts",
    }[family]


def build_mxfp4_checkpoint(
    family: str,
    out: str | os.PathLike,
    *,
    max_shard_size: str | None = None,
    seed: int = 0,
    ignore_experts: list[str] | None = None,
    **overrides,
) -> Fixture:
    """Build, quantize (routed experts only, MXFP4) and save a tiny ``family`` model.

    :param ignore_experts: extra module names left unquantized (e.g. one expert
        projection, to exercise per-expert names in ``quantization_config.ignore``)
    """
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import linearize_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from tiny_models import build_tiny, text_config

    out = Path(out)
    kw = dict(_OVERRIDES[family])
    kw.update(overrides)
    model, info = build_tiny(family, seed=seed, dtype=torch.bfloat16, **kw)
    linearize_moe(model)
    # oneshot re-reads the config from model.name_or_path: give it one on disk
    cfg_dir = out.parent / f".{out.name}-config"
    # a real source config names its class; llm-compressor's compressed save copies this
    # file, and vLLM guesses a base-model architecture from a config without one
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(cfg_dir)
    model.config._name_or_path = str(cfg_dir)
    recipe = QuantizationModifier(
        targets=EXPERT_TARGETS, scheme="MXFP4A16", ignore=["lm_head", *(ignore_experts or [])]
    )
    oneshot(model=model, recipe=recipe)
    kwargs = {"save_compressed": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(out, **kwargs)
    tc = text_config(model)
    n_group = getattr(tc, "n_group", None) or getattr(tc, "num_expert_group", None)
    return Fixture(
        family=family,
        path=out,
        moe_blocks=list(info.moe_blocks),
        num_experts=info.num_experts,
        top_k=info.top_k,
        count_key=_count_key(family),
        n_group=n_group,
        topk_group=getattr(tc, "topk_group", None),
    )


def build_plain_checkpoint(
    family: str, out: str | os.PathLike, *, seed: int = 0, **overrides
) -> Fixture:
    """An unquantized bf16 checkpoint (single file) of ``family`` as transformers saves it."""
    from tiny_models import build_tiny

    out = Path(out)
    model, info = build_tiny(family, seed=seed, dtype=torch.bfloat16, **overrides)
    model.save_pretrained(out)
    return Fixture(
        family, out, list(info.moe_blocks), info.num_experts, info.top_k, _count_key(family)
    )


#: one expert projection of the Kimi source left unquantized (per-expert ``ignore`` name)
KIMI_IGNORED = "language_model.model.layers.1.block_sparse_moe.experts.5.w2"


def build_sources(root: str | os.PathLike) -> dict:
    """The shared source checkpoints of the rewriter tests (the ``sources`` fixture):
    multi-shard MXFP4 ``qwen3_moe`` / ``deepseek_v3`` / ``kimi_k3`` and a plain
    single-file ``gpt_oss``, each with a scores file ``{family}.scores.safetensors``.
    Returns ``{"root", "fx": family -> Fixture, "hashes": family -> tree sha256}``."""
    root = Path(root)
    fx = {
        "qwen3_moe": build_mxfp4_checkpoint("qwen3_moe", root / "qwen3_moe", max_shard_size="40KB"),
        "deepseek_v3": build_mxfp4_checkpoint(
            "deepseek_v3", root / "deepseek_v3", max_shard_size="60KB"
        ),
        "kimi_k3": build_mxfp4_checkpoint(
            "kimi_k3", root / "kimi_k3", max_shard_size="60KB", ignore_experts=[KIMI_IGNORED]
        ),
        "gpt_oss": build_plain_checkpoint("gpt_oss", root / "gpt_oss"),
    }
    for name, f in fx.items():
        write_scores(root / f"{name}.scores.safetensors", f)
    hashes = {name: tree_sha256(f.path) for name, f in fx.items()}
    return {"root": root, "fx": fx, "hashes": hashes}


# ---------------------------------------------------------------------------
# synthetic MXFP4-like checkpoints (no model: random bytes with the real naming)


def write_synthetic_mxfp4(
    out: str | os.PathLike,
    *,
    num_layers: int = 3,
    num_experts: int = 16,
    top_k: int = 4,
    hidden: int = 64,
    inter: int = 64,
    shard_bytes: int = 64 << 10,
    dense_layers: int = 1,
    prefix: str = "language_model.model",
    container: str = "block_sparse_moe",
    seed: int = 0,
) -> dict:
    """Write a Kimi-K3-named MXFP4 checkpoint of random bytes, shard by shard.

    Per MoE layer: ``gate.weight`` (bf16 [E, hidden]), ``gate.e_score_correction_bias``
    (f32 [E]) and per expert ``w1``/``w3`` (``weight_packed`` u8 [inter, hidden/2],
    ``weight_scale`` u8 [inter, hidden/32]) and ``w2`` ([hidden, inter/2], [hidden,
    inter/32]); plus attention / norm / embedding tensors.  Shards are filled in
    order up to ``shard_bytes`` (so a shard can hold only experts).  Memory: one
    shard.  Returns ``{"blocks": [...], "num_experts", "shards", "bytes"}``.
    """
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)

    def rnd_u8(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)

    def rnd_bf16(*shape):
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    def tensors():
        yield f"{prefix}.embed_tokens.weight", rnd_bf16(256, hidden)
        for layer in range(num_layers):
            p = f"{prefix}.layers.{layer}"
            yield f"{p}.input_layernorm.weight", rnd_bf16(hidden)
            for proj in ("q_proj", "o_proj"):
                yield f"{p}.self_attn.{proj}.weight", rnd_bf16(hidden, hidden)
            if layer < dense_layers:
                yield f"{p}.mlp.gate_proj.weight", rnd_bf16(inter, hidden)
                continue
            b = f"{p}.{container}"
            yield f"{b}.gate.weight", rnd_bf16(num_experts, hidden)
            yield f"{b}.gate.e_score_correction_bias", torch.randn(num_experts, generator=gen)
            for e in range(num_experts):
                for proj, (o, i) in (
                    ("w1", (inter, hidden)),
                    ("w2", (hidden, inter)),
                    ("w3", (inter, hidden)),
                ):
                    yield f"{b}.experts.{e}.{proj}.weight_packed", rnd_u8(o, i // 2)
                    yield f"{b}.experts.{e}.{proj}.weight_scale", rnd_u8(o, i // 32)
            yield f"{b}.shared_experts.down_proj.weight", rnd_bf16(hidden, inter)
        yield f"{prefix}.norm.weight", rnd_bf16(hidden)
        yield "language_model.lm_head.weight", rnd_bf16(256, hidden)

    weight_map: dict[str, int] = {}
    size, total, written = 0, 0, []

    def flush(idx: int, shard: dict):
        name = f"model-{idx + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        written.append(name)

    current: dict[str, torch.Tensor] = {}
    for name, t in tensors():
        if current and size + t.nbytes > shard_bytes:
            flush(len(written), current)
            current, size = {}, 0
        current[name] = t
        weight_map[name] = len(written)
        size += t.nbytes
        total += t.nbytes
    flush(len(written), current)
    n = len(written)
    final = {}
    for i, old in enumerate(written):
        new = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(out / old, out / new)
        final[i] = new
    index = {
        "metadata": {"total_size": total},
        "weight_map": {k: final[v] for k, v in weight_map.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    qc = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "targets": [r"re:.*\.experts\.\d+\.(w1|w2|w3)$"],
                "weights": {
                    "num_bits": 4,
                    "type": "float",
                    "strategy": "group",
                    "group_size": 32,
                    "symmetric": True,
                    "dynamic": False,
                    "scale_dtype": "torch.uint8",
                },
            }
        },
        "ignore": ["language_model.lm_head"],
    }
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "quantization_config": qc,
        "text_config": {
            "num_experts": num_experts,
            "num_experts_per_token": top_k,
            "num_hidden_layers": num_layers,
            "hidden_size": hidden,
            "num_expert_group": 1,
            "topk_group": 1,
        },
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "tokenizer_config.json").write_text("{}")
    blocks = [f"{prefix}.layers.{i}.{container}" for i in range(dense_layers, num_layers)]
    return {
        "blocks": blocks,
        "num_experts": num_experts,
        "shards": list(final.values()),
        "bytes": total,
    }


# ---------------------------------------------------------------------------
# hashing helpers (independent of reap_modifier's header parser)


def tree_sha256(path: str | os.PathLike) -> dict[str, str]:
    """relative path -> sha256 for every file under ``path`` (plus mtimes ignored)."""
    path = Path(path)
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            out[p.relative_to(path).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def tensor_sha256(path: str | os.PathLike) -> dict[str, str]:
    """tensor name -> sha256 of its raw bytes, read through ``safetensors.safe_open``."""
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k).contiguous()
                out[k] = hashlib.sha256(
                    t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
                ).hexdigest()
    return out


#: a routed expert tensor's name: its MoE block, expert index and the rest
EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<idx>\d+)\.(?P<rest>.+)$")


def kept_experts_are_source_bytes(src, dst, kept: dict[str, list[int]]) -> int:
    """Assert that every routed-expert tensor of ``dst`` in a block of ``kept`` hashes
    equal to the source tensor of the expert it was cut from (expert ``i`` of a block is
    ``kept[block][i]`` of the source); returns how many tensors were compared."""
    src_sha, dst_sha = tensor_sha256(src), tensor_sha256(dst)
    checked = 0
    for name, digest in dst_sha.items():
        m = EXPERT.match(name)
        if m and m["block"] in kept:
            old = kept[m["block"]][int(m["idx"])]
            assert digest == src_sha[f"{m['block']}.experts.{old}.{m['rest']}"], name
            checked += 1
    return checked


def load_tensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                out[k] = st.get_tensor(k)
    return out


def write_scores(path: str | os.PathLike, fixture: Fixture, *, seed: int = 1):
    """A deterministic REAP scores file for ``fixture``'s MoE layers (random stats)."""
    from reap_modifier.scores import ExpertScores

    gen = torch.Generator().manual_seed(seed)
    E = fixture.num_experts
    meta = {
        "model_class": fixture.family,
        "top_k": fixture.top_k,
        "n_group": fixture.n_group,
        "topk_group": fixture.topk_group,
        "tokens": {"test": 1000},
    }
    scores = ExpertScores.empty(fixture.moe_blocks, E, meta)
    for stats in scores.layers.values():
        count = torch.randint(1, 200, (E,), generator=gen).to(torch.float64)
        mean = torch.rand(E, generator=gen, dtype=torch.float64) + 0.1
        stats["count"] = count
        stats["sum_weight"] = count * 0.3
        stats["sum_norm"] = count * mean * 2
        stats["sum_reap"] = count * mean
        stats["max_norm"] = mean * 3
    scores.save(path)
    return scores


def add_mtp_layer(path: str | os.PathLike, from_block: str, layer_index: int) -> str:
    """Append a DeepSeek-V3 style MTP MoE layer ``model.layers.{layer_index}``
    (a copy of ``from_block``'s tensors, in a new shard ``model-mtp.safetensors``).
    Returns the new block prefix."""
    from safetensors.torch import save_file

    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    tensors = load_tensors(path)
    src_layer = from_block.split(".mlp")[0]  # model.layers.L
    new_layer = f"model.layers.{layer_index}"
    new = {}
    for k, t in tensors.items():
        if k.startswith(src_layer + "."):
            new[new_layer + k[len(src_layer) :]] = t.clone()
    save_file(new, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
    for k in new:
        index["weight_map"][k] = "model-mtp.safetensors"
    index_file.write_text(json.dumps(index, indent=2))
    return f"{new_layer}.mlp"


def rewrite_shard_without(path: str | os.PathLike, names: list[str]) -> None:
    """Remove tensors ``names`` from their shards and from the index (corruption)."""
    from safetensors.torch import save_file

    path = Path(path)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = {index["weight_map"][n] for n in names}
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as st:
            meta = st.metadata()
            keep = {k: st.get_tensor(k) for k in st.keys() if k not in names}
        save_file(keep, str(path / shard), metadata=meta)
    for n in names:
        del index["weight_map"][n]
    index_file.write_text(json.dumps(index, indent=2))


# ---------------------------------------------------------------------------
# reload in a fresh process + masked-routing oracle


class _MaskRouterLogits(torch.overrides.TorchFunctionMode):
    """Adds -inf to dropped experts' router logits (the F.linear on the router weight)."""

    def __init__(self, weight: torch.Tensor, dropped: list[int]):
        super().__init__()
        self.weight = weight
        self.dropped = dropped

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.nn.functional.linear and len(args) > 1 and args[1] is self.weight:
            out = out.clone()
            out[..., self.dropped] = float("-inf")
        return out


def mask_routing(model: torch.nn.Module, block_kept: dict[str, list[int]]) -> None:
    """Masked-routing oracle, in place: dropped experts can never be selected.

    Sigmoid routers with ``e_score_correction_bias`` (DeepSeek-V3, Kimi): the
    selection bias of dropped experts is -inf (weights of selected experts are
    unchanged).  Softmax / GPT-OSS routers: dropped experts' logits are -inf, i.e. the
    softmax runs over kept logits only.
    """
    for prefix, kept in block_kept.items():
        block = model.get_submodule(prefix)
        router = getattr(block, "gate", None) or block.router
        E = router.weight.shape[0]
        dropped = [i for i in range(E) if i not in set(kept)]
        bias = getattr(router, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            with torch.no_grad():
                bias[dropped] = float("-inf")
            continue
        # hooks, not a forward override (compressed-tensors wraps forward on decompress)
        mode = _MaskRouterLogits(router.weight, dropped)
        router.register_forward_pre_hook(lambda mod, args, _m=mode: _m.__enter__() and None)
        router.register_forward_hook(
            lambda mod, args, out, _m=mode: _m.__exit__(None, None, None) and None
        )


def _experts_in(model, prefix: str) -> int:
    block = model.get_submodule(prefix)
    router = getattr(block, "gate", None) or block.router
    return int(router.weight.shape[0])


def _reload_main(cases_file: str) -> None:
    from tiny_models import reload_class, sample_input_ids

    cases = json.loads(Path(cases_file).read_text())
    results = []
    for case in cases:
        cls = reload_class(case["family"])
        ids = sample_input_ids(vocab=128, batch=2, seq=24, seed=3)
        # MXFP4 checkpoints decompress to bf16 experts (load them in bf16); plain ones
        # load in float32 (bf16 router logits tie, and ties make top-k order arbitrary)
        dtype = getattr(torch, case.get("dtype", "bfloat16"))
        src = cls.from_pretrained(case["src"], dtype=dtype).eval()
        mask_routing(src, case["block_kept"])
        dst = cls.from_pretrained(case["dst"], dtype=dtype).eval()
        with torch.no_grad():
            ref = src(ids).logits.float()
            got = dst(ids).logits.float()
        cfg = dst.config
        tc = getattr(cfg, "text_config", None) or cfg
        counts = {p: _experts_in(dst, p) for p in case["block_kept"]}
        results.append(
            {
                "name": case.get("name", case["dst"]),
                "max_abs_diff": float((ref - got).abs().max()),
                "ref_abs_mean": float(ref.abs().mean()),
                "router_rows": counts,
                "config_count": int(
                    getattr(tc, "num_experts", None)
                    or getattr(tc, "n_routed_experts", None)
                    or getattr(tc, "num_local_experts", None)
                ),
                "finite": bool(torch.isfinite(got).all()),
            }
        )
    print("RELOAD-RESULTS " + json.dumps(results))


def reload_check(cases: list[dict], tmp_dir: str | os.PathLike) -> dict[str, dict]:
    """Reload each ``{"family", "src", "dst", "block_kept", "name"}`` case in ONE fresh
    Python process; returns name -> result (max_abs_diff vs the masked oracle, ...)."""
    cases_file = Path(tmp_dir) / "reload_cases.json"
    cases_file.write_text(json.dumps(cases))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(HERE), str(paths.ORACLES), str(paths.TESTS.parent / "src"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "reload-check", str(cases_file)],
        capture_output=True,
        text=True,
        env=env,
    )
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RELOAD-RESULTS ")), None)
    if proc.returncode != 0 or line is None:
        raise AssertionError(
            f"reload subprocess failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return {r["name"]: r for r in json.loads(line[len("RELOAD-RESULTS ") :])}


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "reload-check":
        _reload_main(sys.argv[2])
    else:
        raise SystemExit("usage: mxfp4_fixtures.py reload-check CASES.json")
