"""Per-primitive sharding rules: which shardings an equation admits and what each one costs.

A *spec* is a tuple with one entry per array dimension: the mesh axis that dimension is split over,
or None. Each mesh axis appears at most once, and only on a dimension it divides.

Two kinds of rule, in the style of Alpa's intra-op pass:

- *Leader* rules (`leader_strategies`) enumerate an equation's own strategies: ``dot_general``
  (each mesh axis on a batch, free or contracting dimension; contracting means an all-reduce of
  the partial sums), ``conv_general_dilated`` (batch, output feature or input feature), ``gather``
  and ``scatter-add`` (embeddings: index batch, passthrough or indexed dimension), and sources
  (``iota``, constants) which are replicated, since slicing a replicated value is free.
- *Follower* rules (`follow`) derive an equation's sharding from the spec of one operand
  (`follow_operand`): elementwise ops, ``broadcast_in_dim``, ``reshape``, ``transpose``,
  reductions (a reduced sharded dimension costs an all-reduce), ``concatenate``, slices and pads.
  Followers are merged into the node they follow, so they add no decision variables.

A primitive without a rule is planned conservatively: its operands and results are replicated, and
`unknown_primitives` records its name so the planner can warn. That may cost communication but
never produces a wrong plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from .graph import Eqn, Graph

Spec = tuple[str | None, ...]
Comm = tuple[str, str, float]  # (collective kind, mesh axis, bytes as collective_seconds wants)

__all__ = [
    "Spec",
    "Strategy",
    "candidate_specs",
    "reshard",
    "follow_operand",
    "follow",
    "leader_strategies",
    "ELEMENTWISE",
]

ELEMENTWISE = {
    "add",
    "add_any",
    "sub",
    "mul",
    "div",
    "rem",
    "pow",
    "max",
    "min",
    "neg",
    "exp",
    "exp2",
    "log",
    "log1p",
    "expm1",
    "tanh",
    "logistic",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "atan2",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "sqrt",
    "rsqrt",
    "cbrt",
    "square",
    "integer_pow",
    "abs",
    "sign",
    "floor",
    "ceil",
    "round",
    "is_finite",
    "erf",
    "erfc",
    "erf_inv",
    "lgamma",
    "digamma",
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "and",
    "or",
    "not",
    "xor",
    "select_n",
    "clamp",
    "convert_element_type",
    "copy",
    "copy_p",
    "stop_gradient",
    "reduce_precision",
    "nextafter",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "population_count",
    "imag",
    "real",
    "conj",
    "optimization_barrier",
}
REDUCE_ALLREDUCE = {"reduce_sum", "reduce_max", "reduce_min"}
REDUCE_LOCAL = {"reduce_prod", "argmax", "argmin", "reduce_and", "reduce_or", "reduce_xor"}
CUMULATIVE = {"cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"}
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


@dataclasses.dataclass(frozen=True)
class Strategy:
    """One way to run an equation: specs of its results and operands, and its own cost."""

    out_specs: tuple[Spec, ...]
    in_specs: tuple[Spec | None, ...]
    """Required spec of each operand (None for literals)."""
    comms: tuple[Comm, ...] = ()
    flops: float = 0.0
    """FLOPs per device."""
    bytes_accessed: float = 0.0
    """Memory traffic per device (memory-bound ops)."""


class MeshAxes:
    """The mesh axes that matter (size > 1), in mesh order."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = {k: int(v) for k, v in sizes.items() if int(v) > 1}
        self.names = tuple(self.sizes)

    def shards(self, spec: Spec) -> int:
        return math.prod(self.sizes[a] for a in spec if a is not None)


def _nbytes(shape: Sequence[int], itemsize: int) -> float:
    return float(math.prod(shape)) * itemsize


def candidate_specs(shape: Sequence[int], axes: MeshAxes) -> list[Spec]:
    """Every spec of `shape`: each mesh axis on at most one dimension it divides, or unused."""
    rank = len(shape)
    options = []
    for a in axes.names:
        opts = [None] + [d for d in range(rank) if shape[d] % axes.sizes[a] == 0]
        options.append(opts)
    out = []
    for combo in itertools.product(*options):
        dims = [d for d in combo if d is not None]
        if len(dims) != len(set(dims)):
            continue
        spec: list[str | None] = [None] * rank
        for a, d in zip(axes.names, combo):
            if d is not None:
                spec[d] = a
        out.append(tuple(spec))
    return out


