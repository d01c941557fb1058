"""Leader rules: ops with sharding choices of their own, in the style of Alpa's intra-op pass.

`leader_strategies` enumerates an equation's strategies: ``dot_general`` (each mesh axis on a
batch, free or contracting dimension; contracting means an all-reduce of the partial sums),
``conv_general_dilated`` (batch, output feature or input feature), ``gather`` and ``scatter-add``
(embeddings: index batch, passthrough or indexed dimension), a scan carry (any spec, the same on
both sides), and sources (``iota``, constants) which are replicated, since slicing a replicated
value is free.

A primitive without a rule (`has_rule` is False) is planned conservatively: its operands and
results are replicated, and the planner warns. That may cost communication but never produces a
wrong plan.
"""

from __future__ import annotations

import itertools
import math

from .follower_rules import FOLLOWERS
from .graph import Eqn, Graph
from .spec_algebra import MeshAxes, Strategy, array_bytes, candidate_specs, replicated

__all__ = ["SOURCES", "LEADERS", "leader_strategies", "has_rule"]

SOURCES = {
    "iota",
    "constant",
    "rng_uniform",
    "random_seed",
    "random_bits",
    "random_wrap",
    "random_unwrap",
    "threefry2x32",
}

LEADERS = {"dot_general", "conv_general_dilated", "gather", "scatter-add", "scan_carry"}
"""Primitives with their own strategies (besides the replicated SOURCES)."""


def _assignments(targets: list, axes: MeshAxes, size_of) -> list[dict[str, object]]:
    """Every map mesh axis -> target (or None) with distinct targets that the axis divides."""
    options = []
    for a in axes.names:
        options.append([None] + [t for t in targets if size_of(t) % axes.sizes[a] == 0])
    out = []
    for combo in itertools.product(*options):
        used = [t for t in combo if t is not None]
        if len(used) != len(set(used)):
            continue
        out.append({a: t for a, t in zip(axes.names, combo) if t is not None})
    return out


def _dot(eqn: Eqn, graph: Graph, axes: MeshAxes) -> list[Strategy]:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    ls, rs = graph.shapes[lhs], graph.shapes[rhs]
    out = eqn.outvars[0]
    os_ = graph.shapes[out]
    item = graph.dtypes[out].itemsize
    lf = [d for d in range(len(ls)) if d not in lc and d not in lb]
    rf = [d for d in range(len(rs)) if d not in rc and d not in rb]
    targets = (
        [("b", i) for i in range(len(lb))]
        + [("m", i) for i in range(len(lf))]
        + [("n", i) for i in range(len(rf))]
        + [("c", i) for i in range(len(lc))]
    )

    def size_of(t):
        kind, i = t
        if kind == "b":
            return ls[lb[i]]
        if kind == "m":
            return ls[lf[i]]
        if kind == "n":
            return rs[rf[i]]
        return ls[lc[i]]

    total_flops = 2.0 * math.prod(os_) * math.prod(ls[d] for d in lc)
    strategies = []
    for asg in _assignments(targets, axes, size_of):
        lspec: list[str | None] = [None] * len(ls)
        rspec: list[str | None] = [None] * len(rs)
        ospec: list[str | None] = [None] * len(os_)
        partial = []
        for a, (kind, i) in asg.items():
            if kind == "b":
                lspec[lb[i]] = rspec[rb[i]] = ospec[i] = a
            elif kind == "m":
                lspec[lf[i]] = ospec[len(lb) + i] = a
            elif kind == "n":
                rspec[rf[i]] = ospec[len(lb) + len(lf) + i] = a
            else:
                lspec[lc[i]] = rspec[rc[i]] = a
                partial.append(a)
        ospec_t = tuple(ospec)
        out_bytes = array_bytes(os_, item) / axes.shards(ospec_t)
        comms = tuple(("all-reduce", a, out_bytes) for a in partial)
        used = math.prod(axes.sizes[a] for a in asg)
        strategies.append(
            Strategy((ospec_t,), (tuple(lspec), tuple(rspec)), comms, total_flops / used, 0.0)
        )
    return strategies


