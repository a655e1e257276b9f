"""What the main job runs: the corpora parts, the rankings of the flip table, the pruning
methods compared (:data:`METHODS`, the one table of them), and :class:`DemoConfig` (sizes, seeds,
paths).

Adding a pruning method to the main job is one row of :data:`METHODS`. Every stage reads the
table: the pruning stage (:mod:`.prune`) cuts and verifies one checkpoint per row (and per extra
sparsity, unless the row's ``skip_sparsities`` names it), evaluation and generation run on every
checkpoint, the paired-difference tables (:func:`.results.paired_rows`) pair each row by its
``role``, and the report lists every row in table order. A row says:

- ``role="mix"``: a REAP calibration mix. Its ``ranking`` (one of :data:`RANKINGS`) names the merged
  scores it cuts from; consecutive mixes (in table order) are paired (the calibration-language
  ladder), and each is paired against :data:`HEADLINE_METHOD`.
- ``role="baseline"``: ranks without REAP saliency (``kind="weights"``: from the router weights by
  ``saliency``; ``kind="calibrated"``: another statistic of ``ranking``'s scores). Paired against
  :data:`HEADLINE_METHOD`, and the report lists where that method loses to it.
- ``role="fit"``: the cut of the mix ``fit_of``, then the post-cut components ``fit`` (router rows,
  score-correction bias, dense compensation) fitted on the mix's calibration parts
  (:data:`FIT_PARTS`, keyed by ``calibration``); paired against that cut (NLL and KL). A fit with
  ``groups`` is also paired against the fit that differs from it only in the selection's
  objective (:func:`objective_pairs`).

E.g. REAP on the Chinese part alone would need a ranking of that part in :data:`RANKINGS` and a row
``Method("reap_zh", "REAP(zh)", "calibrated", "reap", "ZH", "zh", role="mix")``."""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
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
    """One pruning method of the main job (a row of :data:`METHODS`; see the module docstring)."""

    name: str  # directory / key
    label: str  # table label
    kind: str  # "calibrated" or "weights"
    saliency: str
    ranking: str | None = None  # calibrated: which merged scores file (A..D)
    calibration: str = "none"
    sparsity: float | None = None  # None: the job's sparsity (50%)
    role: str = "baseline"  # "mix", "baseline" or "fit"
    fit_of: str | None = None  # fit: the cut whose routers it fits (``calibrate_router``)
    #: fit: the post-cut components (``router``: ``calibrate_router``, ``bias``:
    #: ``calibrate_bias``, ``dense``: ``compensate``), each kept only where it lowers the KL on
    #: held-out calibration batches
    fit: tuple[str, ...] = ("router",)
    #: fit: ``"block_error"`` re-chooses the kept experts of ``fit_of``'s keep count by the block's
    #: re-routed output error before the fit (``selection: block_error``), REAP ordering candidates
    selection: str = "saliency"
    #: fit: the block-error selection minimises the worst language's error (the fit's dataset
    #: carries each sample's language: ``selection_groups``) instead of the pooled one
    groups: bool = False
    #: extra sparsities this method is not pruned at (at the job's sparsity every method is)
    skip_sparsities: tuple[float, ...] = ()

    @property
    def router_fit(self) -> bool:
        """REAP's cut, then ``calibrate_router`` on the calibration corpus."""
        return self.role == "fit"


