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
- ``input_gated`` blocks (Llama-4: the router score scales each expert's input, every
  expert runs on every token): a forward hook on the router keeps its scores and logits,
  one on the experts module takes, per routed (token, slot), the expert's rows of its
  ``[E * N, H]`` output; the recorded norm is that contribution's norm divided by the
  gate, so ``g * norm`` is the norm of what the expert adds (see
  :mod:`reap_modifier.models.input_gated`).
- ``kimi`` blocks: forward hooks on the gate (ids, weights), on every expert (output
  norms, in the latent space for latent MoE) and on the block (assemble and
  accumulate). Routed dispatch: by default the block's ``moe_infer`` is replaced while
  the observer is attached by :mod:`~reap_modifier.calibration.kimi_grouped`'s grouped
  dispatch (grouped_mm over stacked expert weights, no host sync), whose per-slot
  outputs give the norms directly; with ``grouped=False`` llm-compressor's own
  ``moe_infer`` runs and feeds expert ``j`` the flat slots ``argsort(ids.view(-1))``
  restricted to ``j``. Calibrate-all (``moe_train``) feeds every expert all tokens,
  and the routed slots are gathered.

Both paths give identical statistics with ``moe_calibrate_all_experts`` on or off.

Padding never counts: positions whose attention mask is 0 enter no statistic and no
token count. A forward pre-hook on every MoE block looks up the current batch's
``[B, T]`` mask (rows ``b*T + t`` of the flattened tokens the block routes) from the
model's own call or the sequential pipeline's cached batch
(:class:`~reap_modifier.calibration.tokens.BatchTokenTracker`).

Without an attention mask every position counts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..models import MoEArchitecture, MoELayer
from ..scores import ExpertScores
from ..wholeness import sample_rows
from .accumulator import LayerAccumulator, norms64
from .kimi_grouped import GroupedKimiDispatch
from .tokens import BatchTokens, BatchTokenTracker

__all__ = ["SaliencyObserver"]


class _KimiBatch:
    """Per-forward scratch state of one Kimi block."""

    __slots__ = ("ids", "weights", "calibrate_all", "rows", "tokens", "grouped", "norms")

    def __init__(self, ids, weights, calibrate_all, tokens):
        self.ids = ids
        self.weights = weights
        self.calibrate_all = calibrate_all
        self.tokens = tokens
        # routed: expert outputs in dispatch order (one norm kernel per layer);
        # calibrate-all: per-expert norms over all tokens (outputs would be E x N x D)
        self.rows: list[torch.Tensor] = []
        # grouped dispatch: it runs this batch (set before it runs) and its [n, k] slot norms
        self.grouped = False
        self.norms: torch.Tensor | None = None


