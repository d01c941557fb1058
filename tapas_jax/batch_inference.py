"""Batch-dimension inference: which dimension of every variable carries the batch.

The planner's default search space lets the data axis split only the batch (`batch_ok`): this
module labels, from the batched inputs, the batch dimension of every variable of the graph, through
followers (`tapas_jax.follower_rules`), dot products, convolutions, gathers and scatters, and the
scan carry / slice / stack of a scanned layer stack.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .follower_rules import ELEMENTWISE, follow, follow_operand
from .graph import Eqn, Graph
from .spec_algebra import MeshAxes, Spec

__all__ = ["batch_dims", "batch_ok"]


def batch_dims(
    graph: Graph, inputs_batched: Sequence[bool], size: int, folding=None
) -> list[int | None]:
    """Which dimension of every variable carries the batch (None: no batch dimension).

    Dimension 0 of each batched input is the batch if `size` divides it; the label flows through
    followers, dot products (a batch dimension that is contracted disappears, as in a weight
    gradient), convolutions, gathers and scatters. With a `folding`, copies after the
    representative take their labels from it instead of being propagated again.
    """
    # First equation of the copies after a block's representative -> (the equation after the
    # block, the copies' results, their representatives); results numbered consecutively are
    # given as a slice.
    skip_to: dict[int, tuple[int, list[int] | slice, list[int]]] = {}
    if folding is not None and folding.blocks:
        for b in folding.blocks:
            lo, hi = b.start + 2 * b.period, b.start + b.copies * b.period
            if hi > lo:
                res_eq, res_var, _ = graph.result_arrays()
                outs = res_var[np.searchsorted(res_eq, lo) : np.searchsorted(res_eq, hi)]
                reps = folding.rep_var[outs].tolist()
                if outs.size and np.all(np.diff(outs) == 1):
                    skip_to[lo] = (hi, slice(int(outs[0]), int(outs[-1]) + 1), reps)
                else:
                    skip_to[lo] = (hi, outs.tolist(), reps)
    bd: list[int | None] = [None] * graph.num_vars
    for v, batched in zip(graph.inputs, inputs_batched):
        if batched and graph.shapes[v] and graph.shapes[v][0] % size == 0:
            bd[v] = 0
    one = MeshAxes({"_b": size})
    hashes = None if folding is None or folding.hashes is None else folding.hashes.tolist()
    cache: dict[tuple, list[int | None]] = {}
    i, n = 0, len(graph.eqns)
    while i < n:
        if i in skip_to:  # copies after the representative take its labels
            hi, outs, reps = skip_to[i]
            if isinstance(outs, slice):
                bd[outs] = map(bd.__getitem__, reps)
            else:
                for o, r in zip(outs, reps):
                    bd[o] = bd[r]
            i = hi
            continue
        e = graph.eqns[i]
        i += 1
        outs = e.outvars
        if not outs:
            continue
        labelled = [(k, v) for k, v in enumerate(e.invars) if v is not None and bd[v] is not None]
        if not labelled:
            continue
        if hashes is None:
            res = _batch_of_results(e, graph, bd, labelled, one)
        else:  # equal local hashes and operand labels give equal result labels
            key = (hashes[i - 1], tuple(None if v is None else bd[v] for v in e.invars))
            res = cache.get(key)
            if res is None:
                res = cache[key] = _batch_of_results(e, graph, bd, labelled, one)
        for o, d in zip(outs, res):
            if d is not None and graph.shapes[o][d] % size == 0:
                bd[o] = d
    return bd


def _batch_of_results(
    e: Eqn, graph: Graph, bd: list[int | None], labelled: list[tuple[int, int]], one: MeshAxes
) -> list[int | None]:
    """Batch dimension of each result of `e`, given the labels `bd` of its operands."""
    outs = e.outvars
    p = e.prim
    res: list[int | None] = [None] * len(outs)
    if p == "dot_general":
        (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        ls, rs = graph.shapes[e.invars[0]], graph.shapes[e.invars[1]]
        lf = [d for d in range(len(ls)) if d not in lc and d not in lb]
        rf = [d for d in range(len(rs)) if d not in rc and d not in rb]
        for k, v in labelled:
            d = bd[v]
            b_, f_ = (lb, lf) if k == 0 else (rb, rf)
            if d in b_:
                res[0] = list(b_).index(d)
            elif d in f_:
                res[0] = len(lb) + (f_.index(d) if k == 0 else len(lf) + f_.index(d))
            if res[0] is not None:
                break
    elif p == "conv_general_dilated":
        dn = e.params["dimension_numbers"]
        if labelled[0][0] == 0 and bd[e.invars[0]] == dn.lhs_spec[0]:
            res[0] = dn.out_spec[0]
    elif p == "gather":
        if e.invars[1] is not None and bd[e.invars[1]] is not None:
            batch_out = [
                d
                for d in range(len(graph.shapes[outs[0]]))
                if d not in e.params["dimension_numbers"].offset_dims
            ]
            d = bd[e.invars[1]]
            if d < len(batch_out):
                res[0] = batch_out[d]
    elif p == "scan_carry":
        res[0] = bd[e.invars[0]] if e.invars[0] is not None else None
    elif p == "scan_slice":
        d = bd[e.invars[0]]
        res[0] = d - 1 if d else None
    elif p == "scan_stack":
        res[0] = bd[e.invars[0]] + 1
    elif p in ELEMENTWISE:
        oshape = graph.shapes[outs[0]]
        for _, v in labelled:
            if graph.shapes[v] == oshape:
                res = [bd[v]] * len(outs)
                break
    else:
        k = follow_operand(e, graph)
        if k is not None and e.invars[k] is not None and bd[e.invars[k]] is not None:
            spec: list[str | None] = [None] * len(graph.shapes[e.invars[k]])
            spec[bd[e.invars[k]]] = "_b"
            try:
                s = follow(e, graph, k, tuple(spec), one)
            except KeyError:
                s = None
            if s is not None:
                res = [o.index("_b") if "_b" in o else None for o in s.out_specs]
    return res


def batch_ok(spec: Spec, dim: int | None, axis: str) -> bool:
    """The batch rule: `axis` is on the batch dimension if there is one, nowhere otherwise."""
    if dim is None:
        return axis not in spec
    return spec[dim] == axis
