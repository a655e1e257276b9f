"""Ridge least squares of a block's output projections, solved independently (test oracle).

Nothing here imports the product. What a block's output is linear in is read off the
block's own forward: a projection's weight (and bias) doubled in place adds its
contribution once more, so ``out(2W) - out(W)`` is the contribution ``c_t o_t`` of token
``t`` (``o_t`` the projection's output, ``c_t`` its per-token scale: 1, or Qwen's sigmoid
shared-expert gate); the features of that projection are ``c_t [a_t, 1]`` (``a_t`` its
input, the ``1`` only with a bias) and the rest of the output is ``out - sum of the
contributions``. The regularised solutions come from ``numpy.linalg.lstsq`` on the
augmented system ``[F; sqrt(r s) I] W^T = [T; 0]`` (``s`` the mean diagonal of the fitting
rows' Gram matrix; with more features than rows, the dual form ``F^T (F F^T + r s I)^-1 T``),
one per regulariser, in float64; the held-out rows are every 8th.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HOLDOUT_EVERY", "held_out", "linear_features", "ridge_fits"]

#: the fits' documented held-out rule: every 8th row
HOLDOUT_EVERY = 8


def held_out(rows: int) -> torch.Tensor:
    """``[rows]`` bool: the held-out rows (every 8th)."""
    held = torch.zeros(rows, dtype=torch.bool)
    held[HOLDOUT_EVERY - 1 :: HOLDOUT_EVERY] = True
    return held


def _block_out(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    out = out[0] if isinstance(out, tuple) else out
    return out.reshape(x.shape[0], -1).double()


def linear_features(block, x: torch.Tensor, paths: list[str]):
    """``(features [N, F] f64, rest [N, H] f64, current [H, F] f64, widths)`` for the
    projections ``paths`` of ``block`` on inputs ``x`` ``[N, H]`` (see the module
    docstring); ``current`` holds the weights now, ``[W | b]`` per projection."""
    seen = {}
    modules = [block.get_submodule(p) for p in paths]
    hooks = [
        m.register_forward_hook(lambda m, a, o, p=p: seen.__setitem__(p, (a[0], o)))
        for p, m in zip(paths, modules, strict=True)
    ]
    try:
        out = _block_out(block, x)
        io = {p: seen[p] for p in paths}
        contributions = []
        for m in modules:
            tensors = [t for t in (m.weight, m.bias) if t is not None]
            saved = [t.detach().clone() for t in tensors]
            with torch.no_grad():
                for t in tensors:
                    t.mul_(2)
            try:
                contributions.append(_block_out(block, x) - out)
            finally:
                with torch.no_grad():
                    for t, old in zip(tensors, saved, strict=True):
                        t.copy_(old)
    finally:
        for h in hooks:
            h.remove()
    feats, current, widths = [], [], []
    for p, m, extra in zip(paths, modules, contributions, strict=True):
        a, o = (t.reshape(x.shape[0], -1).double() for t in io[p])
        c = (extra * o).sum(-1) / o.pow(2).sum(-1)
        parts = [a] + (
            [torch.ones(x.shape[0], 1, dtype=torch.float64)] if m.bias is not None else []
        )
        feats.append(c[:, None] * torch.cat(parts, 1))
        current += [m.weight.detach().double()]
        if m.bias is not None:
            current.append(m.bias.detach().double()[:, None])
        widths.append(feats[-1].shape[1])
    rest = out - sum(contributions)
    return torch.cat(feats, 1), rest, torch.cat(current, 1), widths


def ridge_fits(features, rest, targets, current, grid):
    """Held-out relative squared error of ``current`` and, per regulariser of ``grid``, the
    ridge solution on the fitting rows and its held-out error:
    ``(before, {ridge: (error, W [H, F])})``. ``targets``: the unpruned block's outputs."""
    held = held_out(features.shape[0]).numpy()
    F = features.detach().double().numpy()
    T = (targets.detach().double() - rest.detach()).numpy()
    norm = float((targets.detach().double().numpy()[held] ** 2).sum())
    f_fit, t_fit, f_held, t_held = F[~held], T[~held], F[held], T[held]

    def error(w: np.ndarray) -> float:
        return float(((f_held @ w.T - t_held) ** 2).sum()) / norm

    scale = float((f_fit**2).sum(0).mean())
    fits = {}
    for ridge in grid:
        rows, width = f_fit.shape
        if ridge == 0:  # the least-squares (minimum-norm when rank-deficient) solution
            w = np.linalg.lstsq(f_fit, t_fit, rcond=1e-6)[0].T
        elif width > rows:  # the same ridge solution in its dual form: F^T (F F^T + r s I)^-1 T
            w = (f_fit.T @ np.linalg.solve(f_fit @ f_fit.T + ridge * scale * np.eye(rows), t_fit)).T
        else:
            a = np.concatenate([f_fit, np.sqrt(ridge * scale) * np.eye(width)])
            b = np.concatenate([t_fit, np.zeros((width, T.shape[1]))])
            w = np.linalg.lstsq(a, b, rcond=None)[0].T
        fits[ridge] = (error(w), torch.from_numpy(w))
    return error(current.detach().double().numpy()), fits
