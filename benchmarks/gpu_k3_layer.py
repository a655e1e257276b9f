"""One Kimi-K3-shaped MoE layer on a GPU: plain forward vs forward with REAP's observer
vs forward on MXFP4-packed experts dequantized by this package, side by side.

The shape is the one ``benchmarks/k3_scale.py`` assumes for K3: hidden 7168, latent
(``routed_expert_hidden_size``) 3584, expert intermediate 2048, 896 routed experts,
top-16, one shared expert. A one-MoE-layer checkpoint is written with random MXFP4
experts (``tests/helpers/k3_mxfp4_synth.py``: 10.5 GB packed, 39 GB as bf16), then loaded
twice onto the device: decompressed there (bf16) and packed. Over ``--tokens`` tokens of random hidden
states (batches of ``--seq``), timed with CUDA events, median of ``--repeats``:

- ``plain``: the MoE block's forward, dense bf16 experts, llm-compressor's routed
  dispatch (``moe_infer``: one host sync, then one matmul chain per expert with tokens);
- ``grouped``: the block's forward on this package's grouped dispatch
  (:mod:`reap_modifier.calibration.kimi_grouped`: grouped_mm over stacked experts, no
  host sync), no statistics: what a calibration forward costs on it;
- ``observer``: REAP's observer attached, grouped dispatch (the default): the routed
  calibration forward REAP runs, statistics included; the observer is attached before
  the timed pass and one batch run through it (which stacks the experts: that one-time
  cost per layer is printed on its own);
- ``observer/loop``: the same on ``moe_infer`` (``grouped=False``, the previous path);
- ``packed``: packed experts, dequantized one MoE layer at a time with
  compressed-tensors' decompressor (``PackedCompute("layer")``: what calibration of a
  packed checkpoint does; attached afresh for every pass, so each pass pays the
  dequantization of every expert that receives tokens), with the observer;
- ``packed/expert``: the same, one expert projection at a time.

Prints tokens/s, ratios to ``plain`` and to ``grouped``, the observer's ratio to the plain
forward it runs on (``observer`` / ``grouped``, ``observer/loop`` / ``plain``), and a
roofline with each variant's fraction of it (roofline time / measured): the larger of
the expert weight bytes the pass reads over the memory bandwidth and its FLOPs over the
bf16 dense peak (H100 SXM / PCIe and H200 looked up by device name, or
``--peak-tflops`` / ``--bandwidth-gbs``); on a CPU the peak cannot be known reliably, so
only measured figures are printed. ``--small`` runs a small shape through the same code
path (on CPU when no GPU is present).

Dependencies: torch, transformers, llm-compressor 0.14.0.1, compressed-tensors 0.19.0
and this package. ``datasets`` is not needed: if it cannot be imported (e.g. no
``pyarrow``), an empty stand-in is registered so llm-compressor's package imports.

    python benchmarks/gpu_k3_layer.py --device cuda [--tokens 4096] [--seq 512]
    python benchmarks/gpu_k3_layer.py --small            # CPU when no GPU
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "helpers"))  # the synthetic MXFP4 checkpoint writer
import paths  # noqa: E402,F401  (tests/helpers and tests/oracles by name)


def _stand_in(name: str) -> types.ModuleType:
    """A module whose every attribute is a fresh empty class (imports and type hints
    of llm-compressor's data code resolve; nothing here calls them)."""

    class StandIn(types.ModuleType):
        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            value = type(attr, (), {})
            setattr(self, attr, value)
            return value

    module = StandIn(name)
    module.__path__ = []  # a package: submodules resolve through the finder below
    module.__version__ = "0.0.0"
    return module


class _StandInFinder:
    """Serves stand-ins for ``datasets`` and its submodules."""

    def __init__(self, roots: set[str]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in self.roots:
            import importlib.machinery

            return importlib.machinery.ModuleSpec(fullname, self)
        return None

    def create_module(self, spec):
        return _stand_in(spec.name)

    def exec_module(self, module):
        pass


def prepare_imports(simulate_missing: list[str]) -> list[str]:
    """Stand in for ``datasets`` when it cannot be imported; returns what was stood in."""
    blocked = set(simulate_missing)
    missing = []
    for name in ("datasets",):
        try:
            if name in blocked:
                raise ImportError(f"{name} (simulated missing)")
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - any import failure: stand in
            for key in [k for k in sys.modules if k.split(".")[0] == name]:
                del sys.modules[key]
            missing.append(name)
    if missing:
        sys.meta_path.insert(0, _StandInFinder(set(missing)))
    return missing


def shapes(small: bool):
    from k3_mxfp4_synth import K3Shape

    if small:
        return K3Shape(
            hidden=256,
            latent=128,
            inter=128,
            experts=64,
            top_k=8,
            moe_layers=1,
            dense_layers=1,
            vocab=512,
            n_group=1,
            topk_group=1,
        )
    return K3Shape(
        hidden=7168,
        latent=3584,
        inter=2048,
        experts=896,
        top_k=16,
        moe_layers=1,
        dense_layers=1,
        vocab=512,
        n_group=1,
        topk_group=1,
    )


def load(path: Path, packed: bool, device: str):
    """The checkpoint on ``device``, packed, or decompressed there by compressed-tensors'
    own decompress-on-first-forward hook (fast on a GPU; on load it runs on the CPU)."""
    import torch
    from llmcompressor.modeling.kimi_k3.modeling_kimi_k3 import KimiK3ForConditionalGeneration
    from transformers.utils.quantization_config import CompressedTensorsConfig

    model = KimiK3ForConditionalGeneration.from_pretrained(
        str(path),
        dtype=torch.bfloat16,
        quantization_config=CompressedTensorsConfig(dequantize=False),
    ).eval()
    model = model.to(device)
    if not packed:
        handle = model.ct_decompress_hook
        model._forward_pre_hooks[handle.id](model, ())
        handle.remove()
    return model


class Timer:
    def __init__(self, device: str):
        import torch

        self.cuda = device.startswith("cuda")
        self.torch = torch

    def __call__(self, fn) -> float:
        if self.cuda:
            start = self.torch.cuda.Event(enable_timing=True)
            end = self.torch.cuda.Event(enable_timing=True)
            self.torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            self.torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start


#: bf16 dense tensor-core peak (TFLOP/s) and HBM bandwidth (GB/s), by device name
PEAKS = {
    "H200": (989.0, 4800.0),
    "H100 PCIe": (756.0, 2000.0),
    "H100 NVL": (835.0, 3900.0),
    "H100": (989.0, 3350.0),  # SXM
}


def device_peaks(name: str) -> tuple[float, float] | None:
    """``(TFLOP/s, GB/s)`` of a known GPU name, else None."""
    for key, peaks in PEAKS.items():  # the most specific name first
        if key in name:
            return peaks
    return None


def roofline_seconds(shape, tokens: int, tflops: float, gbs: float) -> dict:
    """Lower bound of one MoE layer's forward over ``tokens`` tokens (bf16): routed
    experts (gate, up, down in the latent space), the shared expert and the latent
    projections (hidden space), the router; bytes: every expert that can receive a
    token read once (activations are small beside them)."""
    h, lat, inter, e, k = shape.hidden, shape.latent, shape.inter, shape.experts, shape.top_k
    flops = 2 * tokens * (k * 3 * lat * inter + 3 * h * inter + 2 * h * lat + h * e)
    touched = min(e, tokens * k)
    weight_bytes = 2 * (touched * 3 * lat * inter + 3 * h * inter + 2 * h * lat + h * e)
    memory = weight_bytes / (gbs * 1e9)
    compute = flops / (tflops * 1e12)
    return {"flops": flops, "bytes": weight_bytes, "memory_s": memory, "compute_s": compute}


def observer_on(model, grouped: bool = True):
    from reap_modifier.calibration.observer import SaliencyObserver
    from reap_modifier.models import find_moe_architecture

    handles: list = []

    def register(module, fn, hook_type, **kwargs):
        handles.append(getattr(module, f"register_{hook_type}_hook")(fn, **kwargs))

    observer = SaliencyObserver(find_moe_architecture(model), register, grouped=grouped)
    observer.attach()

    def off():
        observer.detach()
        for h in handles:
            h.remove()

    return off


def grouped_on(block):
    """The block on the grouped dispatch with its stacked experts built once, nothing
    recorded; returns (run over batches, the dispatch path that ran)."""

    from reap_modifier.calibration.kimi_grouped import (
        combine_slots,
        routed_slot_outputs,
        stack_kimi_experts,
    )

    stack = stack_kimi_experts(block.experts)

    def moe_infer(x, ids, weights):
        return combine_slots(routed_slot_outputs(block, x, ids, stack), weights)

    def run(batches):
        block.moe_infer = moe_infer
        try:
            run_pass(block, batches)
        finally:
            del block.moe_infer

    return run, ("grouped_mm" if stack is not None else "per-expert loop")


def moe_block(model):
    from reap_modifier.models import find_moe_architecture

    (layer,) = find_moe_architecture(model).layers
    return layer.block


def run_pass(block, batches):
    import torch

    with torch.no_grad():
        for x in batches:
            block(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default=None, help="default: cuda if present, else cpu")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak")
    parser.add_argument("--bandwidth-gbs", type=float, default=None, help="memory GB/s")
    parser.add_argument("--small", action="store_true", help="a small shape (CPU check)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where to write the checkpoint")
    parser.add_argument("--simulate-missing", default="", help="e.g. datasets (to test)")
    parser.add_argument("--skip-packed", action="store_true", help="dense variants only")
    args = parser.parse_args()

    stood_in = prepare_imports([m for m in args.simulate_missing.split(",") if m])
    import torch
    from k3_mxfp4_synth import write_k3_mxfp4

    from reap_modifier.calibration.kimi_grouped import stack_kimi_experts

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    shape = shapes(args.small)
    tmp = tempfile.TemporaryDirectory(dir=args.workdir)
    path = Path(tmp.name) / "k3-layer"
    t0 = time.perf_counter()
    sizes = write_k3_mxfp4(path, shape)
    print(f"checkpoint written in {time.perf_counter() - t0:.0f} s: {sizes}", flush=True)

    gen = torch.Generator().manual_seed(0)
    n = max(1, args.tokens // args.seq)
    batches = [
        (torch.randn(1, args.seq, shape.hidden, generator=gen) * 0.5)
        .to(torch.bfloat16)
        .to(args.device)
        for _ in range(n)
    ]
    timer = Timer(args.device)
    results: dict[str, list[float]] = {}

    dense = load(path, packed=False, device=args.device)
    block = moe_block(dense)
    run_pass(block, batches[:1])  # warm-up

    class Observed:
        """REAP's observer attached before the timed pass, with one batch through it
        (which builds the grouped dispatch's stacked experts), detached after it: the
        timed pass is a layer's calibration in its steady state."""

        def __init__(self, grouped: bool):
            self.grouped = grouped
            self.off = None

        def setup(self):
            self.off = observer_on(dense, grouped=self.grouped)
            run_pass(block, batches[:1])

        def __call__(self):
            run_pass(block, batches)

        def teardown(self):
            self.off()

    grouped_run, grouped_path = grouped_on(block)
    grouped_run(batches[:1])  # warm-up
    print(f"grouped dispatch on {args.device}: {grouped_path}", flush=True)
    stack_s = timer(lambda: stack_kimi_experts(block.experts))

    packed_model = load(path, packed=True, device=args.device)
    packed_block = moe_block(packed_model)

    def packed(granularity):
        from reap_modifier.calibration.packed import PackedCompute

        def go():
            off = observer_on(packed_model)
            compute = PackedCompute(packed_model, granularity)
            compute.attach()
            try:
                run_pass(packed_block, batches)
            finally:
                compute.detach()
                off()

        return go

    variants = {
        "plain": lambda: run_pass(block, batches),
        "grouped": lambda: grouped_run(batches),
        "observer": Observed(True),
        "observer/loop": Observed(False),
        "packed": packed("layer"),
        "packed/expert": packed("expert"),
    }
    if args.skip_packed:
        del variants["packed"], variants["packed/expert"]
    if not args.skip_packed:
        packed("layer")()  # warm-up of the packed path (decompressor, kernels)
    for _ in range(args.repeats):
        for name, fn in variants.items():
            if hasattr(fn, "setup"):
                fn.setup()
            try:
                results.setdefault(name, []).append(timer(fn))
            finally:
                if hasattr(fn, "teardown"):
                    fn.teardown()
            print(f"  {name}: {results[name][-1]:.3f} s", flush=True)

    tokens = n * args.seq
    plain = statistics.median(results["plain"])
    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(
        f"\nOne K3-shaped MoE layer ({shape.experts} experts, top-{shape.top_k}, hidden "
        f"{shape.hidden}, latent {shape.latent}, expert inter {shape.inter}), {tokens} tokens "
        f"({n} x {args.seq}), median of {args.repeats}, {gpu}; torch {torch.__version__}"
        + (f"; stood in: {', '.join(stood_in)}" if stood_in else "")
    )
    medians = {name: statistics.median(ts) for name, ts in results.items()}
    bound = roofline_bound(shape, tokens, gpu, args)
    print(
        f"grouped dispatch: {grouped_path}; stacking the layer's experts (once per layer "
        f"and calibration, not in the passes below): {stack_s:.3f} s"
    )
    print(
        f"{'variant':<16} {'seconds':>9} {'tokens/s':>11} {'x plain':>8} {'x grouped':>10}"
        f" {'roofline':>9}"
    )
    for name, s in medians.items():
        frac = f"{bound / s:9.1%}" if bound else f"{'-':>9}"
        print(
            f"{name:<16} {s:9.3f} {tokens / s:11.0f} {s / plain:8.2f} "
            f"{s / medians['grouped']:10.2f} {frac}"
        )
    print(
        f"observer ratio: {medians['observer'] / medians['grouped']:.2f}x its plain forward "
        f"(grouped dispatch); previous path {medians['observer/loop'] / plain:.2f}x "
        "(observer/loop over plain)"
    )
    print_roofline(shape, tokens, plain, gpu, args)
    tmp.cleanup()


def roofline_bound(shape, tokens: int, device_name: str, args) -> float | None:
    """The roofline time in seconds, or None where the peaks are not known."""
    known = device_peaks(device_name) if args.device.startswith("cuda") else None
    tflops = args.peak_tflops or (known[0] if known else None)
    gbs = args.bandwidth_gbs or (known[1] if known else None)
    if tflops is None or gbs is None:
        return None
    r = roofline_seconds(shape, tokens, tflops, gbs)
    return max(r["memory_s"], r["compute_s"])


def print_roofline(shape, tokens: int, plain: float, device_name: str, args) -> None:
    """The roofline line: measured ``plain`` against max(bytes / bandwidth, FLOPs / peak)."""
    known = device_peaks(device_name) if args.device.startswith("cuda") else None
    tflops = args.peak_tflops or (known[0] if known else None)
    gbs = args.bandwidth_gbs or (known[1] if known else None)
    if tflops is None or gbs is None:
        print(
            f"roofline: the peak FLOP/s and memory bandwidth of {device_name} cannot be "
            "known reliably (pass --peak-tflops and --bandwidth-gbs); measured only"
        )
        return
    r = roofline_seconds(shape, tokens, tflops, gbs)
    bound = max(r["memory_s"], r["compute_s"])
    which = "memory" if r["memory_s"] >= r["compute_s"] else "compute"
    print(
        f"roofline ({device_name}: {tflops:.0f} TFLOP/s bf16, {gbs:.0f} GB/s): "
        f"{r['bytes'] / 1e9:.2f} GB / bandwidth = {r['memory_s'] * 1e3:.2f} ms, "
        f"{r['flops'] / 1e12:.2f} TFLOP / peak = {r['compute_s'] * 1e3:.2f} ms -> "
        f"{which}-bound {bound * 1e3:.2f} ms; plain measured {plain * 1e3:.2f} ms = "
        f"{plain / bound:.1f}x the roofline ({bound / plain:.1%} of it)"
    )


if __name__ == "__main__":
    main()
