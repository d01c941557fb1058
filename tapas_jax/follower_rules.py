"""Follower rules: ops whose sharding follows the spec of one operand.

`follow_operand` picks the operand an equation follows (or None: it is a leader, see
`tapas_jax.leader_rules`); `follow` derives the equation's strategy from that operand's spec:
elementwise ops, ``broadcast_in_dim``, ``reshape``, ``transpose``, reductions (a reduced sharded
dimension costs an all-reduce), cumulative ops, ``concatenate``, slices and pads, and the
``scan_slice`` / ``scan_stack`` of a scanned layer stack. Followers are merged into the node they
follow, so they add no decision variables; `free_strategies` plans one whose operand is not
planned yet. `constant_vars` marks the variables computed from no input, which an elementwise op
prefers not to follow (constants are replicated and cheap to slice).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from .graph import Eqn, Graph
from .spec_algebra import (
    MeshAxes,
    Spec,
    Strategy,
    array_bytes,
    candidate_specs,
    replicated,
)

__all__ = [
    "ELEMENTWISE",
    "REDUCE_ALLREDUCE",
    "REDUCE_LOCAL",
    "CUMULATIVE",
    "FOLLOWERS",
    "follow_operand",
    "follow",
    "follower",
    "free_strategies",
    "constant_vars",
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
    return follower(eqn, graph, k, axes)(spec)


def follower(eqn: Eqn, graph: Graph, k: int, axes: MeshAxes) -> Callable[[Spec], Strategy]:
    """`follow` prepared for one equation: spec of operand `k` -> the equation's strategy.

    Everything that depends only on shapes and parameters is worked out once, so applying the
    rule to each spec of an operand's table costs little more than building the strategy.
    """
    p = eqn.prim
    shapes = graph.shapes
    outs = eqn.outvars
    n_out = len(outs)
    out_shape = shapes[outs[0]]
    item = graph.dtypes[outs[0]].itemsize
    op_shape = shapes[eqn.invars[k]]
    sizes = axes.sizes
    # How each operand's required spec is made from the result's: (0, ()) a literal, (1, ())
    # the followed operand, (2, mask) the result's spec on the dimensions the operand matches
    # (same rank), (3, spec) a fixed replicated spec (another rank).
    how: list[tuple[int, tuple]] = []
    for kk, v in enumerate(eqn.invars):
        if v is None:
            how.append((0, ()))
        elif kk == k:
            how.append((1, ()))
        elif len(shapes[v]) == len(out_shape):
            how.append((2, tuple(x == y for x, y in zip(shapes[v], out_shape))))
        else:
            how.append((3, (None,) * len(shapes[v])))
    only_followed = len(how) == 1 and how[0][0] == 1

    def reqs(out_spec: Spec, followed: Spec) -> tuple[Spec | None, ...]:
        if only_followed:
            return (followed,)
        res: list[Spec | None] = []
        for kind, x in how:
            if kind == 0:
                res.append(None)
            elif kind == 1:
                res.append(followed)
            elif kind == 2:
                res.append(tuple(a if m else None for a, m in zip(out_spec, x)))
            else:
                res.append(x)
        return tuple(res)

    def shards(spec: Spec) -> int:
        return math.prod([sizes[a] for a in spec if a is not None])

    out_bytes2 = sum(array_bytes(shapes[o], graph.dtypes[o].itemsize) for o in outs) * 2

    def traffic(out_spec: Spec) -> float:
        return out_bytes2 / shards(out_spec)

    if p in ELEMENTWISE:
        if len(op_shape) == len(out_shape):
            same = tuple(op_shape[d] == out_shape[d] for d in range(len(op_shape)))

            def rule(spec: Spec) -> Strategy:
                out = tuple(a if m else None for a, m in zip(spec, same))
                kept = tuple(a if a in out else None for a in spec)
                return Strategy((out,) * n_out, reqs(out, kept), (), 0.0, traffic(out))

            return rule
        repl = (None,) * len(out_shape)
        unread = (None,) * len(op_shape)

        def rule(spec: Spec) -> Strategy:
            return Strategy((repl,) * n_out, reqs(repl, unread), (), 0.0, traffic(repl))

        return rule
    if p == "broadcast_in_dim":
        dims = eqn.params["broadcast_dimensions"]
        moves = [(j, d, op_shape[j] == out_shape[d]) for j, d in enumerate(dims)]

        def rule(spec: Spec) -> Strategy:
            kept = list(spec)
            out: list[str | None] = [None] * len(out_shape)
            for j, d, same in moves:
                if same:
                    out[d] = kept[j]
                else:
                    kept[j] = None
            out_t = tuple(out)
            return Strategy((out_t,), reqs(out_t, tuple(kept)), (), 0.0, 0.0)

        return rule
    if p in ("reshape", "squeeze", "expand_dims"):

        def rule(spec: Spec) -> Strategy:
            kept_t, out = _reshape_map(op_shape, out_shape, spec, axes)
            return Strategy((out,), reqs(out, kept_t), (), 0.0, 0.0)

        return rule
    if p == "transpose":
        perm = eqn.params["permutation"]

        def rule(spec: Spec) -> Strategy:
            out = tuple(spec[d] for d in perm)
            return Strategy((out,), reqs(out, spec), (), 0.0, traffic(out))

        return rule
    if p in REDUCE_ALLREDUCE or p in REDUCE_LOCAL or p in CUMULATIVE:
        red = eqn.params.get("axes")
        if red is None:
            red = (eqn.params["axis"],)
        red = tuple(red)
        if p in CUMULATIVE:

            def rule(spec: Spec) -> Strategy:
                out = tuple(None if d in red else a for d, a in enumerate(spec))
                return Strategy((out,), reqs(out, out), (), 0.0, traffic(out))

            return rule
        local = p in REDUCE_LOCAL
        out_bytes = array_bytes(out_shape, item)
        op_bytes = array_bytes(op_shape, item)

        def rule(spec: Spec) -> Strategy:
            kept = tuple(None if local and d in red else a for d, a in enumerate(spec))
            out = tuple(a for d, a in enumerate(kept) if d not in red)
            per_device = out_bytes / shards(out)
            comms = tuple(("all-reduce", kept[d], per_device) for d in red if kept[d] is not None)
            return Strategy((out,), reqs(out, kept), comms, 0.0, op_bytes / shards(kept))

        return rule
    if p in ("slice", "dynamic_slice", "pad", "rev", "sort", "reduce_precision"):
        if p == "rev":
            changed = set(eqn.params["dimensions"])
        elif p == "sort":
            changed = {eqn.params["dimension"]}
        else:
            changed = {d for d in range(len(op_shape)) if op_shape[d] != out_shape[d]}

        def rule(spec: Spec) -> Strategy:
            out = tuple(None if d in changed else a for d, a in enumerate(spec))
            return Strategy((out,) * n_out, reqs(out, out), (), 0.0, traffic(out))

        return rule
    if p == "dynamic_update_slice":
        upd = shapes[eqn.invars[1]]
        changed = {d for d in range(len(op_shape)) if upd[d] != op_shape[d]}

        def rule(spec: Spec) -> Strategy:
            out = tuple(None if d in changed else a for d, a in enumerate(spec))
            return Strategy((out,), reqs(out, out), (), 0.0, traffic(out))

        return rule
    if p == "scan_slice":  # one layer of a stacked operand; the layer axis stays whole

        def rule(spec: Spec) -> Strategy:
            kept = (None, *spec[1:])
            return Strategy((kept[1:],), reqs(kept[1:], kept), (), 0.0, 0.0)

        return rule
    if p == "scan_stack":

        def rule(spec: Spec) -> Strategy:
            out = (None, *spec)
            return Strategy((out,), reqs(out, spec), (), 0.0, 0.0)

        return rule
    if p in ("concatenate", "split"):
        dim = eqn.params.get("dimension", eqn.params.get("axis"))

        def rule(spec: Spec) -> Strategy:
            out = tuple(None if d == dim else a for d, a in enumerate(spec))
            return Strategy((out,) * n_out, reqs(out, out), (), 0.0, traffic(out))

        return rule
    raise KeyError(p)


def free_strategies(eqn: Eqn, graph: Graph, k: int, axes: MeshAxes) -> list[Strategy]:
    """A follower made a leader (its operand is not planned yet): one strategy per operand spec."""
    v = eqn.invars[k]
    seen = {}
    rule = follower(eqn, graph, k, axes)
    for spec in candidate_specs(graph.shapes[v], axes):
        s = rule(spec)
        key = (s.out_specs, s.in_specs)
        if key not in seen and s.in_specs[k] == spec:
            seen[key] = s
    return list(seen.values()) or [replicated(eqn, graph)]


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
