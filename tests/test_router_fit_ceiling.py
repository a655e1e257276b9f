"""The oracle bounds of ``benchmarks/router_fit_ceiling.py``: the simplex projection and
the constrained least squares the "oracle simplex" router solves per token."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).parents[1] / "benchmarks"


def _ceiling():
    sys.path.insert(0, str(BENCH))  # the benchmark imports its sibling window_metrics
    try:
        spec = importlib.util.spec_from_file_location(
            "router_fit_ceiling", BENCH / "router_fit_ceiling.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCH))


def test_projection_onto_the_scaled_simplex():
    c = _ceiling()
    v = torch.tensor([[0.5, 2.0, -1.0], [3.0, 3.0, 3.0]], dtype=torch.float64)
    w = c._project_simplex(v, 2.5)
    # [0.5, 2.0, -1.0]: theta = 0 -> [0.5, 2.0, 0]; equal entries split the total evenly
    assert torch.allclose(w, torch.tensor([[0.5, 2.0, 0.0], [2.5 / 3] * 3], dtype=torch.float64))


def test_simplex_least_squares_is_optimal_among_feasible_weights_and_above_free():
    c = _ceiling()
    torch.manual_seed(0)  # the Dirichlet sample
    g = torch.Generator().manual_seed(0)
    outs, target = torch.randn(4, 6, 16, generator=g), torch.randn(4, 16, generator=g)
    best = ((c._simplex_least_squares(outs, target, 2.5) - target) ** 2).sum(-1)
    free = ((c._least_squares(outs, target) - target) ** 2).sum(-1)
    w = torch.distributions.Dirichlet(torch.full((6,), 0.5)).sample((2000, 4)) * 2.5
    sampled = (((w.unsqueeze(2) @ outs).squeeze(2) - target) ** 2).sum(-1).min(0).values
    assert (best <= sampled + 1e-5).all()
    assert (free <= best + 1e-5).all() and (free < best).any()