def _conv(eqn: Eqn, graph: Graph, axes: MeshAxes) -> list[Strategy] | None:
    prm = eqn.params
    if prm.get("feature_group_count", 1) != 1 or prm.get("batch_group_count", 1) != 1:
        return None
    dn = prm["dimension_numbers"]
    lhs_spec, rhs_spec, out_spec = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    lhs, rhs = eqn.invars
    ls, rs = graph.shapes[lhs], graph.shapes[rhs]
    out = eqn.outvars[0]
    os_ = graph.shapes[out]
    item = graph.dtypes[out].itemsize
    sizes = {"batch": ls[lhs_spec[0]], "cout": rs[rhs_spec[0]], "cin": ls[lhs_spec[1]]}
    total_flops = 2.0 * math.prod(os_) * math.prod(rs) / rs[rhs_spec[0]]
    strategies = []
    for asg in _assignments(["batch", "cout", "cin"], axes, lambda t: sizes[t]):
        lsp: list[str | None] = [None] * len(ls)
        rsp: list[str | None] = [None] * len(rs)
        osp: list[str | None] = [None] * len(os_)
        partial = []
        for a, t in asg.items():
            if t == "batch":
                lsp[lhs_spec[0]] = osp[out_spec[0]] = a
            elif t == "cout":
                rsp[rhs_spec[0]] = osp[out_spec[1]] = a
            else:
                lsp[lhs_spec[1]] = rsp[rhs_spec[1]] = a
                partial.append(a)
        o = tuple(osp)
        out_bytes = array_bytes(os_, item) / axes.shards(o)
        used = math.prod(axes.sizes[a] for a in asg)
        strategies.append(
            Strategy(
                (o,),
                (tuple(lsp), tuple(rsp)),
                tuple(("all-reduce", a, out_bytes) for a in partial),
                total_flops / used,
            )
        )
    return strategies


def _gather(eqn: Eqn, graph: Graph, axes: MeshAxes) -> list[Strategy] | None:
    dn = eqn.params["dimension_numbers"]
    operand, indices = eqn.invars
    if operand is None or indices is None:
        return None
    osh, ish = graph.shapes[operand], graph.shapes[indices]
    out = eqn.outvars[0]
    outsh = graph.shapes[out]
    item = graph.dtypes[out].itemsize
    slice_sizes = eqn.params["slice_sizes"]
    if dn.operand_batching_dims or len(dn.start_index_map) != 1 or ish[-1] != 1:
        return None
    indexed = dn.start_index_map[0]
    if indexed not in dn.collapsed_slice_dims:
        return None
    passthrough = [
        d for d in range(len(osh)) if d not in dn.collapsed_slice_dims and slice_sizes[d] == osh[d]
    ]
    offset_of = {}
    window = [d for d in range(len(osh)) if d not in dn.collapsed_slice_dims]
    for od, d in zip(dn.offset_dims, window):
        offset_of[d] = od
    batch_out = [d for d in range(len(outsh)) if d not in dn.offset_dims]
    nb = len(ish) - 1
    targets = (
        [("i", i) for i in range(nb)]
        + [("p", d) for d in passthrough if d in offset_of]
        + [("v", indexed)]
    )

    def size_of(t):
        return ish[t[1]] if t[0] == "i" else osh[t[1]]

    strategies = []
    for asg in _assignments(targets, axes, size_of):
        osp: list[str | None] = [None] * len(osh)
        isp: list[str | None] = [None] * len(ish)
        outp: list[str | None] = [None] * len(outsh)
        partial = []
        for a, (kind, d) in asg.items():
            if kind == "i":
                isp[d] = outp[batch_out[d]] = a
            elif kind == "p":
                osp[d] = outp[offset_of[d]] = a
            else:
                osp[d] = a
                partial.append(a)
        o = tuple(outp)
        out_bytes = array_bytes(outsh, item) / axes.shards(o)
        strategies.append(
            Strategy(
                (o,),
                (tuple(osp), tuple(isp)),
                tuple(("all-reduce", a, out_bytes) for a in partial),
                0.0,
                out_bytes * 2,
            )
        )
    return strategies