def reshard(
    src: Spec, dst: Spec, shape: Sequence[int], itemsize: int, axes: MeshAxes
) -> list[Comm]:
    """Collectives that turn an array laid out as `src` into `dst` (slicing is free)."""
    comms: list[Comm] = []
    cur = list(src)
    total = _nbytes(shape, itemsize)
    for a in axes.names:
        if a in cur and a in dst and cur.index(a) != dst.index(a):
            j = dst.index(a)
            if cur[j] is None:
                comms.append(("all-to-all", a, total / axes.shards(tuple(cur))))
                cur[cur.index(a)] = None
                cur[j] = a
    for a in axes.names:
        if a in cur and (a not in dst or dst.index(a) != cur.index(a)):
            cur[cur.index(a)] = None
            comms.append(("all-gather", a, total / axes.shards(tuple(cur))))
    return comms


# ----------------------------------------------------------------------------- followers


def follow_operand(eqn: Eqn, graph: Graph, constant: Sequence[bool] | None = None) -> int | None:
    """Index of the operand whose sharding `eqn` follows, or None when it is a leader.

    An elementwise op follows an operand of its own shape, preferring one that is not
    `constant` (computed from no input), since constants are replicated and cheap to slice.
    """
    p = eqn.prim
    if p in ELEMENTWISE:
        out_shape = graph.shapes[eqn.outvars[0]]
        start = 1 if p == "select_n" else 0
        for k in range(start, len(eqn.invars)):
            v = eqn.invars[k]
            if (
                v is not None
                and graph.shapes[v] == out_shape
                and (constant is None or not constant[v])
            ):
                return k
        for k in range(start, len(eqn.invars)):
            v = eqn.invars[k]
            if v is not None and graph.shapes[v] == out_shape:
                return k
        # size-1 broadcasting (e.g. a one-hot ``labels[..., None] == iota``): the biggest
        # non-constant operand of the same rank
        same_rank = [
            (math.prod(graph.shapes[v]), k)
            for k, v in enumerate(eqn.invars)
            if v is not None
            and len(graph.shapes[v]) == len(out_shape)
            and (constant is None or not constant[v])
        ]
        if same_rank:
            return max(same_rank)[1]
        return None
    if p in FOLLOWERS:
        if eqn.invars and eqn.invars[0] is not None:
            return 0
    return None


def _reshape_map(src_shape, dst_shape, spec: Spec, axes: MeshAxes) -> tuple[Spec, Spec]:
    """Maps a spec through a reshape; returns (operand spec kept, result spec).

    Dimensions are grouped into runs with equal products; an axis on the first non-trivial input
    dimension of a run moves to the first non-trivial output dimension if it divides it; any
    other axis is dropped (the operand is gathered first).
    """
    kept = list(spec)
    out: list[str | None] = [None] * len(dst_shape)
    i = j = 0
    n, m = len(src_shape), len(dst_shape)
    while i < n or j < m:
        gi, gj = [i], [j]
        pi = src_shape[i] if i < n else 1
        pj = dst_shape[j] if j < m else 1
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < n:
                pi *= src_shape[i]
                gi.append(i)
                i += 1
            elif j < m:
                pj *= dst_shape[j]
                gj.append(j)
                j += 1
            else:
                break
        gi = [d for d in gi if d < n]
        gj = [d for d in gj if d < m]
        first_in = next((d for d in gi if src_shape[d] > 1), None)
        first_out = next((d for d in gj if dst_shape[d] > 1), None)
        for d in gi:
            a = kept[d]
            if a is None:
                continue
            fits = first_out is not None and dst_shape[first_out] % axes.sizes[a] == 0
            if d == first_in and fits:
                out[first_out] = a
            else:
                kept[d] = None
    return tuple(kept), tuple(out)


