"""The main job's ``results.json`` read back as typed records (:func:`read_results`), built once
and read by every section of the report (:mod:`.report`)."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ABLATION, LANGS, REFERENCE


@dataclass(frozen=True)
class RunInfo:
    """How the job ran: command, time, sizes of evaluation and generation, timing, versions."""

    command: str | None
    created: str
    sparsity: float
    quick: bool
    threads: int
    windows_per_lang: int
    seq_len: int
    eval_seed: int
    #: ``"eval"``: the evaluation windows; ``"dev"``: the development split's
    split: str
    prompts_per_lang: int
    prompt_tokens: int
    new_tokens: int
    timing: dict[str, float]
    versions: dict[str, str]


@dataclass(frozen=True)
class ModelCard:
    """The bundled model card's held-out NLL, whether the job used its windows, its corpora."""

    loss: dict[str, float]
    same_windows: bool
    corpora: dict | None


@dataclass(frozen=True)
class ModelInfo:
    """The model pruned, and the folder the rewriter read it through."""

    path: str
    model_class: str | None
    top_k: int | None
    num_experts: int
    moe_layers: int
    checkpoint_source: str
    left_out: list[str]
    card: ModelCard | None


@dataclass(frozen=True)
class CalibrationRun:
    """One ``oneshot`` calibration run (one corpus part)."""

    part: str
    source: str
    tokens: int
    rows: int
    source_tokens: dict[str, int]
    seconds: float


@dataclass(frozen=True)
class PackedCheck:
    """A part calibrated again on the decompressed model: the largest relative difference."""

    part: str
    max_rel: float
    statistics: int
    tolerance: float


@dataclass(frozen=True)
class MergedRanking:
    """A ranking of the flip table: the parts merged and their tokens per source."""

    label: str
    parts: list[str]
    tokens: dict[str, int]


@dataclass(frozen=True)
class RankingMass:
    """A ranking's retained REAP mass under its own plan."""

    label: str
    corpus: str
    retained_mass: float


@dataclass(frozen=True)
class FlipSetup:
    """Where the flip table cuts: ``keep`` of ``num_experts`` in each of ``num_layers``; promoted
    experts count as zh- (code-) heavy when routed ``threshold`` x more often than by en."""

    keep: int
    num_experts: int
    num_layers: int
    threshold: float


@dataclass(frozen=True)
class Tier:
    """The retained REAP(en+zh+code) mass when keeping ``keep`` experts."""

    keep: int
    pruned_fraction: float
    retained_mass_mean: float


@dataclass(frozen=True)
class Prompt:
    """A generation prompt."""

    source: str
    text: str


@dataclass(frozen=True)
class Diff:
    """A paired per-window difference: mean and standard error."""

    mean: float
    se: float | None


@dataclass(frozen=True)
class LangQuality:
    """One model on one language's held-out windows."""

    nll: float
    ppl: float
    kl: float | None
    top1: float | None


@dataclass(frozen=True)
class Repeats:
    """One model's longest repeat runs over the prompts of one language."""

    max_tokens: int
    max_chars: int
    mean_tokens: float


@dataclass(frozen=True)
class Decision:
    """One post-cut keep / drop on the held-out calibration batches: the whole model's KL to
    the unpruned model before and after the change, the paired change and its standard error."""

    name: str
    kept: bool
    kl_before: float
    kl_after: float
    change: float
    se: float


