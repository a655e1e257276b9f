"""vLLM weight-loading probe: run by a Python that has vLLM, never imported by reap-modifier.

``python vllm_load_probe.py --model DIR --out RESULT.json [--dtype D] [--max-model-len N]``

Builds the model exactly as vLLM's default loader does (``EngineArgs`` ->
``create_engine_config`` -> ``loader.create_model`` -> ``loader.load_weights``, with
vLLM's own strict weight tracking switched on, so every model parameter must come from
the checkpoint) and stops there: ``process_weights_after_loading`` (kernel repacking)
and the forward pass are not run.  Then it checks, independently of vLLM's name
mapping, that every tensor of the checkpoint landed in the model:

- each checkpoint tensor's values are searched for in the loaded parameters (a block
  of rows of a parameter, or of one expert's slice of a fused expert parameter; the
  weights are random in tests, so a match is never an accident);
- a per-expert tensor ``...experts.{e}...`` must land in slot ``e`` of a fused
  ``experts`` parameter: the renumbering of the kept experts is what vLLM serves;
- a tensor found nowhere fails the check, except tensors of modules that vLLM
  deliberately does not build (a vision tower in text-only mode, rotary caches),
  which are listed as ignored.

The placement search is brute force over the loaded parameters: meant for checkpoints
that fit in this machine's memory (tests, small models; a K3-class model is checked in
``serve`` mode on GPUs instead).  The result (JSON) says what was proved.  Only the standard library, torch, safetensors
and vLLM are imported: this file runs in vLLM's virtual environment, where
reap-modifier is not installed.

Load-only shims, used only when no CUDA device is present (CPU-only vLLM), each
needed to *construct* a model that vLLM otherwise builds only on a GPU; none of them
runs a kernel, and no forward pass is ever made:

- ``torch.cuda.Stream`` / ``torch.cuda.Event`` become inert objects (vLLM 0.32's Kimi
  K3 model creates an auxiliary stream and events in ``__init__``);
- vLLM's CPU MXFP4 MoE experts class is accepted for any routing method and CPU
  (it requires AMX tiles and does not list grouped sigmoid routing), so the MXFP4
  expert parameters are created with the shapes the loader fills;
- for hybrid models (K3 declares linear-attention support), ``mamba_block_size`` is
  pinned to ``max_model_len`` when vLLM's CPU platform turns prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

PROBE_FORMAT = "reap-vllm-load-probe/1"

#: checkpoint tensors vLLM skips by design when it does not build their module
IGNORABLE_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "visual.")
IGNORABLE_SUBSTRINGS = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")

EXPERT_RE = re.compile(r"\.experts\.(\d+)\.")


def _install_cpu_shims(applied: list[str]) -> None:
    import torch

    if torch.cuda.is_available():
        return

    class _InertStream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

    class _InertEvent:
        def __init__(self, *args, **kwargs):
            pass

        def record(self, *args, **kwargs):
            pass

        def wait(self, *args, **kwargs):
            pass

        def synchronize(self):
            pass

    torch.cuda.Stream = _InertStream  # type: ignore[misc]
    torch.cuda.Event = _InertEvent  # type: ignore[misc]
    applied.append("torch.cuda.Stream/Event inert (no CUDA device)")
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe

        cpu_moe.CPUExpertsMxfp4.is_supported_config = staticmethod(lambda *a, **k: (True, None))
        applied.append("CPUExpertsMxfp4 accepted for any routing/CPU (parameter shapes only)")
    except Exception as exc:  # pragma: no cover - other vLLM versions
        applied.append(f"CPUExpertsMxfp4 shim not applied: {exc!r}")


def _engine_config(model: str, dtype: str, max_model_len: int, applied: list[str]):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=model,
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        enforce_eager=True,
        dtype=dtype,
        distributed_executor_backend="uni",
        model_loader_extra_config={"enable_weights_track": True},
    )
    try:
        return EngineArgs(**kwargs).create_engine_config()
    except Exception as exc:
        if "mamba-block-size" not in str(exc):
            raise
    kwargs["mamba_block_size"] = max_model_len
    applied.append(f"mamba_block_size={max_model_len} (prefix caching is off on this platform)")
    return EngineArgs(**kwargs).create_engine_config()


def _checkpoint_tensors(model_dir: Path):
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def _compatible(t, p) -> bool:
    import torch

    if t.is_floating_point() != p.is_floating_point():
        return False
    if not t.is_floating_point() and t.dtype != p.dtype:
        return False
    if t.dim() == 0:
        return False
    if p.dim() < t.dim():
        return False
    if t.dim() >= 2 and tuple(p.shape[p.dim() - t.dim() + 2 :]) != tuple(t.shape[2:]):
        return False
    if t.dim() >= 2 and p.shape[-(t.dim() - 1)] < t.shape[1]:
        return False
    return p.numel() >= t.numel() and p.dtype != torch.bool


def _find(t, p):
    """Where ``t`` sits in ``p``: ``(slot, row)`` or None.

    ``p`` is viewed as ``[slots, rows, *t.shape[1:]]`` (``slots`` = the product of
    its leading dims beyond ``t``'s rank, e.g. experts); ``t`` must equal a block of
    consecutive rows of one slot (trailing columns beyond ``t``'s width are padding).
    """
    import torch

    extra = p.dim() - t.dim()
    if t.dim() == 1:
        slots = p.reshape(-1, p.shape[-1]) if p.dim() > 1 else p.reshape(1, -1)
        n = t.shape[0]
        for s in range(slots.shape[0]):
            row = slots[s]
            if row.shape[0] < n:
                continue
            ref = t.to(row.dtype)
            hits = (row == ref[0]).nonzero().flatten().tolist()
            for h in hits:
                if h + n <= row.shape[0] and torch.equal(row[h : h + n], ref):
                    return s, h
        return None
    lead = 1
    for d in p.shape[:extra]:
        lead *= d
    view = p.reshape(lead, p.shape[extra], *p.shape[extra + 1 :])
    width = t.shape[1]
    ref = t.to(view.dtype)
    rows = t.shape[0]
    for s in range(lead):
        block = view[s][:, :width]
        first = (
            (block.reshape(block.shape[0], -1) == ref[0].reshape(-1))
            .all(dim=1)
            .nonzero()
            .flatten()
            .tolist()
        )
        for r in first:
            if r + rows <= block.shape[0] and torch.equal(block[r : r + rows], ref):
                return s, r
    return None


def place_tensors(model_dir: Path, params: dict) -> dict:
    """Check that every checkpoint tensor's values are in ``params`` (see module doc)."""
    placed, misplaced, missing, ignored, where = 0, [], [], [], {}
    unbuilt = tuple(pre for pre in IGNORABLE_PREFIXES if not any(n.startswith(pre) for n in params))
    for name, t in _checkpoint_tensors(model_dir):
        if any(s in name for s in IGNORABLE_SUBSTRINGS) or name.startswith(unbuilt):
            ignored.append(name)
            continue
        m = EXPERT_RE.search(name)
        want_slot = int(m.group(1)) if m else None
        hit = None
        # the parameter of the same name first (identical values, e.g. all-ones norms,
        # would otherwise be attributed to whichever parameter comes first)
        order = ([name] if name in params else []) + [n for n in params if n != name]
        for pname in order:
            p = params[pname]
            if not _compatible(t, p):
                continue
            loc = _find(t, p)
            if loc is None:
                continue
            fused_expert = ".experts." in pname and p.dim() > t.dim()
            if want_slot is not None and fused_expert and loc[0] != want_slot:
                hit = hit or (pname, loc)
                continue
            hit = (pname, loc)
            break
        if hit is None:
            missing.append(name)
        elif (
            want_slot is not None
            and ".experts." in hit[0]
            and params[hit[0]].dim() > t.dim()
            and hit[1][0] != want_slot
        ):
            misplaced.append(f"{name} -> {hit[0]}[{hit[1][0]}] (expected expert slot {want_slot})")
        else:
            placed += 1
            where[name] = f"{hit[0]}[{hit[1][0]}, {hit[1][1]}:]"
    return {
        "placed": placed,
        "misplaced": misplaced,
        "missing": missing,
        "ignored": ignored,
        "where": where,
    }


def run(model: str, dtype: str, max_model_len: int) -> dict:
    t0 = time.perf_counter()
    result: dict = {"format": PROBE_FORMAT, "model": model, "ok": False, "shims": []}
    try:
        import torch
        import vllm

        result["vllm_version"] = vllm.__version__
        _install_cpu_shims(result["shims"])
        from vllm.config import set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.model_loader import get_model_loader
        from vllm.utils.torch_utils import set_default_torch_dtype

        result["stage"] = "config"
        cfg = _engine_config(model, dtype, max_model_len, result["shims"])
        mc = cfg.model_config
        result.update(
            architecture=mc.architecture, quantization=mc.quantization, dtype=str(mc.dtype)
        )
        loader = get_model_loader(cfg.load_config)
        with set_current_vllm_config(cfg):
            init_distributed_environment(
                world_size=1,
                rank=0,
                local_rank=0,
                distributed_init_method="file://"
                + os.path.join(tempfile.mkdtemp(prefix="reap-vllm-"), "init"),
                backend="gloo",
            )
            initialize_model_parallel(1, 1)
            result["stage"] = "build"
            with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
                net = loader.create_model(vllm_config=cfg, model_config=mc)
            result["stage"] = "load"
            loader.load_weights(net, mc)  # raises if a parameter got no checkpoint tensor
            result["stage"] = "placement"
        params = {n: p.detach() for n, p in net.named_parameters()}
        params.update(
            {
                n: b.detach()
                for n, b in net.named_buffers()
                if b.is_floating_point() or b.dtype == torch.uint8
            }
        )
        result["parameters"] = len(params)
        result["placement"] = place_tensors(Path(model), params)
        pl = result["placement"]
        result["checkpoint_tensors"] = (
            pl["placed"] + len(pl["misplaced"]) + len(pl["missing"]) + len(pl["ignored"])
        )
        result["ok"] = not pl["misplaced"] and not pl["missing"]
        result["stage"] = "done"
    except BaseException as exc:  # report every failure as data, the caller decides
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc(limit=30)
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=256)
    args = ap.parse_args(argv)
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")  # GEMM-AR needs NVLink multicast
    res = run(args.model, args.dtype, args.max_model_len)
    Path(args.out).write_text(json.dumps(res, indent=2))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
