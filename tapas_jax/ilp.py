"""The integer-program baseline: Alpa's intra-op formulation solved by HiGHS (scipy milp).

One binary variable per (node, strategy), one continuous variable per (edge, strategy pair)
tied to both endpoints (``sum_j e_ij = x_ui``, ``sum_i e_ij = x_vj``, which makes ``e`` integral
whenever ``x`` is), objective = unary + edge costs, and the linear memory budget as one
constraint. It solves the same `tapas_jax.cost.Problem` the folded search solves; run on the
unfolded problem it is the baseline, with Alpa's simplifications already applied by the lowering:
followers merged into the node they follow, single-strategy nodes folded into their neighbours,
and edges whose cost splits per node moved into unary costs.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import scipy.sparse as sp
from scipy.optimize import Bounds, LinearConstraint, milp

from .cost import Problem

__all__ = ["IlpResult", "solve_ilp"]


@dataclasses.dataclass
class IlpResult:
    """The solver's choice and how it got there."""

    choice: np.ndarray
    objective: float
    seconds: float
    status: str
    optimal: bool
    mip_gap: float | None
    num_variables: int


def solve_ilp(
    prob: Problem, memory_limit: float | None = None, time_limit: float = 60.0
) -> IlpResult:
    """Minimises step seconds of `prob` under an optional memory limit.

    Args:
      prob: the problem.
      memory_limit: per-device bytes; None means unconstrained.
      time_limit: HiGHS time limit in seconds; the best incumbent is returned when it is hit.

    Returns:
      An `IlpResult`.

    Raises:
      RuntimeError: HiGHS found no feasible solution.
    """
    t0 = time.perf_counter()
    n = len(prob.sizes)
    unary = [prob.unary(i).copy() for i in range(n)]
    edges = {}
    for (u, v), t in prob.edges.items():
        if prob.sizes[u] == 1:
            unary[v] += t[0]
        elif prob.sizes[v] == 1:
            unary[u] += t[:, 0]
        else:
            edges[(u, v)] = t
    offset = np.zeros(n + 1, dtype=np.int64)
    for i in range(n):
        offset[i + 1] = offset[i] + prob.sizes[i]
    nx = int(offset[-1])
    e_off = {}
    cur = nx
    for key, t in edges.items():
        e_off[key] = cur
        cur += t.size
    nvar = cur
    c = np.zeros(nvar)
    for i in range(n):
        c[offset[i] : offset[i + 1]] = unary[i]
    for key, t in edges.items():
        c[e_off[key] : e_off[key] + t.size] = t.ravel()

    rows, cols, vals = [], [], []
    # one strategy per node
    node_of = np.repeat(np.arange(n), prob.sizes)
    rows.append(node_of)
    cols.append(np.arange(nx))
    vals.append(np.ones(nx))
    r = n
    for (u, v), t in edges.items():
        su, sv = t.shape
        idx = np.arange(su * sv).reshape(su, sv) + e_off[(u, v)]
        # sum_j e_ij - x_ui = 0 (rows r .. r+su), sum_i e_ij - x_vj = 0 (rows r+su .. r+su+sv)
        rows += [
            np.repeat(np.arange(su), sv) + r,
            np.tile(np.arange(sv), su) + r + su,
            np.arange(su) + r,
            np.arange(sv) + r + su,
        ]
        cols += [idx.ravel(), idx.ravel(), offset[u] + np.arange(su), offset[v] + np.arange(sv)]
        vals += [np.ones(su * sv), np.ones(su * sv), -np.ones(su), -np.ones(sv)]
        r += su + sv
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    lo = np.zeros(r)
    hi = np.zeros(r)
    lo[:n] = hi[:n] = 1.0
    constraints = [LinearConstraint(sp.csr_array((vals, (rows, cols)), shape=(r, nvar)), lo, hi)]
    if memory_limit is not None:
        mem = np.zeros(nvar)
        for i in range(n):
            mem[offset[i] : offset[i + 1]] = prob.memory[i]
        constraints.append(LinearConstraint(mem[None, :], -np.inf, memory_limit - prob.memory_base))
    integrality = np.zeros(nvar)
    integrality[:nx] = 1
    res = milp(
        c,
        integrality=integrality,
        bounds=Bounds(0.0, 1.0),
        constraints=constraints,
        options={"time_limit": float(time_limit), "disp": False},
    )
    seconds = time.perf_counter() - t0
    if res.x is None:
        raise RuntimeError(f"HiGHS found no feasible plan: {res.message}")
    choice = np.array(
        [int(np.argmax(res.x[offset[i] : offset[i + 1]])) for i in range(n)], dtype=np.int64
    )
    return IlpResult(
        choice=choice,
        objective=prob.objective(choice),
        seconds=seconds,
        status=str(res.message),
        optimal=res.status == 0,
        mip_gap=getattr(res, "mip_gap", None),
        num_variables=nvar,
    )
