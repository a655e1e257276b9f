"""The transformers backend: every model in this process, exact, streaming.

For each chunk of windows the reference runs first, then every other model; the reference's
logits are compared with each model's and dropped, so no model's logits are ever held for more
than one chunk (:func:`evaluate_models`). With a cached reference (top-N log-probs from an
earlier run, :mod:`.cache`) the reference does not run at all: NLL and top-1 agreement stay
exact, KL becomes the top-N estimate of :func:`~.metrics.topn_kl`.

:func:`greedy_generate` re-runs the whole sequence each step (no KV cache: exact and
model-agnostic; an end-of-text token is just another token, as with vLLM's ``ignore_eos``).
:func:`zero_routed_experts` is the "no routed experts at all" ablation the main job reports.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .metrics import WindowMetrics, token_metrics, topn_kl

__all__ = [
    "ReferenceTopN",
    "evaluate_models",
    "greedy_generate",
    "input_device",
    "run_models",
    "zero_routed_experts",
]


class ReferenceTopN:
    """The reference's output on one set of windows, as a cache keeps it: per-window NLL sums and
    predicted positions, and at every predicted position its top-N token ids and log-probs
    (sorted, best first: ``top_ids[..., 0]`` is its argmax)."""

    def __init__(self, nll, n, top_ids: torch.Tensor, top_lp: torch.Tensor):
        self.nll = [float(v) for v in nll]
        self.n = [float(v) for v in n]
        self.top_ids = top_ids
        self.top_lp = top_lp

    @property
    def top_n(self) -> int:
        return int(self.top_ids.shape[-1])


def input_device(model: Any) -> torch.device:
    """Where ``model`` takes its input ids: its input embedding's device (a model spread over
    GPUs with ``device_map="auto"`` starts there), else its first parameter's, else the CPU."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    for p in [*(emb.parameters() if emb is not None else []), *model.parameters()]:
        return p.device
    return torch.device("cpu")