@dataclass(frozen=True)
class RouterFit:
    """A router-fit checkpoint's fit: tokens, and each layer's held-out error before / after."""

    #: the fit's calibration tokens, the held-out batches (which decide each component's
    #: keep / drop) included
    tokens: int
    holdout: tuple[tuple[float, float], ...]
    #: the post-cut components, each ``"<name> kept"`` or ``"<name> dropped"``
    components: tuple[str, ...] = ()
    #: tokens of the held-out batches (0 when nothing was held out)
    held_out: int = 0
    #: each component's held-out decision, in the order the step ran them
    decisions: tuple[Decision, ...] = ()
    #: the block-error selection against REAP's cut on the held-out batches (None: no
    #: selection, or a run that predates the check)
    selection: Decision | None = None

    @property
    def fitted(self) -> int:
        """The tokens the components were fitted on: :attr:`tokens` less the held-out batches."""
        return self.tokens - self.held_out

    @property
    def kept(self) -> str:
        """The kept components, e.g. ``router + dense`` (``none`` when every one was dropped)."""
        names = [c.split()[0] for c in self.components if c.endswith(" kept")]
        if not self.components:
            return "router"
        return " + ".join(names) or "none"


@dataclass(frozen=True)
class Checkpoint:
    """One pruning method's checkpoint (an entry of ``results.json``'s ``pruning``)."""

    name: str
    label: str
    sparsity: float
    plan: str
    path: str
    experts_before: int
    experts_after: int
    reap_mass_d: float
    overlap: float | None
    verify_ok: bool
    tensors: int | None
    tensors_matching_source: int | None
    quantization_format: list[str]
    bytes: int
    seconds: float
    fit: RouterFit | None


@dataclass(frozen=True)
class ModelRow:
    """One evaluated model: the unpruned reference, a pruned checkpoint, or the ablation."""

    name: str
    label: str
    quality: dict[str, LangQuality]
    repeats: dict[str, Repeats]
    pruned: Checkpoint | None


@dataclass(frozen=True)
class PairedRow:
    """A paired difference, second (``b``) minus first (``a``), per language; KL where fitted."""

    a: str
    b: str
    nll: dict[str, Diff]
    kl: dict[str, Diff] | None


@dataclass(frozen=True)
class FlipPair:
    """One pair of rankings of the flip table at the job's sparsity."""

    earlier: str
    later: str
    change: str
    tokens_added: dict[str, int]
    flips: int
    pct_of_kept_slots: float
    x_first_pair: float | None
    zh_heavy: tuple[float, float] | None  # promoted, all
    code_heavy: tuple[float, float] | None
    mass_under_later_plan: float | None
    mass_own: float | None
    support_en: dict


@dataclass(frozen=True)
class FlipCell:
    """One pair of the flip table at one cut point."""

    flips: int
    pct_of_kept_slots: float
    promoted_zh_heavy: float | None
    all_zh_heavy: float | None


@dataclass(frozen=True)
class CutPoint:
    """The flip table's pairs at one sparsity."""

    sparsity: float
    keep: int
    kept_slots: int
    pairs: dict[str, FlipCell]


@dataclass(frozen=True)
class Generation:
    """One greedy continuation."""

    lang: str
    prompt: int
    text: str
    repeat_run_tokens: int


@dataclass(frozen=True)
class Results:
    """Everything the report shows, read once from ``results.json``."""

    run: RunInfo
    model_info: ModelInfo
    calibration_runs: tuple[CalibrationRun, ...]
    packed_check: PackedCheck | None
    rankings: tuple[MergedRanking, ...]
    models: tuple[ModelRow, ...]  # in report order: unpruned, each method, the ablation
    paired: tuple[PairedRow, ...]
    flip_setup: FlipSetup
    ranking_masses: tuple[RankingMass, ...]
    flip_pairs: tuple[FlipPair, ...]
    cut_points: tuple[CutPoint, ...]
    tiers: tuple[Tier, ...]
    prompts: dict[str, tuple[Prompt, ...]]
    generations: dict[str, tuple[Generation, ...]]

    @property
    def pruned(self) -> list[Checkpoint]:
        """The pruned checkpoints, in the job's method order."""
        return [m.pruned for m in self.models if m.pruned is not None]

    def model(self, name: str) -> ModelRow:
        """The model ``name``."""
        return next(m for m in self.models if m.name == name)

    def label(self, name: str) -> str:
        """The table label of model ``name``."""
        return self.model(name).label


