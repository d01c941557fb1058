"""The dataflow graph the planner works on: a flattened jaxpr with params mapped to pytree paths.

`build_graph(fn, *args)` traces ``fn`` with `jax.make_jaxpr` on abstract arguments and flattens
nested call-like jaxprs (``jit``/``pjit``, ``remat``/``checkpoint``, ``custom_jvp_call``,
``custom_vjp_call``, ``closed_call``) into one list of equations, renaming variables to integers.
A ``scan`` body is inlined once with `Eqn.weight` = ``length`` (its layers are one block repeated
``length`` times, already folded), between ``scan_slice`` / ``scan_carry`` / ``scan_stack``
boundary equations; other higher-order primitives (``cond``, ``while``) stay opaque and are
planned conservatively by the rules.

Invariants: variables are numbered densely; `Graph.inputs` follow the flattening order of the
arguments (`jax.tree_util.tree_flatten_with_path`); every input has a path string such as
``blocks/0/attn/query/kernel`` (NNX ``.value`` suffixes dropped) and the index of the positional
argument it came from. Closed-over constants become ``constant`` equations (replicated).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

__all__ = ["Eqn", "Graph", "build_graph", "path_string", "INLINED"]

# Call-like primitives whose body is inlined, with the param holding the body.
INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat": "jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
    "custom_lin": None,
}


@dataclasses.dataclass(slots=True)
class Eqn:
    """One equation of the flattened graph (slotted: the planner reads its fields per equation)."""

    prim: str
    params: dict[str, Any]
    invars: list[int | None]
    """Variable ids of the operands; None for a literal."""
    literals: list[Any]
    """The literal values (None where the operand is a variable)."""
    outvars: list[int]
    body: Graph | None = None
    """Unused by the flattener (scan bodies are inlined); kept for hand-built graphs."""
    weight: float = 1.0
    """How many times the equation runs per call (``length`` inside a scan body)."""
    src: tuple[int, ...] | None = None
    """Position in the traced program (equation indices through inlined calls); None inside a
    scan body or for boundary equations. `tapas_jax.plan` pins results by it."""
    operand_weights: list[float] | None = None
    """Per-operand multiplier of `weight` for reads (a scan carry's back edge runs length-1
    times); None means 1 for every operand."""


@dataclasses.dataclass
class Graph:
    """A flattened jaxpr: equations over integer variables with their shapes and dtypes."""

    eqns: list[Eqn]
    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    inputs: list[int]
    outputs: list[int | None]
    input_paths: list[str]
    input_args: list[int]
    """Positional argument index of each input."""
    const_values: dict[int, Any] = dataclasses.field(default_factory=dict)
    scans: list[int] = dataclasses.field(default_factory=list)
    """``length`` of every inlined scan."""
    in_treedef: Any = None
    out_treedef: Any = None
    heads: list[int] | None = None
    """`HeadIds` of the equations, interned by `build_graph` as it flattens (each equation's
    params are visited there anyway); None for a graph built by hand (`tapas_jax.fold`
    interns them when it needs them)."""

    @property
    def num_vars(self) -> int:
        return len(self.shapes)

    def nbytes(self, v: int) -> int:
        return int(np.prod(self.shapes[v], dtype=np.int64)) * np.dtype(self.dtypes[v]).itemsize

    def eqn_weights(self) -> np.ndarray:
        """`Eqn.weight` of every equation, cached."""
        cached = self.__dict__.get("_weights")
        if cached is None:
            cached = np.array([e.weight for e in self.eqns], dtype=np.float64)
            self.__dict__["_weights"] = cached
        return cached

    def aval_ids(self) -> tuple[np.ndarray, list[tuple[tuple[int, ...], np.dtype]]]:
        """Per variable, the index of its (shape, dtype) among the distinct ones, and those."""
        cached = self.__dict__.get("_avals")
        if cached is None:
            index: dict = {}
            ids = np.fromiter(
                (index.setdefault(a, len(index)) for a in zip(self.shapes, self.dtypes)),
                np.int64,
                self.num_vars,
            )
            cached = self.__dict__["_avals"] = (ids, list(index))
        return cached

    def var_nbytes(self) -> np.ndarray:
        """Bytes of every variable (unsharded), as floats, cached."""
        cached = self.__dict__.get("_nbytes")
        if cached is None:
            ids, avals = self.aval_ids()
            elems = np.array([math.prod(s) for s, _ in avals], dtype=np.float64)
            items = np.array([d.itemsize for _, d in avals], dtype=np.float64)
            cached = self.__dict__["_nbytes"] = (elems * items)[ids]
        return cached

    def operand_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every variable operand as parallel arrays: equation, variable, position, weight."""
        cached = self.__dict__.get("_operands")
        if cached is None:
            eq, var, pos = self.operand_slots()
            keep = var >= 0  # literals are -1
            weight = self.eqn_weights()[eq]
            for i in [i for i, e in enumerate(self.eqns) if e.operand_weights is not None]:
                weight[eq == i] *= np.asarray(self.eqns[i].operand_weights, dtype=np.float64)
            cached = (eq[keep], var[keep], pos[keep], weight[keep])
            self.__dict__["_operands"] = cached
        return cached

    def operand_slots(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every operand, literals included, as parallel arrays: equation, variable (-1 for a
        literal), position."""
        cached = self.__dict__.get("_slots")
        if cached is None:
            cached = self.__dict__["_slots"] = _flat([e.invars for e in self.eqns])
        return cached

    def result_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every result as parallel arrays: equation, variable, position among its results."""
        cached = self.__dict__.get("_results")
        if cached is None:
            cached = self.__dict__["_results"] = _flat([e.outvars for e in self.eqns])
        return cached

    def producer_array(self) -> np.ndarray:
        """`producers` as an array (-1 for inputs), cached."""
        cached = self.__dict__.get("_producers")
        if cached is None:
            eq, var, _ = self.result_arrays()
            cached = np.full(self.num_vars, -1, dtype=np.int64)
            cached[var] = eq
            self.__dict__["_producers"] = cached
        return cached

    def result_position_array(self) -> np.ndarray:
        """For each variable, its position among its producer's results (-1 for inputs)."""
        cached = self.__dict__.get("_positions")
        if cached is None:
            _, var, pos = self.result_arrays()
            cached = np.full(self.num_vars, -1, dtype=np.int64)
            cached[var] = pos
            self.__dict__["_positions"] = cached
        return cached

    def consumers(self) -> list[list[int]]:
        """For each variable, the indices of the equations that read it."""
        out: list[list[int]] = [[] for _ in range(self.num_vars)]
        for i, e in enumerate(self.eqns):
            for v in e.invars:
                if v is not None:
                    out[v].append(i)
        return out

    def producers(self) -> list[int]:
        """For each variable, the index of the equation that writes it (-1 for inputs)."""
        out = [-1] * self.num_vars
        for i, e in enumerate(self.eqns):
            for v in e.outvars:
                out[v] = i
        return out

    def count_eqns(self) -> int:
        """Equations (a scan body is inlined once)."""
        return len(self.eqns)

    def layer_runs(self) -> float:
        """Equation executions per call (scan bodies count ``length`` times)."""
        return float(sum(e.weight for e in self.eqns))


def _flat(rows: list[list[int | None]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row index, value (-1 for None) and position in its row of every entry of `rows`."""
    lengths = np.fromiter(map(len, rows), np.int64, len(rows))
    values = np.fromiter(itertools.chain.from_iterable(rows), np.float64, int(lengths.sum()))
    row = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    pos = np.arange(len(values), dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return row, np.where(np.isnan(values), -1, values).astype(np.int64), pos


def path_string(path: Sequence[Any]) -> str:
    """``(DictKey('blocks'), DictKey(0), GetAttrKey('value'))`` -> ``"blocks/0"``."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name == "value":
                continue
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


_JAXPRS = (jcore.ClosedJaxpr, jcore.Jaxpr)


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


class HeadIds:
    """Dense integer ids of equation *heads* (primitive, params, body, weight), in order of
    first appearance: equal ids, equal heads. Array-valued params (constants) are described by
    shape and dtype, not by value. The structural hash of `tapas_jax.fold` starts from them."""

    def __init__(self):
        self.index: dict[tuple, int] = {}
        self.ids: list[int] = []
        """The id of each equation added, in order."""

    def add(self, e: Eqn, body_hash: int = 0) -> None:
        # A primitive binds its params in a fixed order, so no sorting is needed.
        key = (e.prim, tuple(e.params.items()) if e.params else (), body_hash, e.weight)
        try:
            self.ids.append(self.index.setdefault(key, len(self.index)))
        except TypeError:  # an array-valued param (constants)
            described = tuple((k, _param_key(v)) for k, v in e.params.items())
            key = (e.prim, described, body_hash, e.weight)
            self.ids.append(self.index.setdefault(key, len(self.index)))


class _Builder:
    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[np.dtype] = []
        self.weight = 1.0
        self.scans: list[int] = []
        self.avals: dict = {}
        """(shape, dtype) of an aval -> (shape, dtype, id) normalised, shared by every variable
        of it; ids number the distinct normalised pairs (`Graph.aval_ids`)."""
        self.distinct: dict = {}
        self.aval_of: list[int] = []
        self.heads = HeadIds()

    def emit(self, eqns: list[Eqn], e: Eqn) -> Eqn:
        """Appends `e` with the current weight and interns its head (no body: scans inline)."""
        e.weight = self.weight
        eqns.append(e)
        self.heads.add(e)
        return e

    def as_var(self, vid, lit, aval, eqns) -> int:
        if vid is not None:
            return vid
        nv = self.new_var(aval)
        self.emit(eqns, Eqn("constant", {"value": lit}, [], [], [nv]))
        return nv

    def inline_scan(self, eqn, read, env: dict, eqns: list[Eqn]) -> None:
        """Inlines a scan body once, weighted by ``length``, with explicit boundary equations.

        ``scan_slice`` reads one layer of a stacked operand, ``scan_carry`` is the loop-carried
        value (fed by the initial value once and by the previous iteration length-1 times), and
        ``scan_stack`` stacks a per-iteration result.
        """
        prm = eqn.params
        length, nc, ncar = int(prm["length"]), int(prm["num_consts"]), int(prm["num_carry"])
        closed = prm["jaxpr"]
        inner = closed.jaxpr
        args = [read(x) for x in eqn.invars]
        sub_env: dict = {}
        for cv, c in zip(inner.constvars, closed.consts):
            vid = self.new_var(cv.aval)
            sub_env[cv] = vid
            self.emit(eqns, Eqn("constant", {"value": c}, [], [], [vid]))
        carries = []
        for j, (iv, (vid, lit), ov) in enumerate(zip(inner.invars, args, eqn.invars)):
            outer = self.as_var(vid, lit, ov.aval, eqns)
            if j < nc:
                sub_env[iv] = outer
            elif j < nc + ncar:
                b = self.new_var(iv.aval)
                sub_env[iv] = b
                carries.append(
                    self.emit(
                        eqns,
                        Eqn("scan_carry", {"length": length}, [outer, None], [None, None], [b]),
                    )
                )
            else:
                b = self.new_var(iv.aval)
                sub_env[iv] = b
                self.emit(eqns, Eqn("scan_slice", {"length": length}, [outer], [None], [b]))
        self.scans.append(length)
        outer_weight = self.weight
        self.weight = outer_weight * length
        self.flatten(inner, sub_env, eqns, None)
        self.weight = outer_weight
        body_outs = []
        for iv in inner.outvars:
            if isinstance(iv, jcore.Literal):
                body_outs.append(self.as_var(None, iv.val, iv.aval, eqns))
            else:
                body_outs.append(sub_env[iv])
        for e, b in zip(carries, body_outs[:ncar]):
            e.invars[1] = b
            e.operand_weights = [1.0, float(length - 1)]
        for ov, b in zip(eqn.outvars[:ncar], body_outs[:ncar]):
            env[ov] = b
        for ov, b in zip(eqn.outvars[ncar:], body_outs[ncar:]):
            y = self.new_var(ov.aval)
            env[ov] = y
            self.emit(eqns, Eqn("scan_stack", {"length": length}, [b], [None], [y]))

    def new_var(self, aval) -> int:
        key = (aval.shape, aval.dtype)
        norm = self.avals.get(key)
        if norm is None:
            pair = (tuple(int(d) for d in aval.shape), np.dtype(aval.dtype))
            norm = self.avals[key] = (*pair, self.distinct.setdefault(pair, len(self.distinct)))
        self.shapes.append(norm[0])
        self.dtypes.append(norm[1])
        self.aval_of.append(norm[2])
        return len(self.shapes) - 1

    def flatten(self, jaxpr, env: dict, eqns: list[Eqn], prefix: tuple | None = ()) -> None:
        """Appends the equations of `jaxpr` to `eqns`; `env` maps jaxpr vars to ids/literals.

        `prefix` is the position of `jaxpr` in the traced program (None inside a scan body):
        each equation records ``prefix + (its index,)`` as `Eqn.src`.
        """

        def read(x):
            if isinstance(x, jcore.Literal):
                return None, x.val
            return env[x], None

        for j, eqn in enumerate(jaxpr.eqns):
            path = None if prefix is None else (*prefix, j)
            name = eqn.primitive.name
            body_key = INLINED.get(name, "")
            if body_key:
                sub = eqn.params[body_key]
                closed = sub if isinstance(sub, jcore.ClosedJaxpr) else None
                inner = closed.jaxpr if closed is not None else sub
                sub_env = {}
                if closed is not None:
                    for cv, c in zip(inner.constvars, closed.consts):
                        vid = self.new_var(cv.aval)
                        sub_env[cv] = vid
                        self.emit(eqns, Eqn("constant", {"value": c}, [], [], [vid]))
                args = [read(x) for x in eqn.invars]
                for iv, (vid, lit) in zip(inner.invars, args):
                    if vid is None:
                        nv = self.new_var(iv.aval)
                        self.emit(eqns, Eqn("constant", {"value": lit}, [], [], [nv]))
                        vid = nv
                    sub_env[iv] = vid
                self.flatten(inner, sub_env, eqns, path)
                for ov, iv in zip(eqn.outvars, inner.outvars):
                    if isinstance(iv, jcore.Literal):
                        nv = self.new_var(ov.aval)
                        self.emit(eqns, Eqn("constant", {"value": iv.val}, [], [], [nv]))
                        env[ov] = nv
                    else:
                        env[ov] = sub_env[iv]
                continue
            if name == "scan":
                self.inline_scan(eqn, read, env, eqns)
                continue
            ins = [read(x) for x in eqn.invars]
            outs = [self.new_var(v.aval) for v in eqn.outvars]
            for ov, vid in zip(eqn.outvars, outs):
                env[ov] = vid
            body = None
            params = dict(eqn.params)
            for k, v in eqn.params.items():
                if isinstance(v, _JAXPRS) or (
                    isinstance(v, tuple) and v and isinstance(v[0], jcore.ClosedJaxpr)
                ):
                    params[k] = "<jaxpr>"
            e = Eqn(name, params, [i for i, _ in ins], [lit for _, lit in ins], outs, body)
            e.src = path
            self.emit(eqns, e)


def _abstract(x):
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype)
    return x


def build_graph(fn: Callable[..., Any], *args: Any) -> Graph:
    """Traces `fn(*args)` into a flattened `Graph`.

    Args:
      fn: any JAX-traceable function.
      *args: arrays or `jax.ShapeDtypeStruct` pytrees (shardings on them are ignored).

    Returns:
      The graph, with one input per array leaf of `args` and paths for every input.
    """
    abstract = jax.tree.map(_abstract, args)
    # One trace gives both the jaxpr and the output structure (eval_shape would trace again).
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*abstract)
    leaves_with_paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    inner = closed.jaxpr
    if len(leaves_with_paths) != len(inner.invars):
        raise ValueError(
            f"jaxpr has {len(inner.invars)} inputs but the arguments have "
            f"{len(leaves_with_paths)} array leaves; pass arrays or ShapeDtypeStructs only"
        )
    b = _Builder()
    env: dict = {}
    eqns: list[Eqn] = []
    inputs, paths, arg_idx = [], [], []
    for iv, (path, _) in zip(inner.invars, leaves_with_paths):
        vid = b.new_var(iv.aval)
        env[iv] = vid
        inputs.append(vid)
        arg_idx.append(int(path[0].idx) if path else 0)
        paths.append(path_string(path[1:]) or f"arg{arg_idx[-1]}")
    for cv, c in zip(inner.constvars, closed.consts):
        vid = b.new_var(cv.aval)
        env[cv] = vid
        b.emit(eqns, Eqn("constant", {"value": c}, [], [], [vid]))
    b.flatten(inner, env, eqns)
    outputs = [None if isinstance(o, jcore.Literal) else env[o] for o in inner.outvars]
    out_treedef = jax.tree_util.tree_structure(out_shape)
    graph = Graph(
        eqns,
        b.shapes,
        b.dtypes,
        inputs,
        outputs,
        paths,
        arg_idx,
        {},
        b.scans,
        treedef,
        out_treedef,
        b.heads.ids,
    )
    # The avals were interned as the variables were made: `aval_ids` needs no second pass.
    graph.__dict__["_avals"] = (np.array(b.aval_of, dtype=np.int64), list(b.distinct))
    return graph
