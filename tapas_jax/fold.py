"""Folding: find the repeated layers of a flattened graph by structural hashing.

Each equation gets a *local hash* of its primitive, its parameters (sub-jaxprs by their own
structural hash) and the shapes and dtypes of its operands and results (literal values included).
An unrolled stack of N identical layers shows up as a tandem repeat in the sequence of local
hashes: a run where ``h[i] == h[i + P]`` for a period P. `fold_repeated_blocks` finds the repeat
that covers the most equations (the forward layers), validates its *wiring* (every operand read
inside one copy comes from the same position of the same copy, or of the previous copy, in every
copy after the first), then searches again on both sides of it (the backward layers, the
optimizer update), recursively.

The result maps each equation and variable to a representative in copy 1 of its block (copy 0
can differ at its boundary with the prologue), with multiplicities. The search then solves only
representatives: the folded problem is exactly the original one with every copy of a block
constrained to the same strategy. A ``scan`` is already folded: its body counts ``length`` times.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np

from .graph import Eqn, Graph

__all__ = ["Block", "Folding", "fold_repeated_blocks", "no_folding", "local_hashes"]

MIN_PERIOD = 6


@dataclasses.dataclass(frozen=True)
class Block:
    """A tandem repeat: ``copies`` copies of ``period`` equations starting at ``start``."""

    start: int
    period: int
    copies: int


@dataclasses.dataclass
class Folding:
    """Representatives of equations and variables, and how many times each representative counts."""

    blocks: list[Block]
    rep_eqn: np.ndarray
    rep_var: np.ndarray
    count: np.ndarray
    """Multiplicity of each representative equation (0 for non-representatives); includes
    the weight of scan bodies."""
    scans: list[int] = dataclasses.field(default_factory=list)
    """Lengths of the scans (each an already folded block)."""
    hashes: np.ndarray | None = None
    """Local structural hash of every equation (equal hashes: equal rules), if computed."""

    @property
    def layers(self) -> int:
        return max([b.copies for b in self.blocks] + list(self.scans) + [0])

    @property
    def unique_blocks(self) -> int:
        return len(self.blocks) + len(self.scans)

    @property
    def eqns_before(self) -> int:
        return len(self.rep_eqn)

    @property
    def eqns_after(self) -> int:
        return int(np.count_nonzero(self.count))


def _param_key(v) -> str:
    if isinstance(v, bool | int | float | str | type(None) | np.dtype | enum.Enum):
        return repr(v)
    if isinstance(v, tuple | list):
        return "(" + ",".join(_param_key(x) for x in v) + ")"
    if hasattr(v, "_fields"):  # NamedTuple dimension numbers
        return type(v).__name__ + _param_key(tuple(v))
    if isinstance(v, np.ndarray):
        return f"array{v.shape}{v.dtype}"
    if hasattr(v, "dtype") and hasattr(v, "shape"):
        return f"array{tuple(v.shape)}{v.dtype}"
    return type(v).__name__


def _params_key(params: dict) -> tuple:
    # A primitive binds its params in a fixed order, so no sorting is needed.
    items = tuple(params.items())
    try:
        hash(items)
        return items
    except TypeError:  # an array-valued param (constants): describe it by shape and dtype
        return tuple((k, _param_key(v)) for k, v in items)


def _literal_key(lit) -> tuple:
    a = np.asarray(lit)
    if a.size == 1:
        return ("lit", a.dtype.str, a.item())
    return ("lit", a.dtype.str, a.shape, hash(a.tobytes()))


def graph_hash(graph: Graph) -> int:
    """Structural hash of a whole graph (primitives, shapes, params and wiring)."""
    hashes = local_hashes(graph)
    prod = graph.producers()
    wiring = []
    for e in graph.eqns:
        wiring.append(tuple(-2 if v is None else prod[v] for v in e.invars))
    return hash((tuple(hashes.tolist()), tuple(wiring)))


def local_hashes(graph: Graph) -> np.ndarray:
    """One integer per equation: primitive, parameters, operand and result avals."""
    out = np.empty(len(graph.eqns), dtype=np.int64)
    cache: dict[tuple, int] = {}
    shapes, dtypes = graph.shapes, graph.dtypes
    for i, e in enumerate(graph.eqns):
        key = (
            e.prim,
            _params_key(e.params),
            tuple(
                (shapes[v], dtypes[v]) if v is not None else _literal_key(lit)
                for v, lit in zip(e.invars, e.literals)
            ),
            tuple((shapes[v], dtypes[v]) for v in e.outvars),
            graph_hash(e.body) if e.body is not None else 0,
            e.weight,
        )
        h = cache.get(key)
        if h is None:
            h = cache[key] = len(cache) + 1
        out[i] = h
    return out


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    if not mask.any():
        return 0, 0
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    d = np.diff(padded)
    starts = np.flatnonzero(d == 1)
    ends = np.flatnonzero(d == -1)
    lengths = ends - starts
    k = int(np.argmax(lengths))
    return int(starts[k]), int(lengths[k])


def _candidate_periods(seg: np.ndarray, min_period: int) -> list[int]:
    order = np.argsort(seg, kind="stable")
    s = seg[order]
    same = s[1:] == s[:-1]
    gaps = (order[1:] - order[:-1])[same]
    gaps = np.unique(np.abs(gaps))
    return [int(g) for g in gaps if g >= min_period and g <= len(seg) // 2]


def _wiring(eqns: list[Eqn], producer: list[int], start: int, period: int, copy: int):
    base = start + copy * period
    sig = []
    for j in range(period):
        e = eqns[base + j]
        row = []
        for v in e.invars:
            if v is None:
                row.append(("lit",))
                continue
            p = producer[v]
            if base <= p < base + period:
                row.append(("in", p - base, e_out_index(eqns[p], v)))
            elif base - period <= p < base and copy > 0:
                row.append(("prev", p - base + period, e_out_index(eqns[p], v)))
            else:
                row.append(("ext",))
        sig.append(tuple(row))
    return sig


def e_out_index(e: Eqn, v: int) -> int:
    return e.outvars.index(v)


def _valid(eqns, producer, start, period, copies) -> bool:
    if copies < 2:
        return False
    ref = _wiring(eqns, producer, start, period, 1)
    for c in range(2, copies):
        if _wiring(eqns, producer, start, period, c) != ref:
            return False
    first = _wiring(eqns, producer, start, period, 0)
    for a, b in zip(first, ref):
        for x, y in zip(a, b):
            if x != y and not (y[0] == "prev" and x[0] == "ext"):
                return False
    return True


def _find(hashes, eqns, producer, lo, hi, min_period, out: list[Block]) -> None:
    seg = hashes[lo:hi]
    if len(seg) < 2 * min_period:
        return
    scored = []
    for period in _candidate_periods(seg, min_period):
        s, length = _longest_run(seg[:-period] == seg[period:])
        copies = (length + period) // period
        if copies >= 2:
            scored.append((copies * period, -period, s, copies))
    scored.sort(reverse=True)
    for _covered, neg_p, s, copies in scored[:16]:
        period = -neg_p
        start = lo + s
        while copies >= 2 and not _valid(eqns, producer, start, period, copies):
            copies -= 1
        if copies >= 2:
            out.append(Block(start, period, copies))
            _find(hashes, eqns, producer, lo, start, min_period, out)
            _find(hashes, eqns, producer, start + copies * period, hi, min_period, out)
            return


def no_folding(graph: Graph) -> Folding:
    """The identity folding (every equation its own representative): the unfolded problem."""
    n = len(graph.eqns)
    weights = np.array([e.weight for e in graph.eqns], dtype=np.float64)
    return Folding([], np.arange(n), np.arange(graph.num_vars), weights, list(graph.scans))


def fold_repeated_blocks(graph: Graph, min_period: int = MIN_PERIOD) -> Folding:
    """Finds repeated blocks and maps every equation and variable to a representative.

    Args:
      graph: the flattened graph.
      min_period: the smallest block (in equations) worth folding.

    Returns:
      A `Folding`; without repeats it is the identity.
    """
    eqns = graph.eqns
    producer = graph.producers()
    hashes = local_hashes(graph)
    blocks: list[Block] = []
    _find(hashes, eqns, producer, 0, len(eqns), min_period, blocks)
    blocks.sort(key=lambda b: b.start)
    fold = no_folding(graph)
    rep_eqn, rep_var, count = fold.rep_eqn, fold.rep_var, fold.count
    for b in blocks:
        rep_base = b.start + b.period
        for c in range(b.copies):
            base = b.start + c * b.period
            for j in range(b.period):
                i, r = base + j, rep_base + j
                rep_eqn[i] = r
                count[i] = 0
                for v, w in zip(eqns[i].outvars, eqns[r].outvars):
                    rep_var[v] = w
        for j in range(b.period):
            count[rep_base + j] = b.copies * eqns[rep_base + j].weight
    # Inputs (per-layer params) map to the input read at the same place in the representative.
    seen_input = np.zeros(graph.num_vars, dtype=bool)
    is_input = np.zeros(graph.num_vars, dtype=bool)
    is_input[graph.inputs] = True
    for i, e in enumerate(eqns):
        r = rep_eqn[i]
        if r == i:
            for v in e.invars:
                if v is not None and is_input[v]:
                    seen_input[v] = True
            continue
        for v, w in zip(e.invars, eqns[r].invars):
            if v is None or w is None or not is_input[v] or seen_input[v]:
                continue
            seen_input[v] = True
            if (
                is_input[w]
                and graph.shapes[v] == graph.shapes[w]
                and graph.dtypes[v] == (graph.dtypes[w])
            ):
                rep_var[v] = w
    for v in graph.inputs:  # representatives map to themselves
        if rep_var[rep_var[v]] != rep_var[v]:
            rep_var[v] = v
    return Folding(blocks, rep_eqn, rep_var, count, list(graph.scans), hashes)