class SaliencyObserver:
    """Registers calibration hooks for every MoE layer and owns the accumulators.

    :param arch: the located MoE architecture
    :param register_hook: ``HooksMixin.register_hook`` of the owning modifier (so the
        pipeline's ``disable_hooks`` applies); signature ``(module, fn, hook_type, **kw)``
    :param model: the top module; its calls carry the attention mask that tells
        padding apart (without it, only the sequential pipeline's batches do)
    :param grouped: Kimi blocks' routed calibration forward runs the grouped dispatch
        (:mod:`~reap_modifier.calibration.kimi_grouped`) instead of their per-expert
        ``moe_infer`` loop; the statistics are the same
    """

    def __init__(
        self,
        arch: MoEArchitecture,
        register_hook: Callable[..., Any],
        model: torch.nn.Module | None = None,
        grouped: bool = True,
    ):
        self.arch = arch
        self._grouped = GroupedKimiDispatch(self._kimi_slot_sink) if grouped else None
        self._register = register_hook
        self._model = model
        self.accumulators = {
            layer.name: LayerAccumulator(arch.num_experts) for layer in arch.layers
        }
        self._pending: dict[str, Any] = {}
        # padding: the current model call's tokens, or the pipeline's cached batches
        self._batches = BatchTokenTracker(on_input_ids=self._keep_sample)
        self._block_tokens: dict[str, tuple[BatchTokens | None, torch.Tensor | None]] = {}
        #: the first calibration sample's ids (``[1, <=16]``): the wholeness check's forward
        self.sample_ids: torch.Tensor | None = None
        #: a few tokens of each MoE block's first input: the wholeness check runs the
        #: pruned block on them (models whose forward takes hidden states, not ids)
        self.block_inputs: dict[str, torch.Tensor] = {}

    @property
    def pipeline_batches(self) -> int:
        """Batches the sequential pipeline cached (kept after ``detach``): tells "no
        data" apart from "a pipeline that never called the MoE blocks"."""
        return self._batches.pipeline_batches

    # -- registration -------------------------------------------------------------

    def attach(self) -> None:
        self._batches.attach(self._model, self._register)
        for layer in self.arch.layers:
            self._register(
                layer.block, partial(self._block_pre, layer.name), "forward_pre", with_kwargs=True
            )
            if layer.kind == "experts_call":
                self._attach_experts_call(layer)
            elif layer.kind == "input_gated":
                self._register(layer.router, partial(self._gated_router, layer.name), "forward")
                self._register(layer.experts, partial(self._gated_experts, layer.name), "forward")
            else:
                self._attach_kimi(layer)

    def detach(self) -> None:
        """Stop listening to the pipeline (hooks are removed by their owner) and give
        Kimi blocks their own ``moe_infer`` back."""
        self._batches.detach()
        if self._grouped is not None:
            self._grouped.remove()

    # -- padding ------------------------------------------------------------------------

    def _keep_sample(self, input_ids) -> None:
        if self.sample_ids is None and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2:
            self.sample_ids = input_ids[:1, :16].detach().to("cpu").clone()

    def _block_pre(self, name: str, module, args: tuple, kwargs: dict):
        hidden = args[0] if args else kwargs.get("hidden_states", next(iter(kwargs.values()), None))
        lead = tuple(hidden.shape[:-1]) if isinstance(hidden, torch.Tensor) else ()
        if lead and name not in self.block_inputs:
            self.block_inputs[name] = sample_rows(hidden)
        tokens = self._batches.current(strict=True)
        valid = None
        if tokens is not None:
            routed = int(torch.Size(lead).numel()) if lead else tokens.positions
            if tokens.valid is not None:
                if tokens.valid.numel() != routed:
                    raise RuntimeError(
                        f"REAP observer: {name} routes {routed} positions but the batch's "
                        f"attention mask covers {tokens.valid.numel()}; cannot tell which "
                        "are padding (pass unpadded batches, e.g. batch_size=1)"
                    )
                valid = tokens.valid
        elif len(lead) == 2:
            tokens = BatchTokens(lead[0], lead[0] * lead[1])
        self._block_tokens[name] = (tokens, valid)

    def _take_tokens(self, name: str) -> tuple[torch.Tensor | None, int]:
        tokens, valid = self._block_tokens.pop(name, (None, None))
        return valid, tokens.samples if tokens is not None else 0

    def _attach_experts_call(self, layer: MoELayer) -> None:
        experts = layer.experts
        self._register(
            experts, partial(self._unroll_pre, layer.name), "forward_pre", with_kwargs=True
        )
        self._register(experts, partial(self._unroll_post, layer.name), "forward")

    def _attach_kimi(self, layer: MoELayer) -> None:
        self._register(layer.router, partial(self._kimi_gate, layer.name), "forward")
        for expert in layer.experts:
            self._register(expert, partial(self._kimi_expert, layer.name), "forward")
        self._register(layer.block, partial(self._kimi_block, layer.name), "forward")
        if self._grouped is not None:
            self._grouped.install(layer.name, layer.block)

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
        valid, samples = self._take_tokens(name)
        self.accumulators[name].add(ids, weights, norms64(out), valid, samples)
        combined = (out * weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
        return combined.to(dtype)

    # -- input_gated path ------------------------------------------------------------------

    def _gated_router(self, name: str, module, args: tuple, output: tuple):
        scores, logits = output[0], output[1]
        # the router's own selection: the same top-k of the same logits
        ids = logits.topk(self.arch.top_k, dim=-1).indices
        self._pending[name] = (ids, scores.gather(-1, ids))

    def _gated_experts(self, name: str, module, args: tuple, output: torch.Tensor):
        ids, gates = self._pending.pop(name)
        n, k = ids.shape
        rows = output.view(-1, n, output.shape[-1])  # [E, N, H], expert-major
        tokens = torch.arange(n, device=rows.device).unsqueeze(1).expand(n, k)
        contribution = norms64(rows[ids.to(rows.device), tokens])  # ||f_j(g x)||, [N, k]
        g = gates.to(contribution.device, torch.float64)
        norms = torch.where(g > 0, contribution / g, torch.zeros_like(contribution))
        valid, samples = self._take_tokens(name)
        self.accumulators[name].add(ids, gates, norms, valid, samples)

    # -- kimi path ------------------------------------------------------------------------

    def _kimi_gate(self, name: str, module, args: tuple, output: tuple):
        from llmcompressor.modeling.moe.context import get_calibrate_all_experts_flag

        ids, weights = output[0], output[1]
        self._pending[name] = _KimiBatch(
            ids, weights, get_calibrate_all_experts_flag(), self._take_tokens(name)
        )

    def _kimi_expert(self, name: str, module, args: tuple, output: torch.Tensor):
        batch = self._pending.get(name)
        if batch is not None and not batch.grouped:
            batch.rows.append(norms64(output) if batch.calibrate_all else output)

    def _kimi_slot_sink(self, name: str) -> Callable[[torch.Tensor], None] | None:
        """Where the grouped dispatch sends a routed forward's ``[n, k, D]`` slot
        outputs; None when no calibration batch of ``name`` is pending."""
        batch = self._pending.get(name)
        if batch is None or batch.calibrate_all:
            return None
        # set before the dispatch runs: its per-expert fallback calls the experts, whose
        # hooks must not keep their outputs
        batch.grouped = True

        def take(slot_out: torch.Tensor) -> None:
            batch.norms = norms64(slot_out)

        return take

    def _kimi_block(self, name: str, module, args: tuple, output: Any):
        batch: _KimiBatch | None = self._pending.pop(name, None)
        if batch is None:
            return
        ids = batch.ids
        n, k = ids.shape
        if batch.grouped:
            norms = batch.norms  # grouped dispatch: [n, k], slot order
        elif batch.calibrate_all:
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
        valid, samples = batch.tokens
        self.accumulators[name].add(ids, batch.weights, norms, valid, samples)

    # -- results ----------------------------------------------------------------------------

    def reset_pending(self) -> None:
        self._pending.clear()
        self._block_tokens.clear()
        if self._grouped is not None:
            self._grouped.drop_stack()

    def local_counts(self) -> dict[str, int]:
        """This process's samples, tokens and padding positions (every layer sees
        every batch; the largest count over layers)."""
        accs = list(self.accumulators.values())
        samples = max((a.samples for a in accs), default=0)
        tokens = max((a.tokens for a in accs), default=0)
        positions = max((a.positions for a in accs), default=0)
        return {"samples": samples, "tokens": tokens, "padding": positions - tokens}

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