#: at 75% (where the seed's build collapsed in Chinese) every method is pruned too; at 25% only
#: the calibration-language question against random
_NOT_AT_25 = (0.25,)
METHODS: tuple[Method, ...] = (
    Method("reap_en", "REAP(en)", "calibrated", "reap", "B", "en", role="mix"),
    Method("reap_en_zh", "REAP(en+zh)", "calibrated", "reap", "C", "en+zh", role="mix"),
    Method(
        "reap_en_zh_code", "REAP(en+zh+code)", "calibrated", "reap", "D", "en+zh+code", role="mix"
    ),
    Method(
        "frequency", "frequency", "calibrated", "frequency", "D", "en+zh+code",
        skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "ean", "EAN", "calibrated", "ean", "D", "en+zh+code", skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "ean_mean", "MAN (ean_mean)", "calibrated", "ean_mean", "D", "en+zh+code",
        skip_sparsities=_NOT_AT_25,
    ),
    Method("router_l1", "router_l1", "weights", "router_l1", skip_sparsities=_NOT_AT_25),
    Method(
        "router_signed_sum", "router_signed_sum", "weights", "router_signed_sum",
        skip_sparsities=_NOT_AT_25,
    ),
    Method("random", "random", "weights", "random"),
    Method(
        "reap_en_fit", "REAP(en) + router fit", "calibrated", "reap", "B", "en",
        role="fit", fit_of="reap_en", skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "reap_en_zh_code_fit", "REAP(en+zh+code) + router fit", "calibrated", "reap", "D",
        "en+zh+code", role="fit", fit_of="reap_en_zh_code", skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "reap_en_comp", "REAP(en) + compensation", "calibrated", "reap", "B", "en",
        role="fit", fit_of="reap_en", fit=("router", "dense"), skip_sparsities=(0.25, 0.75),
    ),
    Method(
        "reap_en_zh_code_comp", "REAP(en+zh+code) + compensation", "calibrated", "reap", "D",
        "en+zh+code", role="fit", fit_of="reap_en_zh_code", fit=("router", "dense"),
        skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "block_error_comp", "block-error selection + compensation", "calibrated", "reap", "D",
        "en+zh+code", role="fit", fit_of="reap_en_zh_code", fit=("router", "bias", "dense"),
        selection="block_error", skip_sparsities=_NOT_AT_25,
    ),
    Method(
        "block_error_lang_comp", "worst-language block-error selection + compensation",
        "calibrated", "reap", "D", "en+zh+code", role="fit", fit_of="reap_en_zh_code",
        fit=("router", "bias", "dense"), selection="block_error", groups=True,
        skip_sparsities=_NOT_AT_25,
    ),
)  # fmt: skip
#: the method every other is compared against (paired differences, overlap, the report's losses)
HEADLINE_METHOD = "reap_en_zh_code"
#: the best of ours: every baseline is paired against it (NLL and KL). Chosen on the job's own
#: tables; a choice to revisit is made with ``--split dev`` (the development split), never on the
#: evaluation windows the final tables report
BEST_METHOD = "block_error_comp"
#: the methods that rank without REAP saliency
BASELINES: tuple[str, ...] = tuple(m.name for m in METHODS if m.role == "baseline")
#: calibration parts the router fit of each calibration mix draws on (``router_fit_tokens`` in all,
#: the same share of each part, so both mixes fit on the same number of tokens)
FIT_PARTS: dict[str, tuple[str, ...]] = {"en": ("en1", "en2"), "en+zh+code": ("en1", "zh", "code")}
YARDSTICK = "D"  # retained REAP mass of every plan is measured in this ranking's saliency
ABLATION = "no_routed"  # evaluation-only reference: every routed expert outputs zero
#: sparsities of the flip table (the seed: "the same pattern holds at 25% and 75% pruning")
FLIP_SPARSITIES = (0.25, 0.5, 0.75)
#: pairs of the flip table, in order: the noise floor, +zh, +code, +zh+code
FLIP_PAIRS = (("A", "B"), ("B", "C"), ("C", "D"), ("B", "D"))


def objective_pairs() -> list[tuple[str, str]]:
    """``(pooled, worst_language)``: each fit of :data:`METHODS` with ``groups`` (the block-error
    selection minimising the worst language's error) and the fit that differs from it only in
    minimising the pooled error."""
    return [
        (p.name, m.name)
        for m in METHODS
        if m.groups
        for p in METHODS
        if p.role == "fit"
        and not p.groups
        and replace(p, name=m.name, label=m.label, groups=True) == m
    ]


@dataclass
class DemoConfig:
    model: str = str(DEFAULT_MODEL)
    out: str = str(DEFAULT_OUT)
    data_dir: str | None = None  # None: the repository's data/ (built if missing)
    sparsity: float = 0.5
    #: METHODS at each of these too (those whose ``skip_sparsities`` do not name it)
    extra_sparsities: tuple[float, ...] = (0.25, 0.75)
    tokens_per_part: int = 32768  # calibration tokens of each part (en1, en2, zh, code)
    calib_seq_len: int = 256
    eval_windows: int = 64  # per language
    eval_seq_len: int = 256
    eval_seed: int = 1234  # = the model card's window seed
    #: the windows the quality tables measure: ``"eval"``, the evaluation windows
    #: (:func:`.data.eval_windows`), or ``"dev"``, as many of the development split's
    #: (:func:`.data.dev_windows`: the eval split's paragraphs those evaluation windows never
    #: read), for choosing methods and settings
    split: str = "eval"
    dev_seed: int = 4242
    eval_chunk: int = 8
    prompts_per_lang: int = 8
    router_fit_tokens: int = 12288  # per fit, split evenly over the mix's calibration parts
    router_fit_steps: int = 100
    router_fit_lr: float = 0.03
    compensation_steps: int = 200
    compensation_lr: float = 0.003
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
    router_fit_tokens=384,
    router_fit_steps=3,
    compensation_steps=3,
)


def method_base(name: str) -> str:
    """The :data:`METHODS` name of a job method's name (``reap_en_75`` -> ``reap_en``)."""
    head, _, tail = name.rpartition("_")
    return head if tail.isdigit() else name


def at_sparsity(m: Method, sparsity: float, suffix: str = "") -> Method:
    """``m`` at ``sparsity``, its names (and the cut it fits) suffixed by ``suffix``."""
    tag = f" {suffix[1:]}%" if suffix else ""
    return replace(
        m,
        name=m.name + suffix,
        label=m.label + tag,
        sparsity=sparsity,
        fit_of=m.fit_of + suffix if m.fit_of else None,
    )


def job_methods(cfg: DemoConfig) -> list[Method]:
    """METHODS at the job's sparsity, then at each of ``extra_sparsities`` every method whose
    ``skip_sparsities`` do not name it (named ``<name>_<percent>``, e.g. ``reap_en_75``)."""
    out = [at_sparsity(m, cfg.sparsity) for m in METHODS]
    for sp in cfg.extra_sparsities:
        if sp == cfg.sparsity:
            continue
        out += [
            at_sparsity(m, sp, f"_{round(100 * sp)}")
            for m in METHODS
            if sp not in m.skip_sparsities
        ]
    return out