def _scatter_add(eqn: Eqn, graph: Graph, axes: MeshAxes) -> list[Strategy] | None:
    dn = eqn.params["dimension_numbers"]
    operand, indices, updates = eqn.invars
    if operand is None or indices is None or updates is None:
        return None
    osh, ish, ush = graph.shapes[operand], graph.shapes[indices], graph.shapes[updates]
    item = graph.dtypes[eqn.outvars[0]].itemsize
    if dn.operand_batching_dims or len(dn.scatter_dims_to_operand_dims) != 1 or ish[-1] != 1:
        return None
    indexed = dn.scatter_dims_to_operand_dims[0]
    if indexed not in dn.inserted_window_dims:
        return None
    window_operand = [d for d in range(len(osh)) if d not in dn.inserted_window_dims]
    win_map = {d: ud for d, ud in zip(window_operand, dn.update_window_dims) if ush[ud] == osh[d]}
    scatter_dims = [d for d in range(len(ush)) if d not in dn.update_window_dims]
    nb = len(ish) - 1
    if len(scatter_dims) != nb:
        return None
    targets = [("i", i) for i in range(nb)] + [("p", d) for d in win_map] + [("v", indexed)]

    def size_of(t):
        return ish[t[1]] if t[0] == "i" else osh[t[1]]

    strategies = []
    for asg in _assignments(targets, axes, size_of):
        osp: list[str | None] = [None] * len(osh)
        isp: list[str | None] = [None] * len(ish)
        usp: list[str | None] = [None] * len(ush)
        partial = []
        for a, (kind, d) in asg.items():
            if kind == "i":
                isp[d] = usp[scatter_dims[d]] = a
                partial.append(a)
            elif kind == "p":
                osp[d] = usp[win_map[d]] = a
            else:
                osp[d] = a
        o = tuple(osp)
        out_bytes = array_bytes(osh, item) / axes.shards(o)
        strategies.append(
            Strategy(
                (o,),
                (o, tuple(isp), tuple(usp)),
                tuple(("all-reduce", a, out_bytes) for a in partial),
                0.0,
                out_bytes * 2,
            )
        )
    return strategies


def _with_reduce_scatter(strategies: list[Strategy], shape, axes: MeshAxes) -> list[Strategy]:
    """Adds, after `strategies`, each partial-sum strategy with one summed axis scattered.

    A result summed over mesh axis ``a`` (an all-reduce) may instead be left split over ``a`` on
    a dimension it does not split yet: a reduce-scatter, half the all-reduce's traffic. This is
    how ZeRO-3 / FSDP reduces a gradient over the data axis into the shard of the param that
    device owns (and Megatron's sequence parallelism over the model axis). The remaining sums
    are all-reduced on the scattered, smaller result. Appended, so ties keep the old choice.
    """
    extra = []
    for s in strategies:
        summed = [c for c in s.comms if c[0] == "all-reduce"]
        (out,) = s.out_specs
        for _, a, nbytes in summed:
            rest = tuple((k, b, n / axes.sizes[a]) for k, b, n in s.comms if b != a)
            for d, size in enumerate(shape):
                if out[d] is not None or size % axes.sizes[a]:
                    continue
                scattered = out[:d] + (a,) + out[d + 1 :]
                extra.append(
                    Strategy(
                        (scattered,),
                        s.in_specs,
                        (("reduce-scatter", a, nbytes), *rest),
                        s.flops,
                        s.bytes_accessed,
                    )
                )
    return strategies + extra


def leader_strategies(
    eqn: Eqn, graph: Graph, axes: MeshAxes, reduce_scatter: bool = False
) -> list[Strategy] | None:
    """Strategies of a leader equation; None when the primitive has no rule (plan it replicated).

    With ``reduce_scatter``, contractions also offer their summed results reduce-scattered
    (`_with_reduce_scatter`: the FSDP / ZeRO-3 space).
    """
    p = eqn.prim
    scatter = _with_reduce_scatter if reduce_scatter else (lambda s, shape, axes: s)
    if p in SOURCES:
        return [replicated(eqn, graph)]
    if p == "dot_general":
        return scatter(_dot(eqn, graph, axes), graph.shapes[eqn.outvars[0]], axes)
    if p == "scan_carry":
        return [Strategy((s,), (s, s)) for s in candidate_specs(graph.shapes[eqn.outvars[0]], axes)]
    if p == "conv_general_dilated":
        conv = _conv(eqn, graph, axes)
        if conv is None:
            return None
        return scatter(conv, graph.shapes[eqn.outvars[0]], axes)
    if p == "gather":
        return _gather(eqn, graph, axes)
    if p == "scatter-add":
        return _scatter_add(eqn, graph, axes)
    return None


def has_rule(prim: str) -> bool:
    """Whether `prim` has a sharding rule (leader or follower)."""
    return prim in FOLLOWERS or prim in SOURCES or prim in LEADERS