def _diff(d: dict) -> Diff:
    return Diff(d["mean"], d["se"])


def _selection_decision(e2e: dict | None) -> Decision | None:
    """The selection's end-to-end check as a :class:`Decision` (before: REAP's cut)."""
    if not e2e or not e2e.get("checked"):
        return None
    return Decision(
        "selection",
        e2e["applied"] == "block_error",
        e2e["kl_ranking_cut"],
        e2e["kl_selection"],
        e2e["change"],
        e2e["se"],
    )


def _checkpoint(name: str, r: dict) -> Checkpoint:
    v, fit = r["verify"], r.get("router_fit")
    return Checkpoint(
        name=name,
        label=r["label"],
        sparsity=r["sparsity"],
        plan=r["plan"],
        path=r["checkpoint"],
        experts_before=r["num_experts_before"],
        experts_after=r["num_experts_after"],
        reap_mass_d=r["retained_reap_mass_D"],
        overlap=r.get("overlap_with_reap_en_zh_code"),
        verify_ok=v["ok"],
        tensors=v.get("tensors"),
        tensors_matching_source=v.get("tensors_matching_source"),
        quantization_format=v.get("quantization_format") or [],
        bytes=r["bytes"],
        seconds=r["seconds"],
        fit=RouterFit(
            fit["tokens"],
            tuple(
                (x["holdout_before"], x["holdout_after"])
                for x in fit["layers"].values()
                if "holdout_before" in x
            ),
            tuple(
                f"{c['name']} {'kept' if c['kept'] else 'dropped'}"
                for c in fit.get("components", [])
            ),
            (fit.get("validation") or {}).get("tokens", 0),
            tuple(
                Decision(c["name"], c["kept"], c["kl_before"], c["kl_after"], c["change"], c["se"])
                for c in fit.get("components", [])
                if "kl_before" in c and "se" in c
            ),
            _selection_decision((fit.get("selection") or {}).get("end_to_end")),
        )
        if fit
        else None,
    )


def _model(results: dict, name: str) -> ModelRow:
    q, gs = results["eval"]["quality"][name], results["generations"]["summary"][name]
    pr = results["pruning"].get(name)
    label = {REFERENCE: "unpruned", ABLATION: "no routed experts (reference)"}.get(name)
    return ModelRow(
        name=name,
        label=label or pr["label"],
        quality={
            l: LangQuality(q[l]["nll"], q[l]["ppl"], q[l].get("kl"), q[l].get("top1_agreement"))
            for l in LANGS
        },
        repeats={
            l: Repeats(
                gs[l]["max_repeat_run_tokens"],
                gs[l]["max_repeat_run_chars"],
                gs[l]["mean_repeat_run_tokens"],
            )
            for l in LANGS
        },
        pruned=_checkpoint(name, pr) if pr is not None else None,
    )


def _routing(pair: dict, b: str) -> tuple[float, float] | None:
    r = next((r for r in pair["routing"] if r["a"] == "en" and r["b"] == b), None)
    return (r["promoted_frac_more_by_b"], r["all_frac_more_by_b"]) if r else None


def _flip_pair(p: dict) -> FlipPair:
    mass = p.get("mass") or {}
    return FlipPair(
        earlier=p["earlier"],
        later=p["later"],
        change=p["change"],
        tokens_added=p["tokens_added"],
        flips=p["flips"],
        pct_of_kept_slots=p["pct_of_kept_slots"],
        x_first_pair=p["x_first_pair"],
        zh_heavy=_routing(p, "zh"),
        code_heavy=_routing(p, "code"),
        mass_under_later_plan=mass.get("earlier_saliency_under_later_plan"),
        mass_own=mass.get("own_earlier"),
        support_en=(p.get("support") or {}).get("rate@en", {}).get("promoted", {}),
    )


