"""Pinning a plan's intermediate layouts: a function re-evaluated with sharding constraints.

`Plan.jit` (`tapas_jax.planner`) wraps the function with `constrained`, which traces it on plain
shapes, as the planner did, and evaluates the program equation by equation, applying
`jax.lax.with_sharding_constraint` to the results (and re-laid-out operands) the plan chose, so
the partitioner follows the plan rather than re-deriving its own. Sub-programs the planner traced
through (`tapas_jax.graph.INLINED`: pjit, custom derivatives, remat) are evaluated inline with
the same positions.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from .graph import INLINED

__all__ = ["SpecList", "constrained"]

SpecList = list[str | None]


def constrained(fn: Callable[..., Any], constraints: Mapping[str, SpecList], mesh) -> Callable:
    """`fn` re-evaluated equation by equation with the planned layouts pinned.

    ``constraints`` maps an equation position (``"3/0/12"``, through inlined sub-programs) to the
    spec of its result, or ``"<position>@<k>"`` to the spec operand ``k`` is read in. When `fn`
    no longer traces to a program those positions fit, it runs unconstrained, with a warning.
    """
    pinned: dict[tuple[int, ...], PartitionSpec] = {}
    operands: dict[tuple[int, ...], dict[int, PartitionSpec]] = {}
    for k, v in constraints.items():
        where, _, operand = k.partition("@")
        path = tuple(int(x) for x in where.split("/"))
        if operand:
            operands.setdefault(path, {})[int(operand)] = PartitionSpec(*v)
        else:
            pinned[path] = PartitionSpec(*v)

    def evaluate(jaxpr, consts, args, prefix):
        env = {}

        def read(x):
            return x.val if isinstance(x, jcore.Literal) else env[x]

        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        for j, eqn in enumerate(jaxpr.eqns):
            path = (*prefix, j)
            invals = [read(x) for x in eqn.invars]
            key = INLINED.get(eqn.primitive.name, "")
            if key:
                sub = eqn.params[key]
                if isinstance(sub, jcore.ClosedJaxpr):
                    outs = evaluate(sub.jaxpr, sub.consts, invals, path)
                else:
                    outs = evaluate(sub, (), invals, path)
            else:
                for k, spec in operands.get(path, {}).items():
                    invals[k] = jax.lax.with_sharding_constraint(
                        invals[k], NamedSharding(mesh, spec)
                    )
                params = eqn.primitive.get_bind_params(eqn.params)
                subfuns = []
                if isinstance(params, tuple):  # older jax: (subfuns, params)
                    subfuns, params = params
                with eqn.ctx.manager:
                    outs = eqn.primitive.bind(*subfuns, *invals, **params)
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                if path in pinned and len(outs) == 1:
                    outs = [
                        jax.lax.with_sharding_constraint(outs[0], NamedSharding(mesh, pinned[path]))
                    ]
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(x) for x in jaxpr.outvars]

    def matches(jaxpr, prefix, found):
        for j, eqn in enumerate(jaxpr.eqns):
            path = (*prefix, j)
            key = INLINED.get(eqn.primitive.name, "")
            if key:
                sub = eqn.params[key]
                matches(sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub, path, found)
            else:
                if path in pinned:
                    out = eqn.outvars
                    found[path] = len(out) == 1 and len(out[0].aval.shape) == len(pinned[path])
                for k, spec in operands.get(path, {}).items():
                    x = eqn.invars[k] if k < len(eqn.invars) else None
                    found[(path, k)] = (
                        x is not None
                        and not isinstance(x, jcore.Literal)
                        and len(x.aval.shape) == len(spec)
                    )
        return found

    def wrapped(*args):
        # Trace on plain shapes, as the planner did: sharded tracers add reshard equations.
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        closed = jax.make_jaxpr(fn)(*abstract)
        found = matches(closed.jaxpr, (), {})
        expected = len(pinned) + sum(len(o) for o in operands.values())
        if len(found) != expected or not all(found.values()):
            warnings.warn(
                "tapas_jax: the function traces differently from the planned one; running it "
                "without the plan's intermediate sharding constraints",
                stacklevel=2,
            )
            return fn(*args)
        flat = evaluate(closed.jaxpr, closed.consts, jax.tree.leaves(args), ())
        return jax.tree.unflatten(jax.tree.structure(jax.eval_shape(fn, *abstract)), flat)

    return wrapped
