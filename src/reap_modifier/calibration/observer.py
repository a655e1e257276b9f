"""Calibration hooks: per-expert statistics from the routing the model really uses.

For every (token t, slot s) routed to expert ``j = ids[t, s]`` with gate weight
``g = weights[t, s]`` (the coefficient the model multiplies the expert output by)
and expert output ``f = f_j(x_t)``, each layer accumulates in float64:
``count += 1``, ``sum_weight += g``, ``sum_norm += ||f||``, ``sum_reap += g*||f||``,
``max_norm = max(max_norm, ||f||)``. Everything is vectorised with ``index_add_``;
there is no per-expert Python loop with a host sync and no work for experts that
received no tokens.

How the per-slot output norms are obtained, without computing any expert twice:

- ``experts_call`` blocks: a forward pre-hook on the experts module *unrolls* the
  call to top-1 routing with weight 1 (row ``t*k + s`` = token ``t`` for expert
  ``ids[t, s]``), so the module's own implementation (eager loop, grouped_mm, or
  linearized) returns each slot's expert output. The forward hook records the norms
  and returns ``sum_s g[t, s] * out[t*k + s]``, the output the model would have made.
- ``kimi`` blocks: forward hooks on the gate (ids, weights), on every expert (output
  norms, in the latent space for latent MoE) and on the block (assemble and
  accumulate). Routed dispatch (``moe_infer``) feeds expert ``j`` the flat slots
  ``argsort(ids.view(-1))`` restricted to ``j``; calibrate-all (``moe_train``) feeds
  every expert all tokens, and the routed slots are gathered.

Both paths give identical statistics with ``moe_calibrate_all_experts`` on or off.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch

from ..models import MoEArchitecture, MoELayer
from ..scores import ExpertScores
from .accumulator import LayerAccumulator, norms64

__all__ = ["SaliencyObserver"]


class _KimiBatch:
    """Per-forward scratch state of one Kimi block."""

    __slots__ = ("ids", "weights", "calibrate_all", "rows")

    def __init__(self, ids, weights, calibrate_all):
        self.ids = ids
        self.weights = weights
        self.calibrate_all = calibrate_all
        # routed: expert outputs in dispatch order (one norm kernel per layer);
        # calibrate-all: per-expert norms over all tokens (outputs would be E x N x D)
        self.rows: list[torch.Tensor] = []


class SaliencyObserver:
    """Registers calibration hooks for every MoE layer and owns the accumulators.

    :param arch: the located MoE architecture
    :param register_hook: ``HooksMixin.register_hook`` of the owning modifier (so the
        pipeline's ``disable_hooks`` applies); signature ``(module, fn, hook_type, **kw)``
    """

    def __init__(self, arch: MoEArchitecture, register_hook: Callable[..., Any]):
        self.arch = arch
        self._register = register_hook
        self.accumulators = {
            layer.name: LayerAccumulator(arch.num_experts) for layer in arch.layers
        }
        self._pending: dict[str, Any] = {}

    # -- registration -------------------------------------------------------------

    def attach(self) -> None:
        for layer in self.arch.layers:
            if layer.kind == "experts_call":
                self._attach_experts_call(layer)
            else:
                self._attach_kimi(layer)

    def _attach_experts_call(self, layer: MoELayer) -> None:
        experts = layer.experts
        self._register(experts, partial(self._unroll_pre, layer.name), "forward_pre", with_kwargs=True)
        self._register(experts, partial(self._unroll_post, layer.name), "forward")

    def _attach_kimi(self, layer: MoELayer) -> None:
        self._register(layer.router, partial(self._kimi_gate, layer.name), "forward")
        for expert in layer.experts:
            self._register(expert, partial(self._kimi_expert, layer.name), "forward")
        self._register(layer.block, partial(self._kimi_block, layer.name), "forward")

    # -- experts_call path --------------------------------------------------------------

    def _unroll_pre(self, name: str, module, args: tuple, kwargs: dict):
        args = list(args)
        names = ("hidden_states", "top_k_index", "top_k_weights")
        values = []
        for i, key in enumerate(names):
            if i < len(args):
                values.append(args[i])
            else:  # keyword call; accept the GPT-OSS spelling too
                alt = {"top_k_index": "router_indices", "top_k_weights": "routing_weights"}
                k = key if key in kwargs else alt.get(key)
                values.append(kwargs.pop(k))
        hidden, ids, weights = values
        n, k = ids.shape
        self._pending[name] = (ids, weights, hidden.dtype)
        unrolled = (
            hidden.repeat_interleave(k, dim=0),
            ids.reshape(n * k, 1),
            torch.ones((n * k, 1), dtype=weights.dtype, device=weights.device),
        )
        return tuple(unrolled) + tuple(args[3:]), kwargs

    def _unroll_post(self, name: str, module, args: tuple, output: torch.Tensor):
        ids, weights, dtype = self._pending.pop(name)
        n, k = ids.shape
        out = output.view(n, k, -1)
        self.accumulators[name].add(ids, weights, norms64(out))
        combined = (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        return combined.to(dtype)

    # -- kimi path ------------------------------------------------------------------------

    def _kimi_gate(self, name: str, module, args: tuple, output: tuple):
        from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag

        ids, weights = output[0], output[1]
        self._pending[name] = _KimiBatch(ids, weights, get_calibrate_all_experts_flag())

    def _kimi_expert(self, name: str, module, args: tuple, output: torch.Tensor):
        batch = self._pending.get(name)
        if batch is not None:
            batch.rows.append(norms64(output) if batch.calibrate_all else output)

    def _kimi_block(self, name: str, module, args: tuple, output: Any):
        batch: _KimiBatch | None = self._pending.pop(name, None)
        if batch is None:
            return
        ids = batch.ids
        n, k = ids.shape
        if batch.calibrate_all:
            # moe_train: every expert saw all n tokens, in expert order
            full = torch.stack(batch.rows)  # [E, n] norms
            tokens = torch.arange(n, device=full.device).unsqueeze(1).expand(n, k)
            norms = full[ids.to(full.device, torch.long), tokens]
        else:
            # moe_infer: experts with tokens, ascending, fed the argsort order of flat ids
            flat = (
                norms64(torch.cat(batch.rows))
                if batch.rows
                else torch.empty(0, dtype=torch.float64)
            )
            if flat.numel() != n * k:
                raise RuntimeError(
                    f"REAP observer: {name} dispatched {flat.numel()} expert rows for "
                    f"{n * k} routed slots; the Kimi dispatch changed, update the adapter"
                )
            order = ids.reshape(-1).argsort()
            norms = torch.empty_like(flat)
            norms[order.to(flat.device)] = flat
            norms = norms.view(n, k)
        self.accumulators[name].add(ids, batch.weights, norms)

    # -- results ----------------------------------------------------------------------------

    def reset_pending(self) -> None:
        self._pending.clear()

    def to_scores(self, source: str = "default", metadata: dict | None = None) -> ExpertScores:
        """Export the accumulated sums (CPU float64) as an :class:`ExpertScores`."""
        layers = {}
        tokens = 0
        for name, acc in self.accumulators.items():
            stats = acc.export()
            stats[f"count@{source}"] = stats["count"].clone()
            layers[name] = stats
            tokens = max(tokens, acc.tokens)
        meta = dict(self.arch.describe())
        meta["tokens"] = {source: tokens}
        meta.update(metadata or {})
        return ExpertScores(layers=layers, metadata=meta)
