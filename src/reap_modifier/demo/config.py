"""What the main job runs: the corpora parts, the rankings of the flip table, the pruning
methods compared, and :class:`DemoConfig` (sizes, seeds, paths)."""

from __future__ import annotations

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


METHODS: tuple[Method, ...] = (
    Method("reap_en", "REAP(en)", "calibrated", "reap", "B", "en"),
    Method("reap_en_zh", "REAP(en+zh)", "calibrated", "reap", "C", "en+zh"),
    Method("reap_en_zh_code", "REAP(en+zh+code)", "calibrated", "reap", "D", "en+zh+code"),
    Method("frequency", "frequency", "calibrated", "frequency", "D", "en+zh+code"),
    Method("router_l1", "router_l1", "weights", "router_l1"),
    Method("router_signed_sum", "router_signed_sum", "weights", "router_signed_sum"),
    Method("random", "random", "weights", "random"),
)
#: also pruned at the extra (harsher) sparsity: the calibration-language question where the seed's
#: 75% build collapsed in Chinese, against random at the same sparsity
EXTRA_METHODS: tuple[str, ...] = ("reap_en", "reap_en_zh_code", "random")
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
    extra_sparsity: float | None = 0.75  # EXTRA_METHODS again at this sparsity (None: skip)
    tokens_per_part: int = 32768  # calibration tokens of each part (en1, en2, zh, code)
    calib_seq_len: int = 256
    eval_windows: int = 64  # per language
    eval_seq_len: int = 256
    eval_seed: int = 1234  # = the model card's window seed
    eval_chunk: int = 8
    prompts_per_lang: int = 8
    prompt_tokens: int = 16
    gen_tokens: int = 48
    seed: int = 0
    threads: int = 1
    #: compute dtype of calibration, evaluation and generation. The weights are bf16 / MXFP4 values,
    #: exact in float32; float32 is the default because torch's CPU bf16 matmul has no fast kernel
    #: without AVX-512 BF16 / AMX (75x slower than float32 on an AVX2 EPYC), and float32 results do
    #: not depend on which bf16 kernel a CPU has
    dtype: str = "float32"
    quick: bool = False


QUICK = dict(
    tokens_per_part=512,
    calib_seq_len=64,
    eval_windows=2,
    eval_seq_len=32,
    eval_chunk=2,
    prompts_per_lang=2,
    prompt_tokens=6,
    gen_tokens=6,
)


def job_methods(cfg: DemoConfig) -> list[Method]:
    """METHODS at the job's sparsity, then EXTRA_METHODS at ``extra_sparsity`` (named
    ``<name>_<percent>``, e.g. ``reap_en_75``)."""
    out = [Method(**{**asdict(m), "sparsity": cfg.sparsity}) for m in METHODS]
    if cfg.extra_sparsity is not None and cfg.extra_sparsity != cfg.sparsity:
        pct = round(100 * cfg.extra_sparsity)
        for m in METHODS:
            if m.name in EXTRA_METHODS:
                out.append(
                    Method(
                        **{
                            **asdict(m),
                            "name": f"{m.name}_{pct}",
                            "label": f"{m.label} {pct}%",
                            "sparsity": cfg.extra_sparsity,
                        }
                    )
                )
    return out
