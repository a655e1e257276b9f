"""What the main job runs: the corpora parts, the rankings of the flip table, the pruning
methods compared, and :class:`DemoConfig` (sizes, seeds, paths)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DEFAULT_MODEL = REPO / "models" / "tiny-k3-bilingual"
DEFAULT_OUT = Path("out") / "demo"

#: calibration runs: (part name, language / calibration_source label)
PARTS: tuple[tuple[str, str], ...] = (("en1", "en"), ("en2", "en"), ("zh", "zh"), ("code", "code"))
#: rankings of the flip table: label -> parts merged
RANKINGS: dict[str, tuple[str, ...]] = {
    "A": ("en1",),
    "B": ("en1", "en2"),
    "C": ("en1", "en2", "zh"),
    "D": ("en1", "en2", "zh", "code"),
}
LANGS: tuple[str, ...] = ("en", "zh", "code")
REFERENCE = "unpruned"


@dataclass(frozen=True)
class Method:
    name: str  # directory / key
    label: str  # table label
    kind: str  # "calibrated" or "weights"
    saliency: str
    ranking: str | None = None  # calibrated: which merged scores file (A..D)
    calibration: str = "none"
    sparsity: float | None = None  # None: the job's sparsity (50%)
    router_fit: bool = False  # REAP's cut, then ``calibrate_router`` on the calibration corpus


METHODS: tuple[Method, ...] = (
    Method("reap_en", "REAP(en)", "calibrated", "reap", "B", "en"),
    Method("reap_en_zh", "REAP(en+zh)", "calibrated", "reap", "C", "en+zh"),
    Method("reap_en_zh_code", "REAP(en+zh+code)", "calibrated", "reap", "D", "en+zh+code"),
    Method("frequency", "frequency", "calibrated", "frequency", "D", "en+zh+code"),
    Method("router_l1", "router_l1", "weights", "router_l1"),
    Method("router_signed_sum", "router_signed_sum", "weights", "router_signed_sum"),
    Method("random", "random", "weights", "random"),
    Method(
        "reap_en_fit", "REAP(en) + router fit", "calibrated", "reap", "B", "en", router_fit=True
    ),
    Method(
        "reap_en_zh_code_fit",
        "REAP(en+zh+code) + router fit",
        "calibrated",
        "reap",
        "D",
        "en+zh+code",
        router_fit=True,
    ),
)
#: the methods pruned at each extra sparsity (named ``<name>_<percent>``): at 75% (where the seed's
#: build collapsed in Chinese) every method; at 25% the calibration-language question against random
EXTRA_METHODS: dict[float, tuple[str, ...]] = {
    0.25: ("reap_en", "reap_en_zh", "reap_en_zh_code", "random"),
    0.75: tuple(m.name for m in METHODS),
}
#: calibration parts the router fit of each calibration mix draws on (``router_fit_tokens`` in all,
#: the same share of each part, so both mixes fit on the same number of tokens)
FIT_PARTS: dict[str, tuple[str, ...]] = {"en": ("en1", "en2"), "en+zh+code": ("en1", "zh", "code")}
YARDSTICK = "D"  # retained REAP mass of every plan is measured in this ranking's saliency
ABLATION = "no_routed"  # evaluation-only reference: every routed expert outputs zero
#: sparsities of the flip table (the seed: "the same pattern holds at 25% and 75% pruning")
FLIP_SPARSITIES = (0.25, 0.5, 0.75)


@dataclass
class DemoConfig:
    model: str = str(DEFAULT_MODEL)
    out: str = str(DEFAULT_OUT)
    data_dir: str | None = None  # None: the repository's data/ (built if missing)
    sparsity: float = 0.5
    extra_sparsities: tuple[float, ...] = (0.25, 0.75)  # EXTRA_METHODS at each of these too
    tokens_per_part: int = 32768  # calibration tokens of each part (en1, en2, zh, code)
    calib_seq_len: int = 256
    eval_windows: int = 64  # per language
    eval_seq_len: int = 256
    eval_seed: int = 1234  # = the model card's window seed
    eval_chunk: int = 8
    prompts_per_lang: int = 8
    router_fit_tokens: int = 12288  # per fit, split evenly over the mix's calibration parts
    router_fit_steps: int = 100
    router_fit_lr: float = 0.03
    prompt_tokens: int = 16
    gen_tokens: int = 48
    seed: int = 0
    threads: int = 0  # 0: chosen at start by :func:`choose_threads`
    #: compute dtype of calibration, evaluation and generation. The weights are bf16 / MXFP4 values,
    #: exact in float32; float32 is the default because torch's CPU bf16 matmul has no fast kernel
    #: without AVX-512 BF16 / AMX (75x slower than float32 on an AVX2 EPYC), and float32 results do
    #: not depend on which bf16 kernel a CPU has
    dtype: str = "float32"
    quick: bool = False


def choose_threads(requested: int = 0) -> tuple[int, str]:
    """The job's CPU thread count and why. ``requested`` > 0 is taken as given; 0 chooses:
    every core when the machine is otherwise idle (1-minute load average below half a core),
    else one thread.

    Why: torch's OpenMP threads spin at barriers waiting for each other. Beside another
    CPU-bound job a waiting thread burns its time slice while the thread it waits for is not
    running, so calibration on 2 threads took 4.1x its idle time where 1 thread took 1.4x;
    idle, 2 threads run the whole job in 0.76x the time of 1 (``benchmarks/thread_contention.py``,
    docs/benchmarks.md). ``OMP_WAIT_POLICY=PASSIVE`` avoids the collapse but costs 1.5x idle.
    The load is read once, at start: a job that others join later keeps its threads."""
    cores = os.cpu_count() or 1
    if requested > 0:
        return requested, f"{requested} CPU thread(s), as asked (--threads)"
    if cores == 1:
        return 1, "1 CPU thread: the machine has one core"
    load = os.getloadavg()[0]
    if load >= 0.5:
        return 1, (
            f"1 CPU thread: load average {load:.1f} on {cores} cores, other jobs share them "
            "(more threads would wait on each other; pass --threads N to override)"
        )
    return cores, f"{cores} CPU threads: the machine is idle (load average {load:.1f})"


QUICK = dict(
    tokens_per_part=512,
    calib_seq_len=64,
    eval_windows=2,
    eval_seq_len=32,
    eval_chunk=2,
    prompts_per_lang=2,
    prompt_tokens=6,
    gen_tokens=6,
    router_fit_tokens=192,
    router_fit_steps=3,
)


def job_methods(cfg: DemoConfig) -> list[Method]:
    """METHODS at the job's sparsity, then EXTRA_METHODS at each of ``extra_sparsities``
    (named ``<name>_<percent>``, e.g. ``reap_en_75``)."""
    out = [Method(**{**asdict(m), "sparsity": cfg.sparsity}) for m in METHODS]
    for sp in cfg.extra_sparsities:
        if sp == cfg.sparsity:
            continue
        pct = round(100 * sp)
        names = EXTRA_METHODS.get(sp, EXTRA_METHODS[0.75])  # another sparsity: every method
        for m in METHODS:
            if m.name in names:
                out.append(
                    Method(
                        **{
                            **asdict(m),
                            "name": f"{m.name}_{pct}",
                            "label": f"{m.label} {pct}%",
                            "sparsity": sp,
                        }
                    )
                )
    return out
