"""The dataflow graph the planner works on: a flattened jaxpr with params mapped to pytree paths.

`build_graph(fn, *args)` traces ``fn`` with `jax.make_jaxpr` on abstract arguments and flattens
nested call-like jaxprs (``jit``/``pjit``, ``remat``/``checkpoint``, ``custom_jvp_call``,
``custom_vjp_call``, ``closed_call``) into one list of equations, renaming variables to integers.
``scan`` stays one equation whose ``body`` is itself a flattened `Graph` (its layers are one block
repeated ``length`` times, with a leading layer axis on the stacked operands); other higher-order
primitives (``cond``, ``while``) stay opaque and are planned conservatively by the rules.

Invariants: variables are numbered densely; `Graph.inputs` follow the flattening order of the
arguments (`jax.tree_util.tree_flatten_with_path`); every input has a path string such as
``blocks/0/attn/query/kernel`` (NNX ``.value`` suffixes dropped) and the index of the positional
argument it came from. Closed-over constants become ``constant`` equations (replicated).
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class Eqn:
    """One equation of the flattened graph."""

    prim: str
    params: dict[str, Any]
    invars: list[int | None]
    """Variable ids of the operands; None for a literal."""
    literals: list[Any]
    """The literal values (None where the operand is a variable)."""
    outvars: list[int]
    body: Graph | None = None
    """For ``scan``: the flattened body."""


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
    in_treedef: Any = None
    out_treedef: Any = None

    @property
    def num_vars(self) -> int:
        return len(self.shapes)

    def nbytes(self, v: int) -> int:
        return int(np.prod(self.shapes[v], dtype=np.int64)) * np.dtype(self.dtypes[v]).itemsize

    def operand_arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every variable operand as parallel arrays (equation index, variable, operand index)."""
        cached = self.__dict__.get("_operands")
        if cached is None:
            eq, var, pos = [], [], []
            for i, e in enumerate(self.eqns):
                for k, v in enumerate(e.invars):
                    if v is not None:
                        eq.append(i)
                        var.append(v)
                        pos.append(k)
            cached = (
                np.array(eq, dtype=np.int64),
                np.array(var, dtype=np.int64),
                np.array(pos, dtype=np.int64),
            )
            self.__dict__["_operands"] = cached
        return cached

    def producer_array(self) -> np.ndarray:
        """`producers` as an array, cached."""
        cached = self.__dict__.get("_producers")
        if cached is None:
            cached = self.__dict__["_producers"] = np.array(self.producers(), dtype=np.int64)
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
        """Equations including those inside scan bodies (counted once)."""
        return sum(1 + (e.body.count_eqns() if e.body is not None else 0) for e in self.eqns)


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


class _Builder:
    def __init__(self):
        self.shapes: list[tuple[int, ...]] = []
        self.dtypes: list[np.dtype] = []

    def new_var(self, aval) -> int:
        self.shapes.append(tuple(int(d) for d in aval.shape))
        self.dtypes.append(np.dtype(aval.dtype))
        return len(self.shapes) - 1

    def flatten(self, jaxpr, env: dict, eqns: list[Eqn]) -> None:
        """Appends the equations of `jaxpr` to `eqns`; `env` maps jaxpr vars to ids/literals."""

        def read(x):
            if isinstance(x, jcore.Literal):
                return None, x.val
            return env[x], None

        for eqn in jaxpr.eqns:
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
                        eqns.append(Eqn("constant", {"value": c}, [], [], [vid]))
                args = [read(x) for x in eqn.invars]
                for iv, (vid, lit) in zip(inner.invars, args):
                    if vid is None:
                        nv = self.new_var(iv.aval)
                        eqns.append(Eqn("constant", {"value": lit}, [], [], [nv]))
                        vid = nv
                    sub_env[iv] = vid
                self.flatten(inner, sub_env, eqns)
                for ov, iv in zip(eqn.outvars, inner.outvars):
                    if isinstance(iv, jcore.Literal):
                        nv = self.new_var(ov.aval)
                        eqns.append(Eqn("constant", {"value": iv.val}, [], [], [nv]))
                        env[ov] = nv
                    else:
                        env[ov] = sub_env[iv]
                continue
            ins = [read(x) for x in eqn.invars]
            outs = [self.new_var(v.aval) for v in eqn.outvars]
            for ov, vid in zip(eqn.outvars, outs):
                env[ov] = vid
            body = None
            params = dict(eqn.params)
            if name == "scan":
                body = _sub_graph(params.pop("jaxpr"))
            else:
                for k, v in list(params.items()):
                    if isinstance(v, jcore.ClosedJaxpr | jcore.Jaxpr) or (
                        isinstance(v, tuple) and v and isinstance(v[0], jcore.ClosedJaxpr)
                    ):
                        params[k] = "<jaxpr>"
            eqns.append(Eqn(name, params, [i for i, _ in ins], [lit for _, lit in ins], outs, body))


def _sub_graph(closed) -> Graph:
    b = _Builder()
    inner = closed.jaxpr
    env: dict = {}
    eqns: list[Eqn] = []
    inputs = []
    for cv, c in zip(inner.constvars, closed.consts):
        vid = b.new_var(cv.aval)
        env[cv] = vid
        eqns.append(Eqn("constant", {"value": c}, [], [], [vid]))
    for iv in inner.invars:
        vid = b.new_var(iv.aval)
        env[iv] = vid
        inputs.append(vid)
    b.flatten(inner, env, eqns)
    outputs = [None if isinstance(o, jcore.Literal) else env[o] for o in inner.outvars]
    return Graph(
        eqns,
        b.shapes,
        b.dtypes,
        inputs,
        outputs,
        [f"in{i}" for i in range(len(inputs))],
        [0] * len(inputs),
    )


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
    closed = jax.make_jaxpr(fn)(*abstract)
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
        eqns.append(Eqn("constant", {"value": c}, [], [], [vid]))
    b.flatten(inner, env, eqns)
    outputs = [None if isinstance(o, jcore.Literal) else env[o] for o in inner.outvars]
    out_shape = jax.eval_shape(fn, *abstract)
    out_treedef = jax.tree_util.tree_structure(out_shape)
    return Graph(
        eqns, b.shapes, b.dtypes, inputs, outputs, paths, arg_idx, {}, treedef, out_treedef
    )