def _logits(model: Any, ids: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """float32 logits of ``model`` on ``ids`` (moved to the model's input device), on
    ``device`` (default: where the model put them)."""
    out = model(input_ids=ids.to(input_device(model)))
    logits = (out.logits if hasattr(out, "logits") else out).float()
    return logits if device is None else logits.to(device)


def _against_topn(logits: torch.Tensor, ids: torch.Tensor, ref: ReferenceTopN, lo: int) -> dict:
    """Metrics of one chunk (windows ``lo..``) against a cached reference: exact NLL and top-1,
    KL estimated with the candidate's exact log-probs at the reference's top-N tokens."""
    m = token_metrics(logits, ids)
    B = ids.shape[0]
    r_ids = ref.top_ids[lo : lo + B].to(logits.device, torch.long)
    r_lp = ref.top_lp[lo : lo + B].to(logits.device)
    lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    q_at = lp.gather(-1, r_ids)
    m["agree"] = (lp.argmax(-1) == r_ids[..., 0]).double().sum(1)
    kl, tail = topn_kl(
        r_ids.flatten(0, 1), r_lp.flatten(0, 1), r_ids.flatten(0, 1), q_at.flatten(0, 1)
    )
    m["kl"] = kl.view(B, -1).sum(1)
    m["tail"] = tail.view(B, -1).sum(1)
    return m


def run_models(
    models: Mapping[str, Any],
    windows: torch.Tensor,
    reference: str | None = None,
    *,
    chunk: int = 8,
    progress: Callable[[int], None] | None = None,
    top_n: int = 0,
    cached: ReferenceTopN | None = None,
) -> tuple[dict[str, dict], ReferenceTopN | None]:
    """Evaluate ``models`` on ``windows`` (``[N, T]`` ids) against ``models[reference]`` (exact)
    or, when the reference is not among ``models``, against ``cached`` (top-N estimate of KL).

    Returns the per-model summaries (:meth:`WindowMetrics.summary`) and, with ``top_n`` > 0 and the
    reference among the models, the reference's :class:`ReferenceTopN` (for a cache).
    """
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [N, T>=2], got {tuple(windows.shape)}")
    if reference is not None and reference not in models and cached is None:
        raise KeyError(f"reference {reference!r} is not among the models {list(models)}")
    if cached is not None and tuple(cached.top_ids.shape[:2]) != (
        windows.shape[0],
        windows.shape[1] - 1,
    ):
        raise ValueError("the cached reference was computed on other windows")
    in_memory = reference is not None and reference in models
    acc = {name: WindowMetrics() for name in models}
    order = ([reference] if in_memory else []) + [n for n in models if n != reference]
    tops_i, tops_v = [], []
    with torch.no_grad():
        for i in range(0, windows.shape[0], chunk):
            x = windows[i : i + chunk]
            ref_logits = None
            for name in order:
                # every model's logits on the first one's device, beside the ids
                logits = _logits(models[name], x, None if ref_logits is None else ref_logits.device)
                x = x.to(logits.device)
                if name == reference:
                    ref_logits = logits
                    if top_n:
                        lp = F.log_softmax(logits[:, :-1].float(), dim=-1)
                        t = lp.topk(min(top_n, lp.shape[-1]), dim=-1)
                        tops_i.append(t.indices.to("cpu", torch.int32))
                        tops_v.append(t.values.cpu())
                if in_memory:
                    acc[name].add(token_metrics(logits, x, ref_logits))
                elif cached is not None:
                    acc[name].add(_against_topn(logits, x, cached, i))
                else:
                    acc[name].add(token_metrics(logits, x))
                del logits
                if progress is not None:
                    progress(x.shape[0])
    ref_top = None
    if in_memory and top_n:
        r = acc[reference]
        ref_top = ReferenceTopN(r.nll, r.n, torch.cat(tops_i), torch.cat(tops_v))
    return {name: acc[name].summary() for name in models}, ref_top


def evaluate_models(
    models: Mapping[str, Any],
    windows: torch.Tensor,
    reference: str | None = None,
    *,
    chunk: int = 8,
    progress: Callable[[int], None] | None = None,
) -> dict[str, dict]:
    """Evaluate every model of ``models`` on ``windows`` (``[N, T]`` token ids), exactly.

    For each chunk of ``chunk`` windows the reference model (``models[reference]``) runs first,
    then every other model; its logits are compared to each model's and then dropped. Returns
    ``name -> {"nll", "nll_se", "ppl", "tokens", "windows", "nll_per_window"[, "top1_agreement",
    "kl"]}`` (agreement / KL only with a reference; the reference itself gets 1.0 / 0.0 computed,
    not assumed). ``progress(k)`` is called with the number of windows done per model and chunk.
    """
    return run_models(models, windows, reference, chunk=chunk, progress=progress)[0]


def greedy_generate(
    model: Any,
    prompts: torch.Tensor,
    max_new_tokens: int,
    *,
    progress: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Greedy continuation of equal-length ``prompts`` (``[B, P]`` ids): ``[B, max_new_tokens]``.

    Re-runs the whole sequence each step (no KV cache: exact, model-agnostic, and cheap at these
    sizes); never stops early (an end-of-text token is just another token, so a loop on it counts).
    """
    if prompts.dim() != 2 or prompts.shape[1] < 1:
        raise ValueError(f"prompts must be [B, P>=1], got {tuple(prompts.shape)}")
    x = prompts
    with torch.no_grad():
        for _ in range(max_new_tokens):
            nxt = _logits(model, x)[:, -1].argmax(-1, keepdim=True)
            x = torch.cat([x, nxt.to(x.device, x.dtype)], dim=1)
            if progress is not None:
                progress(1)
    return x[:, prompts.shape[1] :]


def zero_routed_experts(model: Any) -> list:
    """Make every routed expert of every MoE layer output zeros (forward hooks; shared experts,
    routers and everything else untouched) -- the "no routed experts at all" reference that sizes
    what pruning can cost at most. Returns the hook handles (``.remove()`` them to undo)."""
    from ..models import find_moe_architecture

    def zero(module, args, output):
        return torch.zeros_like(output)

    handles = []
    for layer in find_moe_architecture(model).layers:
        experts = layer.experts
        targets = list(experts) if isinstance(experts, torch.nn.ModuleList) else [experts]
        handles += [m.register_forward_hook(zero) for m in targets]
    return handles
