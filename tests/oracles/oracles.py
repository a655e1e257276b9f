"""Brute-force float64 reference implementations (test oracles).

Nothing here imports project code (``reap_modifier``); everything is computed
from the model's parameters with explicit Python loops or plain float64 torch
ops, following the routing semantics of the upstream model sources
(transformers 5.17 ``modeling_<family>.py`` and llm-compressor's
``modeling/kimi_k3``).

Public API
----------
``router_of(family, block)`` / ``experts_of(family, block)``
``native_routing(family, block, hidden) -> (ids [N,k] long, weights [N,k] f64)``
``reference_routing(family, block, hidden, dropped=()) -> (ids, weights)``
``align_routing(ids, weights)`` -> rows sorted by expert id
``routing_sets_equal(a_ids, b_ids) -> bool``
``reference_expert_input(family, block, hidden) -> [N, D] f64`` (latent for K3)
``reference_expert_output(family, block, expert_id, x) -> [..., D] f64``
``reference_block_output(family, block, hidden, routing=None, stage="full")``
``brute_force_stats(model, family, input_ids_list, routing="reference", check_native=True)``
``masked_routing(model, family, dropped)`` (context manager)
``masked_router_selfcheck(model, family, input_ids) -> {block: bool}``
``capture_block_inputs(model, family, input_ids) -> {block: [hidden, ...]}``
``reap_saliency(stats) -> f64 [E]`` (mean g*||f|| over routed tokens, 0 if never routed)
``reference_prune(model, family, dropped)`` physically removes experts (in place)

Precision notes (upstream behaviour, not bugs in the oracles):

* Every router except GPT-OSS computes its probabilities in float32 even in a
  float64 model (DeepSeek-V3/GLM4/Kimi: ``F.linear(h.float(), w.float())``;
  Qwen3/OLMoE: ``softmax(dtype=torch.float)``; Mixtral: ``logits.float()``).
  Native gate weights therefore agree with the float64 reference only to
  ~1e-7 relative, and stats built from native weights (what a hook-based
  modifier sees) agree with ``brute_force_stats(routing="reference")`` only to
  ~1e-6 relative.  ``routing="native"`` reproduces the native weights exactly.
* Kimi ``KimiSparseMoeBlock.moe_infer`` (the default, non-calibrate-all path)
  casts expert outputs to the gate dtype (float32) before weighting, so its
  output is float32-accurate even for a float64 model; ``moe_train`` is exact.
* ``KimiRMSNorm`` (``latent_moe_use_norm=True``) normalises in float32.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Mapping

import torch
import torch.nn.functional as F

__all__ = [
    "router_attr",
    "router_of",
    "experts_of",
    "moe_block_names",
    "native_routing",
    "reference_routing",
    "align_routing",
    "routing_sets_equal",
    "reference_expert_input",
    "reference_expert_output",
    "reference_block_output",
    "brute_force_stats",
    "masked_routing",
    "masked_router_forward",
    "masked_router_selfcheck",
    "capture_block_inputs",
    "reap_saliency",
    "reference_prune",
    "STAT_KEYS",
]

STAT_KEYS = ("count", "sum_weight", "sum_norm", "sum_reap", "max_norm")

_SOFTMAX = ("qwen3_moe", "olmoe", "mixtral")
_SIGMOID = ("deepseek_v3", "glm4_moe")
_KIMI = ("kimi_k3", "kimi_linear")
_GPT_OSS = ("gpt_oss",)
_KNOWN = _SOFTMAX + _SIGMOID + _KIMI + _GPT_OSS


def _check_family(family: str) -> None:
    if family not in _KNOWN:
        raise ValueError(f"oracles do not know family {family!r}")


# ---------------------------------------------------------------------------
# module access


def router_attr(family: str) -> str:
    _check_family(family)
    return "router" if family in _GPT_OSS else "gate"


def router_of(family: str, block: torch.nn.Module) -> torch.nn.Module:
    return getattr(block, router_attr(family))


def experts_of(family: str, block: torch.nn.Module) -> torch.nn.Module:
    return block.experts


def moe_block_names(model: torch.nn.Module, family: str) -> list[str]:
    """Names of the modules owning a ``router_attr(family)`` and ``experts``."""
    ra = router_attr(family)
    out = []
    for name, mod in model.named_modules():
        if isinstance(getattr(mod, ra, None), torch.nn.Module) and isinstance(
            getattr(mod, "experts", None), torch.nn.Module
        ):
            out.append(name)
    return out


def _num_experts(family: str, block) -> int:
    return int(router_of(family, block).weight.shape[0])


def _top_k(family: str, block) -> int:
    return int(router_of(family, block).top_k)


def _flat(hidden: torch.Tensor) -> torch.Tensor:
    return hidden.reshape(-1, hidden.shape[-1])


def _d(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", torch.float64)


# ---------------------------------------------------------------------------
# routing


def native_routing(family: str, block, hidden: torch.Tensor):
    """Call the block's own router; return ``(ids long [N,k], weights f64 [N,k])``."""
    router = router_of(family, block)
    with torch.no_grad():
        if family in _KIMI:
            h = hidden if hidden.dim() == 3 else hidden.reshape(1, -1, hidden.shape[-1])
            ids, w = router(h)
        else:
            _, w, ids = router(_flat(hidden))
    return ids.detach().cpu().long(), _d(w)