def follow(eqn: Eqn, graph: Graph, k: int, spec: Spec, axes: MeshAxes) -> Strategy:
    """The strategy of follower `eqn` when its operand `k` is laid out as `spec`."""
    p = eqn.prim
    shapes = graph.shapes
    outs = eqn.outvars
    out_shape = shapes[outs[0]]
    item = graph.dtypes[outs[0]].itemsize
    op_shape = shapes[eqn.invars[k]]
    kept = list(spec)
    comms: list[Comm] = []

    def reqs(out_spec: Spec, followed: Spec) -> tuple[Spec | None, ...]:
        res: list[Spec | None] = []
        for kk, v in enumerate(eqn.invars):
            if v is None:
                res.append(None)
            elif kk == k:
                res.append(followed)
            else:
                s = shapes[v]
                if len(s) == len(out_shape):
                    res.append(
                        tuple(a if s[d] == out_shape[d] else None for d, a in enumerate(out_spec))
                    )
                else:
                    res.append((None,) * len(s))
        return tuple(res)

    def traffic(out_spec: Spec) -> float:
        sh = axes.shards(out_spec)
        return sum(_nbytes(shapes[o], graph.dtypes[o].itemsize) for o in outs) * 2 / sh

    if p in ELEMENTWISE:
        out_spec = (
            tuple(a if op_shape[d] == out_shape[d] else None for d, a in enumerate(kept))
            if len(op_shape) == len(out_shape)
            else ((None,) * len(out_shape))
        )
        kept = [a if a in out_spec else None for a in kept]
        return Strategy(
            (out_spec,) * len(outs), reqs(out_spec, tuple(kept)), (), 0.0, traffic(out_spec)
        )
    if p == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        out = [None] * len(out_shape)
        for j, d in enumerate(dims):
            if op_shape[j] == out_shape[d]:
                out[d] = kept[j]
            else:
                kept[j] = None
        return Strategy((tuple(out),), reqs(tuple(out), tuple(kept)), (), 0.0, 0.0)
    if p in ("reshape", "squeeze", "expand_dims"):
        kept_t, out = _reshape_map(op_shape, out_shape, tuple(kept), axes)
        return Strategy((out,), reqs(out, kept_t), (), 0.0, 0.0)
    if p == "transpose":
        perm = eqn.params["permutation"]
        out = tuple(kept[d] for d in perm)
        return Strategy((out,), reqs(out, tuple(kept)), (), 0.0, traffic(out))
    if p in REDUCE_ALLREDUCE or p in REDUCE_LOCAL or p in CUMULATIVE:
        red = eqn.params.get("axes")
        if red is None:
            red = (eqn.params["axis"],)
        red = tuple(red)
        if p in CUMULATIVE:
            for d in red:
                kept[d] = None
            out = tuple(kept)
            return Strategy((out,), reqs(out, tuple(kept)), (), 0.0, traffic(out))
        if p in REDUCE_LOCAL:
            for d in red:
                kept[d] = None
        out = tuple(a for d, a in enumerate(kept) if d not in red)
        out_bytes = _nbytes(out_shape, item) / axes.shards(out)
        for d in red:
            if kept[d] is not None:
                comms.append(("all-reduce", kept[d], out_bytes))
        return Strategy(
            (out,),
            reqs(out, tuple(kept)),
            tuple(comms),
            0.0,
            _nbytes(op_shape, item) / axes.shards(tuple(kept)),
        )
    if p in ("slice", "dynamic_slice", "pad", "rev", "sort", "reduce_precision"):
        if p == "rev":
            changed = set(eqn.params["dimensions"])
        elif p == "sort":
            changed = {eqn.params["dimension"]}
        else:
            changed = {d for d in range(len(op_shape)) if op_shape[d] != out_shape[d]}
        for d in changed:
            kept[d] = None
        out = tuple(kept)
        return Strategy((out,) * len(outs), reqs(out, tuple(kept)), (), 0.0, traffic(out))
    if p == "dynamic_update_slice":
        upd = shapes[eqn.invars[1]]
        for d in range(len(op_shape)):
            if upd[d] != op_shape[d]:
                kept[d] = None
        out = tuple(kept)
        return Strategy((out,), reqs(out, tuple(kept)), (), 0.0, traffic(out))
    if p == "scan_slice":  # one layer of a stacked operand; the layer axis stays whole
        kept[0] = None
        out = tuple(kept[1:])
        return Strategy((out,), reqs(out, tuple(kept)), (), 0.0, 0.0)
    if p == "scan_stack":
        out = (None, *kept)
        return Strategy((out,), reqs(out, tuple(kept)), (), 0.0, 0.0)
    if p in ("concatenate", "split"):
        d = eqn.params.get("dimension", eqn.params.get("axis"))
        kept[d] = None
        out = tuple(kept)
        return Strategy((out,) * len(outs), reqs(out, out), (), 0.0, traffic(out))
    raise KeyError(p)


# ----------------------------------------------------------------------------- leaders


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


def replicated(eqn: Eqn, graph: Graph) -> Strategy:
    """Everything replicated: the conservative strategy for unknown primitives and sources."""
    outs = tuple((None,) * len(graph.shapes[o]) for o in eqn.outvars)
    ins = tuple(None if v is None else (None,) * len(graph.shapes[v]) for v in eqn.invars)
    return Strategy(outs, ins)


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
        out_bytes = _nbytes(os_, item) / axes.shards(ospec_t)
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
        out_bytes = _nbytes(os_, item) / axes.shards(o)
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
        out_bytes = _nbytes(outsh, item) / axes.shards(o)
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
        out_bytes = _nbytes(osh, item) / axes.shards(o)
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


