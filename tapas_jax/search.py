"""Exact search over a (folded) problem by dynamic programming: min-sum variable elimination.

The folded problem of a layered model is small (one copy of each unique block, plus prologue and
epilogue) and its graph is narrow, so eliminating nodes one at a time in a greedy
smallest-new-table order solves it exactly: eliminating node ``x`` replaces every cost table that
mentions ``x`` by their sum minimised over ``x`` (remembering the argmin), and the choices are
read back in reverse order. If a table would exceed `MAX_TABLE` entries the search falls back to
the integer program on the same (folded) problem.

Memory: the budget is linear in the strategies, so it is enforced by Lagrangian relaxation, a
price per byte added to every strategy's cost and raised by bisection until the plan fits.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time

import numpy as np

from .cost import Problem
from .ilp import solve_ilp

__all__ = ["MemoryInfeasibleError", "SearchResult", "eliminate", "solve"]

MAX_TABLE = 4_000_000


class MemoryInfeasibleError(ValueError):
    """No plan fits the memory limit."""


@dataclasses.dataclass
class SearchResult:
    choice: np.ndarray
    objective: float
    seconds: float
    method: str
    memory_price: float = 0.0


def eliminate(prob: Problem, price: float = 0.0, max_table: int = MAX_TABLE) -> np.ndarray | None:
    """Exact min-sum over `prob` (costs + ``price`` * memory); None if a table grows too big."""
    n = len(prob.sizes)
    sizes = prob.sizes
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    by_var: list[set[int]] = [set() for _ in range(n)]
    fid = 0

    def add(scope: tuple[int, ...], table: np.ndarray) -> None:
        nonlocal fid
        factors[fid] = (scope, table)
        for x in scope:
            by_var[x].add(fid)
        fid += 1

    for i in range(n):
        add((i,), prob.unary(i) + price * prob.memory[i])
    for (u, v), t in prob.edges.items():
        add((u, v), t)
    alive = set(range(n))
    trace = []

    def neighbours(x: int) -> set[int]:
        out: set[int] = set()
        for f in by_var[x]:
            out.update(factors[f][0])
        out.discard(x)
        return out

    def new_table(x: int) -> int:
        return math.prod(sizes[y] for y in neighbours(x))

    # Smallest new table first (ties: lowest node); stale heap entries are skipped.
    cost_of = {x: new_table(x) for x in alive}
    heap = [(c, x) for x, c in cost_of.items()]
    heapq.heapify(heap)
    while alive:
        c, x = heapq.heappop(heap)
        if x not in alive or cost_of[x] != c:
            continue
        nb = sorted(neighbours(x))
        scope = [x, *nb]
        shape = [sizes[y] for y in scope]
        if math.prod(shape) > max_table:
            return None
        total = np.zeros(shape)
        where = {y: a for a, y in enumerate(scope)}
        for f in list(by_var[x]):
            fscope, table = factors.pop(f)
            for y in fscope:
                by_var[y].discard(f)
            pos = [where[y] for y in fscope]
            if pos != sorted(pos):
                table = table.transpose(sorted(range(len(fscope)), key=pos.__getitem__))
            bshape = [sizes[y] if y in fscope else 1 for y in scope]
            total = total + table.reshape(bshape)
        arg = np.argmin(total, axis=0)
        add(tuple(nb), np.min(total, axis=0))
        trace.append((x, tuple(nb), arg))
        alive.discard(x)
        for y in nb:
            cost_of[y] = new_table(y)
            heapq.heappush(heap, (cost_of[y], y))
    choice = np.zeros(n, dtype=np.int64)
    for x, nb, arg in reversed(trace):
        choice[x] = arg[tuple(int(choice[y]) for y in nb)] if nb else int(arg)
    return choice


def _solve_once(prob: Problem, price: float, time_limit: float) -> tuple[np.ndarray, str]:
    choice = eliminate(prob, price)
    if choice is not None:
        return choice, "dp"
    priced = dataclasses.replace(
        prob, compute=[c + price * m for c, m in zip(prob.compute, prob.memory)]
    )
    return solve_ilp(priced, time_limit=time_limit).choice, "ilp-folded"


def _memory(prob: Problem, choice: np.ndarray) -> float:
    return prob.memory_base + sum(float(prob.memory[i][c]) for i, c in enumerate(choice))


def solve(
    prob: Problem, memory_limit: float | None = None, time_limit: float = 60.0
) -> SearchResult:
    """Best plan of `prob` within `memory_limit` bytes per device.

    Raises:
      MemoryInfeasibleError: even the least-memory plan does not fit; the message states the
        smallest memory that would.
    """
    t0 = time.perf_counter()
    if memory_limit is not None and prob.min_memory() > memory_limit:
        raise MemoryInfeasibleError(
            f"no plan fits in {memory_limit / 2**30:.3f} GiB per device; the smallest memory "
            f"that would fit is {prob.min_memory() / 2**30:.3f} GiB "
            f"({prob.min_memory():.0f} bytes)"
        )
    choice, method = _solve_once(prob, 0.0, time_limit)
    price = 0.0
    if memory_limit is not None and _memory(prob, choice) > memory_limit:
        scale = prob.objective(choice) / max(_memory(prob, choice), 1.0)
        lo, hi = 0.0, scale * 1e-3
        best = None
        for _ in range(60):
            c, method = _solve_once(prob, hi, time_limit)
            if _memory(prob, c) <= memory_limit:
                best = c
                break
            lo, hi = hi, hi * 4
        if best is None:  # a huge price gives the least-memory plan
            best = np.array([int(np.argmin(m)) for m in prob.memory])
            hi = float("inf")
        else:
            for _ in range(20):
                mid = 0.5 * (lo + hi)
                c, method = _solve_once(prob, mid, time_limit)
                if _memory(prob, c) <= memory_limit:
                    best, hi = c, mid
                else:
                    lo = mid
        choice, price = best, hi
    return SearchResult(choice, prob.objective(choice), time.perf_counter() - t0, method, price)