def _routing_spec(family: str, router) -> dict:
    spec = dict(
        family=family,
        top_k=int(router.top_k),
        num_experts=int(router.weight.shape[0]),
    )
    if family in ("qwen3_moe", "olmoe"):
        spec.update(kind="softmax", norm=bool(router.norm_topk_prob))
    elif family == "mixtral":
        spec.update(kind="softmax", norm=True)
    elif family in _SIGMOID:
        spec.update(
            kind="biased",
            activation="sigmoid",
            norm=bool(router.norm_topk_prob),
            n_group=int(router.num_group),
            topk_group=int(router.topk_group),
            use_groups=True,  # always applied (a no-op for n_group == 1)
            scale=float(router.routed_scaling_factor),
            bias=_d(router.e_score_correction_bias).tolist(),
        )
    elif family in _KIMI:
        n_group = int(getattr(router, "num_expert_group", 1))
        topk_group = int(getattr(router, "topk_group", 1))
        spec.update(
            kind="biased",
            activation=str(router.moe_router_activation_func),
            norm=bool(router.moe_renormalize) and int(router.top_k) > 1,
            n_group=n_group,
            topk_group=topk_group,
            use_groups=n_group > 1 and n_group > topk_group,
            scale=float(router.routed_scaling_factor),
            bias=_d(router.e_score_correction_bias).tolist(),
        )
    elif family in _GPT_OSS:
        spec.update(kind="gpt_oss")
    return spec


def _top(cands: list[int], key: list[float], k: int) -> list[int]:
    """k candidates with largest ``key`` (ties: lower id first)."""
    return sorted(cands, key=lambda e: (-key[e], e))[:k]


def _softmax_over(vals: list[float], idx: list[int]) -> dict[int, float]:
    m = max(vals[e] for e in idx)
    ex = {e: math.exp(vals[e] - m) for e in idx}
    s = sum(ex.values())
    return {e: ex[e] / s for e in idx}


def _sigmoid(v: float) -> float:
    if v >= 0:
        return 1.0 / (1.0 + math.exp(-v))
    z = math.exp(v)
    return z / (1.0 + z)


