"""A `Plan` applied to a Flax NNX model in one call, and a plan as Flax logical-axis rules.

``shard(model, plan)`` places the model's `nnx.Param` state by the plan (split, `device_put`
with the plan's shardings, update) and returns the model; ``plan.jit(step)`` then runs the step
the plan was made for::

    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    p = tapas_jax.plan(step, params, batch, mesh=mesh)
    tapas_jax.shard(model, p)
    jstep = p.jit(step)
    out = jstep(nnx.state(model, nnx.Param), batch)

Codebases that annotate parameters with logical axis names (MaxText style: ``embed``, ``mlp``,
``heads``, ``vocab``) take a plan as rules instead: ``logical_axis_rules(plan, model)`` maps each
logical name to the mesh axis the plan gives it, for `nnx.logical_axis_rules` /
`flax.linen.logical_axis_rules`. That is possible only when the plan gives every dimension with
one name one layout; where it does not (say ``embed`` split over ``model`` in one kernel and
whole in another), the plan is finer than the annotations and the call raises ValueError naming
the conflicting params.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from flax import nnx

from .graph import path_string
from .planner import Plan

__all__ = ["shard", "logical_axis_rules", "logical_annotations"]

_NAME_KEYS = ("out_sharding", "sharding_names", "sharding")
"""Variable metadata that holds logical axis names, newest Flax spelling first."""


def shard(model: nnx.Module, plan: Plan, mesh=None) -> nnx.Module:
    """Places ``model``'s params by ``plan`` on ``mesh`` (the plan's own by default), in place.

    Every `nnx.Param` leaf moves to the `NamedSharding` of its path in the plan; other state
    (RNG counters, batch statistics) stays where it is. Returns the model.

    Raises:
      ValueError: the model's params and the plan's differ (a path missing on either side), or
        the mesh differs from the plan's.
    """
    shardings = plan.param_shardings(mesh)
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    paths = [path_string(p) for p, _ in leaves]
    missing = sorted(set(paths) - set(shardings))
    extra = sorted(set(shardings) - set(paths))
    if missing or extra:
        raise ValueError(
            "the model's params differ from the plan's: "
            f"not in the plan {missing[:3]}, not in the model {extra[:3]}"
        )
    placed = [jax.device_put(x, shardings[p]) for p, (_, x) in zip(paths, leaves)]
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, placed))
    return model


def logical_annotations(model: nnx.Module) -> dict[str, tuple[str | None, ...]]:
    """Params leaf path -> logical axis names per dimension, read from the variables' metadata
    (`nnx.with_partitioning`); params without names are left out."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        meta = var.get_metadata()
        names = next((meta[k] for k in _NAME_KEYS if meta.get(k) is not None), None)
        if names is not None:
            out["/".join(map(str, path))] = tuple(names)
    return out


def logical_axis_rules(
    plan: Plan, annotations: nnx.Module | Mapping[str, tuple[str | None, ...]]
) -> tuple[tuple[str, str | None], ...]:
    """The plan's param layout as ``(logical name, mesh axis or None)`` rules.

    ``annotations`` is an NNX model whose params carry logical axis names, or a mapping of
    params leaf path -> names. The rules reproduce the plan's spec of every annotated param
    (`flax.linen.logical_to_mesh_axes(names, rules)` gives it back).

    Raises:
      ValueError: the plan is not expressible as rules over these names: one name gets two
        layouts, a dimension split by the plan has no name, or a param has no names at all
        while the plan splits it.
    """
    names_of = (
        logical_annotations(annotations)
        if isinstance(annotations, nnx.Module)
        else dict(annotations)
    )
    seen: dict[str, tuple[str | None, str]] = {}
    problems: list[str] = []
    for path, spec in plan.param_paths.items():
        names = names_of.get(path)
        if names is None:
            if any(a is not None for a in spec):
                problems.append(f"{path} is split {tuple(spec)} but has no logical names")
            continue
        if len(names) != len(spec):
            raise ValueError(f"{path}: {len(names)} logical names for {len(spec)} dimensions")
        for name, axis in zip(names, spec):
            if name is None:
                if axis is not None:
                    problems.append(f"{path} splits an unnamed dimension over {axis!r}")
                continue
            first = seen.setdefault(name, (axis, path))
            if first[0] != axis:
                problems.append(
                    f"logical axis {name!r} is {_layout(first[0])} in {first[1]} "
                    f"but {_layout(axis)} in {path}"
                )
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(
            "the plan is not expressible as logical-axis rules: " + "; ".join(problems[:3]) + more
        )
    return tuple((name, axis) for name, (axis, _) in seen.items())


def _layout(axis: Any) -> str:
    return "whole" if axis is None else f"split over {axis!r}"