def _cut_point(sparsity: str, f: dict) -> CutPoint:
    return CutPoint(
        sparsity=float(sparsity),
        keep=f["keep"],
        kept_slots=f["kept_slots"],
        pairs={
            k: FlipCell(
                r["flips"], r["pct_of_kept_slots"], r["promoted_zh_heavy"], r["all_zh_heavy"]
            )
            for k, r in f["pairs"].items()
        },
    )


def _run_info(results: dict) -> RunInfo:
    cfg, ev = results["config"], results["eval"]
    return RunInfo(
        command=results.get("command"),
        created=results["created"],
        sparsity=cfg["sparsity"],
        quick=cfg["quick"],
        threads=cfg["threads"],
        windows_per_lang=ev["windows_per_lang"],
        seq_len=ev["seq_len"],
        eval_seed=ev["seed"],
        split=ev.get("split", "eval"),
        prompts_per_lang=cfg["prompts_per_lang"],
        prompt_tokens=cfg["prompt_tokens"],
        new_tokens=results["generations"]["new_tokens"],
        timing=results["timing"],
        versions=results["versions"],
    )


def _model_info(results: dict) -> ModelInfo:
    mdl, card = results["model"], results["model"].get("model_card")
    return ModelInfo(
        path=mdl["path"],
        model_class=mdl["model_class"],
        top_k=mdl["top_k"],
        num_experts=mdl["num_experts"],
        moe_layers=len(mdl["moe_layers"]),
        checkpoint_source=mdl.get("checkpoint_source"),
        left_out=mdl.get("left_out_of_checkpoint_source") or [],
        card=ModelCard(card["loss"], bool(card.get("same_windows")), card.get("corpora"))
        if card and card.get("loss")
        else None,
    )


def read_results(results: dict) -> Results:
    """The typed records of a ``results.json`` document."""
    quality, calibration, cmp = (
        results["eval"]["quality"],
        results["calibration"],
        results["compare"],
    )
    order = [REFERENCE, *results["pruning"], *(n for n in (ABLATION,) if n in quality)]
    pc = calibration.get("packed_check")
    return Results(
        run=_run_info(results),
        model_info=_model_info(results),
        calibration_runs=tuple(
            CalibrationRun(
                r["part"], r["source"], r["tokens"], r["rows"], r["source_tokens"], r["seconds"]
            )
            for r in calibration["runs"]
        ),
        packed_check=PackedCheck(pc["part"], pc["max_rel"], pc["statistics"], pc["tolerance"])
        if pc
        else None,
        rankings=tuple(
            MergedRanking(label, r["parts"], r["tokens"])
            for label, r in calibration["rankings"].items()
        ),
        models=tuple(_model(results, n) for n in order),
        paired=tuple(
            PairedRow(
                p["a"],
                p["b"],
                {l: _diff(p[l]) for l in LANGS},
                {l: _diff(p["kl"][l]) for l in LANGS} if "kl" in p else None,
            )
            for p in results["paired"]
        ),
        flip_setup=FlipSetup(cmp["keep"], cmp["num_experts"], cmp["num_layers"], cmp["threshold"]),
        ranking_masses=tuple(
            RankingMass(r["label"], r["corpus"], r["retained_mass"]) for r in cmp["rankings"]
        ),
        flip_pairs=tuple(_flip_pair(p) for p in cmp["pairs"]),
        cut_points=tuple(
            _cut_point(sp, f) for sp, f in (results.get("flips_by_sparsity") or {}).items()
        ),
        tiers=tuple(
            Tier(t["keep"], t["pruned_fraction"], t["retained_mass_mean"])
            for t in results["tiers"]["rows"] or []
        ),
        prompts={
            lang: tuple(Prompt(p["source"], p["text"]) for p in ps)
            for lang, ps in results["generations"]["prompts"].items()
        },
        generations={
            name: tuple(
                Generation(r["lang"], r["prompt"], r["text"], r["repeat_run_tokens"]) for r in rows
            )
            for name, rows in results["generations"]["by_model"].items()
        },
    )