def reference_routing(family: str, block, hidden: torch.Tensor, dropped: Iterable[int] = ()):
    """Float64 top-k routing recomputed from the router parameters.

    Returns ``(ids long [N,k], weights f64 [N,k])``, each row ordered by
    decreasing selection score (the native order may differ: compare sets).
    ``dropped`` experts are treated as absent (see ``masked_routing``).
    """
    _check_family(family)
    router = router_of(family, block)
    spec = _routing_spec(family, router)
    E, k = spec["num_experts"], spec["top_k"]
    drop = {int(e) for e in dropped}
    kept = [e for e in range(E) if e not in drop]
    if len(kept) < k:
        raise ValueError(f"only {len(kept)} experts kept, top_k={k}")

    x = _d(_flat(hidden))
    W = _d(router.weight)
    logits = x @ W.T
    if family in _GPT_OSS:
        logits = logits + _d(router.bias)
    L = logits.tolist()

    all_ids, all_w = [], []
    for row in L:
        kind = spec["kind"]
        if kind == "softmax":
            p = _softmax_over(row, kept)
            sel = _top(kept, [p.get(e, -1.0) for e in range(E)], k)
            w = [p[e] for e in sel]
            if spec["norm"]:
                s = sum(w)
                w = [v / s for v in w]
        elif kind == "gpt_oss":
            sel = _top(kept, row, k)
            p = _softmax_over(row, sel)
            w = [p[e] for e in sel]
        else:  # biased: sigmoid (or kimi softmax) scores + correction bias
            if spec["activation"] == "sigmoid":
                s_all = [_sigmoid(v) for v in row]
            elif spec["activation"] == "softmax":
                sm = _softmax_over(row, kept)
                s_all = [sm.get(e, 0.0) for e in range(E)]
            else:
                raise NotImplementedError(spec["activation"])
            c = [s_all[e] + spec["bias"][e] for e in range(E)]
            if spec["use_groups"]:
                G = spec["n_group"]
                size = E // G
                gscore = []
                for g in range(G):
                    members = [e for e in range(g * size, (g + 1) * size) if e in kept]
                    if len(members) < 2:
                        # native: top-2 over masked scores includes -inf
                        gscore.append(-math.inf)
                    else:
                        top2 = sorted((c[e] for e in members), reverse=True)[:2]
                        gscore.append(top2[0] + top2[1])
                groups = sorted(range(G), key=lambda g: (-gscore[g], g))[: spec["topk_group"]]
                cands = [e for e in kept if e // size in groups]
            else:
                cands = kept
            sel = _top(cands, c, k)
            w = [s_all[e] for e in sel]
            if spec["norm"]:
                den = sum(w) + 1e-20
                w = [v / den for v in w]
            w = [v * spec["scale"] for v in w]
        all_ids.append(sel)
        all_w.append(w)
    return (
        torch.tensor(all_ids, dtype=torch.long).reshape(-1, k),
        torch.tensor(all_w, dtype=torch.float64).reshape(-1, k),
    )


def align_routing(ids: torch.Tensor, weights: torch.Tensor):
    """Sort each row by expert id (so routings with different order compare)."""
    order = torch.argsort(ids, dim=-1)
    return torch.gather(ids, -1, order), torch.gather(weights, -1, order)


def routing_sets_equal(a_ids: torch.Tensor, b_ids: torch.Tensor) -> bool:
    a = torch.sort(a_ids.cpu().long(), dim=-1).values
    b = torch.sort(b_ids.cpu().long(), dim=-1).values
    return a.shape == b.shape and bool(torch.equal(a, b))


# ---------------------------------------------------------------------------
# experts


def _silu(t: torch.Tensor) -> torch.Tensor:
    return t / (1.0 + torch.exp(-t))


def _act_mul(cfg, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    act = getattr(cfg, "hidden_act", "silu")
    if act == "silu":
        return _silu(gate) * up
    if act == "situ":  # Kimi SituAndMul, computed here in float64
        beta = getattr(cfg, "activation_situ_beta", None) or 1.0
        lbeta = getattr(cfg, "activation_situ_linear_beta", None)
        a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
        if lbeta is not None:
            up = lbeta * torch.tanh(up / lbeta)
        return a * up
    raise NotImplementedError(f"activation {act!r}")


def _gpt_oss_glu(gate, up, limit: float, alpha: float) -> torch.Tensor:
    gate = torch.clamp(gate, max=limit)
    up = torch.clamp(up, min=-limit, max=limit)
    return (up + 1.0) * (gate * (1.0 / (1.0 + torch.exp(-gate * alpha))))


def _block_cfg(family: str, block):
    cfg = getattr(block, "config", None)
    if cfg is None:
        cfg = getattr(experts_of(family, block), "config", None)
    if cfg is None:
        cfg = getattr(experts_of(family, block), "_source_config", None)
    return cfg


def _lin(x, layer: torch.nn.Linear) -> torch.Tensor:
    y = x @ _d(layer.weight).T
    if getattr(layer, "bias", None) is not None:
        y = y + _d(layer.bias)
    return y


def reference_expert_input(family: str, block, hidden: torch.Tensor) -> torch.Tensor:
    """What the routed experts consume, float64 ``[N, D]``: the block input,
    or for a latent MoE (Kimi K3) ``routed_expert_down_proj(hidden)``."""
    x = _d(_flat(hidden))
    if family in _KIMI and getattr(block, "use_latent_moe", False):
        x = _lin(x, block.routed_expert_down_proj)
    return x


def reference_expert_output(family: str, block, expert_id: int, x: torch.Tensor):
    """Output of routed expert ``expert_id`` on ``x`` (float64, explicit math).

    ``x`` is in the experts' input space (for K3 the *latent*, see
    ``reference_expert_input``); the result is the raw expert output (for K3
    before ``routed_expert_norm`` / ``routed_expert_up_proj``).  Handles the
    fused 3-D layouts (incl. GPT-OSS transposed + interleaved + biases + clamp),
    Kimi's ModuleList of w1/w2/w3 MLPs, and llm-compressor's linearized
    ``LinearExperts2D`` (per-expert gate_proj/up_proj/down_proj).
    """
    _check_family(family)
    e = int(expert_id)
    x = _d(x)
    experts = experts_of(family, block)
    cfg = _block_cfg(family, block)

    if isinstance(experts, torch.nn.ModuleList):
        mod = experts[e]
        if hasattr(mod, "w1"):  # Kimi KimiBlockSparseMLP
            h = _act_mul(mod.config, _lin(x, mod.w1), _lin(x, mod.w3))
            return _lin(h, mod.w2)
        if hasattr(mod, "gate_proj"):  # llm-compressor linearized experts
            g, u = _lin(x, mod.gate_proj), _lin(x, mod.up_proj)
            if family in _GPT_OSS:
                h = _gpt_oss_glu(
                    g,
                    u,
                    float(getattr(experts, "limit", None) or 7.0),
                    float(getattr(experts, "alpha", None) or 1.702),
                )
            else:
                h = _act_mul(cfg, g, u)
            return _lin(h, mod.down_proj)
        if hasattr(mod, "up_proj"):  # gate-less linearized experts
            raise NotImplementedError("gate-less experts are not used by any family")
        raise TypeError(f"unknown expert module {type(mod).__name__}")

    # fused 3-D parameters
    gu = _d(experts.gate_up_proj[e])
    dn = _d(experts.down_proj[e])
    if family in _GPT_OSS:
        # [H, 2I] transposed, gate/up interleaved on the last axis, with biases
        h = x @ gu + _d(experts.gate_up_proj_bias[e])
        gate, up = h[..., 0::2], h[..., 1::2]
        h = _gpt_oss_glu(gate, up, float(experts.limit), float(experts.alpha))
        return h @ dn + _d(experts.down_proj_bias[e])
    inter = gu.shape[0] // 2  # [2I, H]: rows [0, I) gate, [I, 2I) up
    h = x @ gu.T
    if getattr(experts, "has_bias", False) and hasattr(experts, "gate_up_proj_bias"):
        h = h + _d(experts.gate_up_proj_bias[e])
    h = _act_mul(cfg, h[..., :inter], h[..., inter:])
    out = h @ dn.T
    if getattr(experts, "has_bias", False) and hasattr(experts, "down_proj_bias"):
        out = out + _d(experts.down_proj_bias[e])
    return out


def _shared_mlp(mod, x: torch.Tensor) -> torch.Tensor:
    cfg = getattr(mod, "config", None)
    return _lin(_act_mul(cfg, _lin(x, mod.gate_proj), _lin(x, mod.up_proj)), mod.down_proj)


def reference_block_output(
    family: str, block, hidden: torch.Tensor, routing=None, stage: str = "full"
) -> torch.Tensor:
    """Float64 output of the whole MoE block on ``hidden`` (``[N, H]`` flat).

    ``routing=(ids, weights)`` overrides the routing (e.g. ``native_routing`` to
    remove float32-router noise); default ``reference_routing``.
    ``stage="routed"``: only ``sum_k g_k f_k(x)`` in the experts' space (for K3
    the latent, before norm/up-proj); ``"full"``: with K3 latent norm + up-proj
    and shared experts added, i.e. what the block returns.
    """
    if routing is None:
        routing = reference_routing(family, block, hidden)
    ids, w = routing
    ids = ids.cpu().long()
    w = _d(w)
    x = reference_expert_input(family, block, hidden)
    N = x.shape[0]
    outs = {}
    for e in sorted(set(ids.flatten().tolist())):
        outs[e] = reference_expert_output(family, block, e, x)
    y = torch.zeros(
        N, outs[next(iter(outs))].shape[-1] if outs else x.shape[-1], dtype=torch.float64
    )
    for t in range(N):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            y[t] += w[t, j] * outs[e][t]
    if stage == "routed":
        return y
    if stage != "full":
        raise ValueError(stage)
    if family in _KIMI and getattr(block, "use_latent_moe", False):
        if getattr(block, "latent_moe_use_norm", False):
            norm = block.routed_expert_norm
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
            y = y * _d(norm.weight)
        y = _lin(y, block.routed_expert_up_proj)
    shared = getattr(block, "shared_experts", None)
    if shared is not None:
        if family not in _KIMI or block.config.num_shared_experts is not None:
            y = y + _shared_mlp(shared, _d(_flat(hidden)))
    return y


# ---------------------------------------------------------------------------
# statistics


def _input_kwargs(item) -> dict:
    if isinstance(item, Mapping):
        return dict(item)
    ids = torch.as_tensor(item)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    return {"input_ids": ids}


@contextlib.contextmanager
def _capture_block_inputs(model, names: list[str]):
    store: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = []

    def make(name):
        def hook(mod, args, kwargs):
            h = args[0] if args else kwargs["hidden_states"]
            store[name].append(h.detach().clone())

        return hook

    try:
        for n in names:
            handles.append(
                model.get_submodule(n).register_forward_pre_hook(make(n), with_kwargs=True)
            )
        yield store
    finally:
        for h in handles:
            h.remove()


def capture_block_inputs(model, family: str, input_ids, blocks=None):
    """Run ``model`` once (no_grad, no cache) on ``input_ids`` (tensor or kwargs
    dict) and return each MoE block's input hidden states: ``{name: [h]}``."""
    names = blocks if blocks is not None else moe_block_names(model, family)
    with _capture_block_inputs(model, names) as store, torch.no_grad():
        model(**{**_input_kwargs(input_ids), "use_cache": False})
    return store


def brute_force_stats(
    model,
    family: str,
    input_ids_list,
    routing: str = "reference",
    check_native: bool = True,
    blocks: list[str] | None = None,
    dropped: Mapping[str, Iterable[int]] | None = None,
) -> dict[str, dict[str, torch.Tensor]]:
    """Per-block REAP statistics by brute force.

    Runs ``model`` (no_grad, ``use_cache=False``) on each item of
    ``input_ids_list`` (LongTensor ``[S]``/``[B,S]`` or a kwargs dict), captures
    every MoE block's input with a forward pre-hook, then for every token and
    every selected expert accumulates, in float64 Python scalars::

        count += 1; sum_weight += g; sum_norm += ||f||; sum_reap += g*||f||;
        max_norm = max(max_norm, ||f||)

    with ``f`` the raw expert output (K3: latent, before up-proj).  Every
    position is counted (padding included, even if a dict item carries an
    ``attention_mask``).  ``routing``:
    ``"reference"`` (float64 recomputation) or ``"native"`` (the router's own
    ids/weights, upcast).  ``check_native`` asserts that the reference and
    native selected sets agree for every token.  Returns
    ``{block_name: {stat: float64 [E]}}``.
    """
    if routing not in ("reference", "native"):
        raise ValueError(routing)
    names = blocks if blocks is not None else moe_block_names(model, family)
    with _capture_block_inputs(model, names) as store, torch.no_grad():
        for item in input_ids_list:
            kw = _input_kwargs(item)
            kw.setdefault("use_cache", False)
            model(**kw)

    result = {}
    for name in names:
        block = model.get_submodule(name)
        E = _num_experts(family, block)
        count = [0.0] * E
        sw = [0.0] * E
        sn = [0.0] * E
        sr = [0.0] * E
        mx = [0.0] * E
        for hidden in store[name]:
            ref_ids, ref_w = reference_routing(family, block, hidden, (dropped or {}).get(name, ()))
            if check_native or routing == "native":
                nat_ids, nat_w = native_routing(family, block, hidden)
            if check_native and not routing_sets_equal(ref_ids, nat_ids):
                bad = (
                    (torch.sort(ref_ids, -1).values != torch.sort(nat_ids, -1).values)
                    .any(-1)
                    .nonzero()
                    .flatten()
                    .tolist()
                )
                raise AssertionError(
                    f"{name}: reference and native routing disagree on tokens {bad}"
                )
            ids, w = (ref_ids, ref_w) if routing == "reference" else (nat_ids, nat_w)
            x = reference_expert_input(family, block, hidden)
            outs = {
                e: reference_expert_output(family, block, e, x)
                for e in sorted(set(ids.flatten().tolist()))
            }
            ids_l, w_l = ids.tolist(), w.tolist()
            for t in range(len(ids_l)):
                for j, e in enumerate(ids_l[t]):
                    f = outs[e][t]
                    nrm = math.sqrt(sum(v * v for v in f.tolist()))
                    g = w_l[t][j]
                    count[e] += 1.0
                    sw[e] += g
                    sn[e] += nrm
                    sr[e] += g * nrm
                    mx[e] = max(mx[e], nrm)
        f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
        result[name] = {
            "count": f64(count),
            "sum_weight": f64(sw),
            "sum_norm": f64(sn),
            "sum_reap": f64(sr),
            "max_norm": f64(mx),
        }
    return result


def reap_saliency(stats: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """REAP S_j = sum_reap / count (0 for experts never routed)."""
    c, s = stats["count"], stats["sum_reap"]
    return torch.tensor(
        [float(s[i]) / float(c[i]) if float(c[i]) > 0 else 0.0 for i in range(len(c))],
        dtype=torch.float64,
    )


# ---------------------------------------------------------------------------
# masked routing


def masked_router_forward(family: str, router, dropped: Iterable[int]):
    """A forward for ``router`` that mirrors the native one operation for
    operation (same dtypes, same return tuple) but treats ``dropped`` experts
    as absent:

    * softmax routers (Qwen3-MoE, OLMoE, Mixtral): their logits are set to
      ``-inf`` before the softmax, so probabilities are over kept experts only;
    * sigmoid routers (DeepSeek-V3, GLM4-MoE, Kimi): ``-inf`` on the selection
      scores (after the correction bias), so group scores are computed over kept
      experts only and dropped experts are never selected (a group with fewer
      than two kept experts scores ``-inf``); the weights are the unbiased scores
      of the selected experts, renormalised/scaled as usual;
    * GPT-OSS: ``-inf`` on the logits before the top-k.

    The returned router logits (element 0 for the transformers routers) are
    the *unmasked* raw logits.
    """
    _check_family(family)
    E = int(router.weight.shape[0])
    mask_cpu = torch.zeros(E, dtype=torch.bool)
    for e in dropped:
        mask_cpu[int(e)] = True
    ninf = float("-inf")

    if family in ("qwen3_moe", "olmoe"):

        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            router_logits = F.linear(hidden_states, router.weight)
            mask = mask_cpu.to(router_logits.device)
            masked = router_logits.masked_fill(mask, ninf)
            router_probs = torch.nn.functional.softmax(masked, dtype=torch.float, dim=-1)
            router_top_value, router_indices = torch.topk(router_probs, router.top_k, dim=-1)
            if router.norm_topk_prob:
                router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
            router_top_value = router_top_value.to(router_logits.dtype)
            return router_logits, router_top_value, router_indices

    elif family == "mixtral":

        def forward(hidden_states):
            hidden_states = hidden_states.reshape(-1, router.hidden_dim)
            router_logits = F.linear(hidden_states, router.weight)
            mask = mask_cpu.to(router_logits.device)
            masked = router_logits.masked_fill(mask, ninf)
            router_probs = torch.nn.functional.softmax(masked.float(), dim=-1)
            router_top_value, router_indices = torch.topk(router_probs, router.top_k, dim=-1)
            router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
            return router_logits, router_top_value, router_indices

    elif family in _SIGMOID:

        def forward(hidden_states):
            hidden_states = hidden_states.view(-1, router.hidden_dim)
            router_logits = F.linear(
                hidden_states.type(torch.float32), router.weight.type(torch.float32)
            )
            scores = router_logits.sigmoid()
            scores_for_choice = scores + router.e_score_correction_bias
            mask = mask_cpu.to(scores.device)
            scores_for_choice = scores_for_choice.masked_fill(mask, ninf)
            n_group, per = router.num_group, router.num_experts // router.num_group
            group_scores = scores_for_choice.view(-1, n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=router.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores)
            group_mask.scatter_(1, group_idx, 1)
            score_mask = (
                group_mask.unsqueeze(-1).expand(-1, n_group, per).reshape(-1, router.num_experts)
            )
            scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), ninf)
            topk_indices = torch.topk(scores_for_choice, k=router.top_k, dim=-1, sorted=False)[1]
            topk_weights = scores.gather(1, topk_indices)
            if router.norm_topk_prob:
                denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
                topk_weights /= denominator
            topk_weights = topk_weights * router.routed_scaling_factor
            return router_logits, topk_weights, topk_indices

    elif family in _KIMI:

        def forward(hidden_states):
            bsz, seq_len, h = hidden_states.shape
            hidden_states = hidden_states.view(-1, h)
            logits = F.linear(
                hidden_states.type(torch.float32), router.weight.type(torch.float32), None
            )
            mask = mask_cpu.to(logits.device)
            if router.moe_router_activation_func == "sigmoid":
                scores = logits.sigmoid()
            elif router.moe_router_activation_func == "softmax":
                scores = logits.masked_fill(mask, ninf).softmax(dim=1)
            else:
                raise NotImplementedError(router.moe_router_activation_func)
            scores = scores.view(bsz * seq_len, -1)
            scores_for_choice = scores + router.e_score_correction_bias.unsqueeze(0)
            scores_for_choice = scores_for_choice.masked_fill(mask, ninf)
            G, TG = router.num_expert_group, router.topk_group
            if G > 1 and G > TG:
                group_scores = (
                    scores_for_choice.view(bsz * seq_len, G, -1).topk(2, dim=-1)[0].sum(dim=-1)
                )
                group_idx = torch.topk(group_scores, k=TG, dim=-1, sorted=False)[1]
                group_mask = torch.zeros_like(group_scores)
                group_mask.scatter_(1, group_idx, 1)
                score_mask = (
                    group_mask.unsqueeze(-1)
                    .expand(bsz * seq_len, G, router.num_experts // G)
                    .reshape(bsz * seq_len, -1)
                )
                tmp_scores = scores_for_choice.masked_fill(~score_mask.bool(), ninf)
            else:
                tmp_scores = scores_for_choice
            _, topk_idx = torch.topk(tmp_scores, k=router.top_k, dim=-1, sorted=False)
            topk_weight = scores.gather(1, topk_idx)
            if router.top_k > 1 and router.moe_renormalize:
                denominator = topk_weight.sum(dim=-1, keepdim=True) + 1e-20
                topk_weight = topk_weight / denominator
            topk_weight = topk_weight * router.routed_scaling_factor
            return topk_idx, topk_weight

    elif family in _GPT_OSS:

        def forward(hidden_states):
            router_logits = F.linear(hidden_states, router.weight, router.bias)
            mask = mask_cpu.to(router_logits.device)
            masked = router_logits.masked_fill(mask, ninf)
            router_top_value, router_indices = torch.topk(masked, router.top_k, dim=-1)
            router_scores = torch.nn.functional.softmax(
                router_top_value, dim=1, dtype=router_top_value.dtype
            )
            return router_logits, router_scores, router_indices

    return forward


_MISSING = object()


@contextlib.contextmanager
def masked_routing(model, family: str, dropped: Mapping[str, Iterable[int]]):
    """Route as if the ``dropped`` experts did not exist.

    ``dropped`` maps MoE block names to expert ids.  For each listed block the
    router's ``forward`` is temporarily replaced (instance attribute) by
    ``masked_router_forward``; blocks not listed keep their native router.
    Restored on exit, even on error.
    """
    saved = []
    try:
        for name, ids in dropped.items():
            router = router_of(family, model.get_submodule(name))
            saved.append((router, router.__dict__.get("forward", _MISSING)))
            router.forward = masked_router_forward(family, router, list(ids))
        yield model
    finally:
        for router, prev in reversed(saved):
            if prev is _MISSING:
                router.__dict__.pop("forward", None)
            else:
                router.forward = prev


def masked_router_selfcheck(model, family: str, input_ids) -> dict[str, bool]:
    """For every MoE block: does the masked router with nothing dropped return
    bit-for-bit what the native router returns (every tuple element, dtype
    included) on that block's real input?  ``{block_name: ok}``."""
    names = moe_block_names(model, family)
    with _capture_block_inputs(model, names) as store, torch.no_grad():
        model(**{**_input_kwargs(input_ids), "use_cache": False})
    ok = {}
    with torch.no_grad():
        for name in names:
            router = router_of(family, model.get_submodule(name))
            fwd = masked_router_forward(family, router, [])
            good = True
            for h in store[name]:
                if family not in _KIMI:
                    h = _flat(h)
                a, b = router(h), fwd(h)
                good &= len(a) == len(b) and all(
                    x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
                    for x, y in zip(a, b)
                )
            ok[name] = bool(good)
    return ok


# ---------------------------------------------------------------------------
# physical pruning (naive reference)

_NUM_EXPERTS_KEYS = ("num_experts", "n_routed_experts", "num_local_experts")


@torch.no_grad()
def reference_prune(model, family: str, dropped: Mapping[str, Iterable[int]]):
    """Remove the ``dropped`` experts of each listed block *in place* (naive
    slicing of router rows, correction bias / router bias, fused expert
    tensors or the Kimi expert ModuleList), keeping the kept experts in their
    original order.  Per-block ``num_experts`` attributes are updated; the
    config's expert count is updated only when every MoE block keeps the same
    number.  Returns ``model``.  Intended for checking ``masked_routing`` and a
    modifier's output; do not use it on models that must stay intact."""
    new_counts = set()
    for name, ids in dropped.items():
        block = model.get_submodule(name)
        router = router_of(family, block)
        E = int(router.weight.shape[0])
        drop = {int(e) for e in ids}
        keep = [e for e in range(E) if e not in drop]
        kt = torch.tensor(keep, dtype=torch.long)
        router.weight = torch.nn.Parameter(router.weight.data[kt].clone(), requires_grad=False)
        if family in _GPT_OSS:
            router.bias = torch.nn.Parameter(router.bias.data[kt].clone(), requires_grad=False)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            new = bias.data[kt].clone()
            if isinstance(bias, torch.nn.Parameter):
                router.e_score_correction_bias = torch.nn.Parameter(new, requires_grad=False)
            else:
                router.e_score_correction_bias = new  # buffer assignment
        router.num_experts = len(keep)
        experts = experts_of(family, block)
        if isinstance(experts, torch.nn.ModuleList):
            n_old = len(experts)
            mods = [experts[e] for e in keep]
            extra = [experts[i] for i in range(E, n_old)]  # e.g. act_fn appended
            new_list = type(experts).__new__(type(experts))
            new_list.__dict__.update(experts.__dict__)
            new_list._modules = {}
            for i, m in enumerate(mods + extra):
                new_list._modules[str(i)] = m
            if hasattr(new_list, "num_experts"):
                new_list.num_experts = len(keep)
            block.experts = new_list
        else:
            for pname in (
                "gate_up_proj",
                "down_proj",
                "gate_up_proj_bias",
                "down_proj_bias",
                "up_proj",
                "up_proj_bias",
            ):
                p = getattr(experts, pname, None)
                if isinstance(p, torch.Tensor):
                    setattr(
                        experts, pname, torch.nn.Parameter(p.data[kt].clone(), requires_grad=False)
                    )
            experts.num_experts = len(keep)
        for attr in ("num_experts", "experts_per_rank"):
            if hasattr(block, attr) and isinstance(getattr(block, attr), int):
                setattr(block, attr, len(keep))
        new_counts.add(len(keep))
    all_blocks = moe_block_names(model, family)
    if len(new_counts) == 1 and set(dropped) >= set(all_blocks):
        n = new_counts.pop()
        cfg = model.config
        cfgs = [cfg] + [getattr(cfg, "text_config", None)]
        for c in cfgs:
            if c is None:
                continue
            for key in _NUM_EXPERTS_KEYS:
                if key in c.__dict__ or hasattr(type(c), key):
                    try:
                        setattr(c, key, n)
                    except Exception:
                        pass
    return model