def leader_strategies(eqn: Eqn, graph: Graph, axes: MeshAxes) -> list[Strategy] | None:
    """Strategies of a leader equation; None when the primitive has no rule (plan it replicated)."""
    p = eqn.prim
    if p in SOURCES:
        return [replicated(eqn, graph)]
    if p == "dot_general":
        return _dot(eqn, graph, axes)
    if p == "scan_carry":
        return [Strategy((s,), (s, s)) for s in candidate_specs(graph.shapes[eqn.outvars[0]], axes)]
    if p == "conv_general_dilated":
        return _conv(eqn, graph, axes)
    if p == "gather":
        return _gather(eqn, graph, axes)
    if p == "scatter-add":
        return _scatter_add(eqn, graph, axes)
    return None


def free_strategies(eqn: Eqn, graph: Graph, k: int, axes: MeshAxes) -> list[Strategy]:
    """A follower made a leader (its operand is not planned yet): one strategy per operand spec."""
    v = eqn.invars[k]
    seen = {}
    for spec in candidate_specs(graph.shapes[v], axes):
        s = follow(eqn, graph, k, spec, axes)
        key = (s.out_specs, s.in_specs)
        if key not in seen and s.in_specs[k] == spec:
            seen[key] = s
    return list(seen.values()) or [replicated(eqn, graph)]


def spec_bytes(shape: Sequence[int], itemsize: int, spec: Spec, axes: MeshAxes) -> float:
    """Bytes of one device's shard."""
    return _nbytes(shape, itemsize) / axes.shards(spec)


FOLLOWERS = (
    {
        "broadcast_in_dim",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "slice",
        "dynamic_slice",
        "dynamic_update_slice",
        "pad",
        "rev",
        "concatenate",
        "split",
        "sort",
        "scan_slice",
        "scan_stack",
    }
    | ELEMENTWISE
    | REDUCE_ALLREDUCE
    | REDUCE_LOCAL
    | CUMULATIVE
)


def constant_vars(graph: Graph) -> list[bool]:
    """Variables computed from no input (iota, constants and what is derived only from them)."""
    eq, var, _, _ = graph.operand_arrays()
    res_eq, res_var, _ = graph.result_arrays()
    n = len(graph.eqns)
    # An operand produced later (a scan carry's back edge) is not constant when it is read.
    backward = graph.producer_array()[var] >= eq
    const = np.zeros(graph.num_vars, dtype=bool)
    while True:  # one round per step of the longest chain of constant equations
        pending = np.bincount(eq[~const[var] | backward], minlength=n)
        new = np.zeros_like(const)
        new[res_var[pending[res_eq] == 0]] = True
        if np.array_equal(new, const):
            return const.tolist()
        const = new


def has_rule(prim: str) -> bool:
    """Whether `prim` has a sharding rule (leader or follower)."""
    return (
        prim in FOLLOWERS
        or prim in SOURCES
        or prim in ("dot_general", "conv_general_dilated", "gather", "scatter-add", "scan_carry")
    )


def batch_dims(
    graph: Graph, inputs_batched: Sequence[bool], size: int, folding=None
) -> list[int | None]:
    """Which dimension of every variable carries the batch (None: no batch dimension).

    Dimension 0 of each batched input is the batch if `size` divides it; the label flows through
    followers, dot products (a batch dimension that is contracted disappears, as in a weight
    gradient), convolutions, gathers and scatters. With a `folding`, copies after the
    representative take their labels from it instead of being propagated again.
    """
    skip_to: dict[int, tuple[int, list[int], list[int]]] = {}
    if folding is not None and folding.blocks:
        for b in folding.blocks:
            lo, hi = b.start + 2 * b.period, b.start + b.copies * b.period
            if hi > lo:
                res_eq, res_var, _ = graph.result_arrays()
                outs = res_var[np.searchsorted(res_eq, lo) : np.searchsorted(res_eq, hi)]
                skip_to[lo] = (hi, outs.tolist(), folding.rep_var[outs].tolist())
    bd: list[int | None] = [None] * graph.num_vars
    for v, batched in zip(graph.inputs, inputs_batched):
        if batched and graph.shapes[v] and graph.shapes[v][0] % size == 0:
            bd[v] = 0
    one = MeshAxes({"_b": size})
    hashes = None if folding is None else folding.hashes
    cache: dict[tuple, list[int | None]] = {}
    i, n = 0, len(graph.eqns)
    while i < n:
        if i in skip_to:  # copies after the representative take its labels
            hi, outs, reps = skip_to[i]
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
