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
import heapq
import warnings

import numpy as np

from .graph import Graph, HeadIds

__all__ = ["Block", "Folding", "fold_repeated_blocks", "no_folding", "local_hashes"]

MIN_PERIOD = 6
_TRIES = 16
"""How many of the best-covering repeats are tried (wiring checked) before giving up."""


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


def _literal_key(lit) -> tuple:
    # The dtype itself, not ``dtype.str`` (which builds a string each time): equal either way.
    if isinstance(lit, np.generic | np.ndarray) and lit.size == 1:  # the usual literal
        return ("lit", lit.dtype, lit.item())
    a = np.asarray(lit)
    if a.size == 1:
        return ("lit", a.dtype, a.item())
    return ("lit", a.dtype, a.shape, hash(a.tobytes()))


def _literal_ids(lits: list) -> np.ndarray:
    """Equal ids for equal literals (`_literal_key`: dtype and value), numbered densely.

    Literals are scalars, so those of one dtype are read into one array and numbered by
    `np.unique` (-0.0 equals 0.0 and a NaN equals nothing, as with the keys); a group that is
    not all scalars is keyed literal by literal.
    """
    ids = np.empty(len(lits), dtype=np.int64)
    # A Python scalar is keyed as the array it converts to, as `_literal_key` does.
    lits = [x if hasattr(x, "dtype") else np.asarray(x) for x in lits]
    groups: dict = {}
    for j, lit in enumerate(lits):
        groups.setdefault(lit.dtype, []).append(j)
    n = 0
    for dtype, where in groups.items():
        members = [lits[j] for j in where]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an array of one element: keyed below
                values = np.fromiter(members, dtype, len(members))
            _, inverse = np.unique(values, return_inverse=True, equal_nan=False)
        except (TypeError, ValueError, DeprecationWarning):
            index: dict[tuple, int] = {}
            inverse = np.array([index.setdefault(_literal_key(x), len(index)) for x in members])
        ids[where] = n + inverse
        n += int(inverse.max(initial=-1)) + 1
    return ids


def graph_hash(graph: Graph) -> int:
    """Structural hash of a whole graph (primitives, shapes, params and wiring)."""
    hashes = local_hashes(graph)
    prod = graph.producers()
    wiring = []
    for e in graph.eqns:
        wiring.append(tuple(-2 if v is None else prod[v] for v in e.invars))
    return hash((tuple(hashes.tolist()), tuple(wiring)))


def local_hashes(graph: Graph) -> np.ndarray:
    """One integer per equation: primitive, parameters, operand and result avals.

    Equal integers mean equal keys (numbered from 1 in order of first appearance), not just
    equal hashes. Only the primitive and parameters are keyed equation by equation; operands
    and results are keyed in bulk, as one row of integers per equation.
    """
    eqns = graph.eqns
    n = len(eqns)
    aval = graph.aval_ids()[0]
    head = graph.heads
    if head is None:  # a graph built by hand; `build_graph` interns heads as it flattens
        heads = HeadIds()
        for e in eqns:
            heads.add(e, graph_hash(e.body) if e.body is not None else 0)
        head = heads.ids
    # Operands: the aval id of a variable, -2 - (literal id) for a literal; -1 pads the rows.
    eq, var, pos = graph.operand_slots()
    code = aval[var]
    lit = np.flatnonzero(var < 0)
    if lit.size:
        lits = [eqns[i].literals[k] for i, k in zip(eq[lit].tolist(), pos[lit].tolist())]
        code[lit] = -2 - _literal_ids(lits)
    res_eq, res_var, res_pos = graph.result_arrays()
    width_in = int(pos.max(initial=-1)) + 1
    width_out = int(res_pos.max(initial=-1)) + 1
    rows = np.full((n, 3 + width_in + width_out), -1, dtype=np.int64)
    rows[:, 0] = head
    rows[:, 1] = np.bincount(eq, minlength=n)
    rows[:, 2] = np.bincount(res_eq, minlength=n)
    rows[eq, 3 + pos] = code
    rows[res_eq, 3 + width_in + res_pos] = aval[res_var]
    return _row_ids(rows)


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Equal ids for equal rows of an integer matrix, numbered from 1 by first appearance.

    Each row becomes one exact integer (mixed radix over the columns, re-numbered densely
    whenever the next column would overflow), which sorts far faster than rows do.
    """
    key = np.zeros(len(rows), dtype=np.int64)
    radix = 1
    for col in rows.T:
        col = col - col.min(initial=0)
        span = int(col.max(initial=0)) + 1
        if radix * span >= 2**62:
            _, key = np.unique(key, return_inverse=True)
            radix = int(key.max(initial=0)) + 1
        key = key * span + col
        radix *= span
    _, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    rank = np.empty(len(first), dtype=np.int64)
    rank[np.argsort(first)] = np.arange(1, len(first) + 1)
    return rank[inverse]


def _longest_run(mask: np.ndarray) -> tuple[int, int]:
    """Start and length of the first longest run of True in `mask` ((0, 0) if there is none)."""
    # The runs lie between consecutive False entries (and the two ends).
    breaks = np.flatnonzero(~mask)
    if breaks.size == 0:
        return 0, len(mask)
    start, length = 0, int(breaks[0])  # the run before the first break
    if breaks.size > 1:
        inner = np.diff(breaks) - 1
        k = int(np.argmax(inner))
        if inner[k] > length:
            start, length = int(breaks[k]) + 1, int(inner[k])
    if len(mask) - 1 - int(breaks[-1]) > length:  # the run after the last break
        start, length = int(breaks[-1]) + 1, len(mask) - 1 - int(breaks[-1])
    return (start, length) if length else (0, 0)


def _candidate_periods(seg: np.ndarray, min_period: int) -> list[int]:
    order = np.argsort(seg, kind="stable")
    s = seg[order]
    same = s[1:] == s[:-1]
    gaps = (order[1:] - order[:-1])[same]
    gaps = np.unique(np.abs(gaps))
    return [int(g) for g in gaps if g >= min_period and g <= len(seg) // 2]


def _copies_wired_alike(graph: Graph, start: int, period: int, copies: int) -> int:
    """How many leading copies of a tandem repeat read their operands alike (0 if fewer than 2).

    Every operand gets a wiring code: the result (position relative to its copy, result index)
    it reads when that lies in the same copy or the previous one, else 0 ("external"). Copies
    2, 3, ... must match copy 1 exactly; copy 0 may read from outside where copy 1 reads from
    the previous copy. Equal local hashes give every copy the same operands, position by
    position, so the codes of each copy line up.
    """
    if copies < 2:
        return 0
    eq, var, _, _ = graph.operand_arrays()
    bounds = np.searchsorted(eq, start + period * np.arange(copies + 1))
    if np.any(np.diff(bounds) != bounds[1] - bounds[0]):
        return 0  # not a tandem repeat of equal local hashes
    eq, var = eq[bounds[0] : bounds[-1]], var[bounds[0] : bounds[-1]]
    copy = (eq - start) // period
    rel = graph.producer_array()[var] - (start + copy * period)
    local = (rel < period) & (rel >= np.where(copy > 0, -period, 0))
    position = graph.result_position_array()[var]
    stride = int(position.max(initial=0)) + 1
    code = np.where(local, (rel + period) * stride + position + 1, 0).reshape(copies, -1)
    ref = code[1]
    ref_prev = (local & (rel < 0)).reshape(copies, -1)[1]
    if not np.all((code[0] == ref) | ((code[0] == 0) & ref_prev)):
        return 0
    differs = np.flatnonzero((code[2:] != ref).any(axis=1))
    return int(differs[0]) + 2 if differs.size else copies


def _find(graph: Graph, hashes, lo, hi, min_period, out: list[Block]) -> None:
    seg = hashes[lo:hi]
    if len(seg) < 2 * min_period:
        return
    # A period covers at most its matching positions + period equations. Repeats are tried
    # (wiring checked) best first: most equations covered, then the shorter period, the later
    # start, more copies; each period's longest run is only worked out once its bound could
    # still beat the best repeat found so far.
    masks = {p: seg[:-p] == seg[p:] for p in _candidate_periods(seg, min_period)}
    bound = sorted(((int(np.count_nonzero(m)) + p, p) for p, m in masks.items()), reverse=True)
    best: list[tuple[int, int, int, int]] = []  # heap of (-covered, period, -start, -copies)
    j = 0
    for _ in range(_TRIES):
        while j < len(bound) and (not best or -best[0][0] <= bound[j][0]):
            period = bound[j][1]
            j += 1
            s, length = _longest_run(masks[period])
            copies = (length + period) // period
            if copies >= 2:
                heapq.heappush(best, (-copies * period, period, -s, -copies))
        if not best:
            return
        _, period, neg_s, neg_copies = heapq.heappop(best)
        start = lo - neg_s
        copies = _copies_wired_alike(graph, start, period, -neg_copies)
        if copies >= 2:
            out.append(Block(start, period, copies))
            _find(graph, hashes, lo, start, min_period, out)
            _find(graph, hashes, start + copies * period, hi, min_period, out)
            return


def no_folding(graph: Graph) -> Folding:
    """The identity folding (every equation its own representative): the unfolded problem."""
    n = len(graph.eqns)
    weights = graph.eqn_weights().copy()
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
    hashes = local_hashes(graph)
    blocks: list[Block] = []
    _find(graph, hashes, 0, len(eqns), min_period, blocks)
    blocks.sort(key=lambda b: b.start)
    fold = no_folding(graph)
    rep_eqn, rep_var, count = fold.rep_eqn, fold.rep_var, fold.count
    for b in blocks:
        rep = np.arange(b.start + b.period, b.start + 2 * b.period)
        copied = np.arange(b.start, b.start + b.copies * b.period)
        rep_eqn[copied] = rep[(copied - b.start) % b.period]
        weights = count[rep]
        count[copied] = 0
        count[rep] = b.copies * weights
    # Results map to the result at the same position of the representative equation.
    res_eq, res_var, res_pos = graph.result_arrays()
    first_result = np.searchsorted(res_eq, np.arange(len(eqns)))
    rep_var[res_var] = res_var[first_result[rep_eqn[res_eq]] + res_pos]
    # Inputs (per-layer params) map to the input read at the same place in the representative,
    # where an input's first read is in a copy (not in a representative equation).
    is_input = np.zeros(graph.num_vars, dtype=bool)
    is_input[graph.inputs] = True
    op_eq, op_var, op_pos, _ = graph.operand_arrays()
    read = np.flatnonzero(is_input[op_var])
    _, first = np.unique(op_var[read], return_index=True)
    j = read[first]
    i, v, k = op_eq[j], op_var[j], op_pos[j]
    r = rep_eqn[i]
    # operand k of the representative (equal local hashes: as many operands), by its slot
    slot_eq, slot_var, _ = graph.operand_slots()
    w = slot_var[np.searchsorted(slot_eq, r) + k]
    aval = graph.aval_ids()[0]
    ok = (r != i) & (w >= 0)
    ok[ok] = is_input[w[ok]] & (aval[v[ok]] == aval[w[ok]])  # an input of the same aval
    rep_var[v[ok]] = w[ok]
    for v in graph.inputs:  # representatives map to themselves
        if rep_var[rep_var[v]] != rep_var[v]:
            rep_var[v] = v
    return Folding(blocks, rep_eqn, rep_var, count, list(graph.scans), hashes)
