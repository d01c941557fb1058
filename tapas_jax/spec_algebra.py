"""Spec algebra of the sharding rules: specs, strategies, mesh axes, candidate specs, resharding.

A *spec* is a tuple with one entry per array dimension: the mesh axis that dimension is split over,
or None. Each mesh axis appears at most once, and only on a dimension it divides. A `Strategy` is
one way to run an equation: the specs of its results and operands and its own cost (collectives,
FLOPs, memory traffic). `reshard` prices the collectives that turn one spec into another.

The rules that produce strategies are in `tapas_jax.follower_rules` (ops that follow one operand),
`tapas_jax.leader_rules` (ops with their own choices) and `tapas_jax.batch_inference` (which
dimension of every variable carries the batch).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

from .graph import Eqn, Graph

Spec = tuple[str | None, ...]
Comm = tuple[str, str, float]  # (collective kind, mesh axis, bytes as collective_seconds wants)

__all__ = [
    "Spec",
    "Comm",
    "Strategy",
    "MeshAxes",
    "array_bytes",
    "candidate_specs",
    "reshard",
    "replicated",
]


class Strategy(NamedTuple):
    """One way to run an equation: specs of its results and operands, and its own cost.

    A named tuple rather than a frozen dataclass: the rules build thousands per plan, and a
    tuple is built several times faster.
    """

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
        """Devices one array laid out as `spec` is split over."""
        return math.prod(self.sizes[a] for a in spec if a is not None)


def array_bytes(shape: Sequence[int], itemsize: int) -> float:
    """Bytes of a whole (unsharded) array."""
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
    total = array_bytes(shape, itemsize)
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


def replicated(eqn: Eqn, graph: Graph) -> Strategy:
    """Everything replicated: the conservative strategy for unknown primitives and sources."""
    outs = tuple((None,) * len(graph.shapes[o]) for o in eqn.outvars)
    ins = tuple(None if v is None else (None,) * len(graph.shapes[v]) for v in eqn.invars)
    return Strategy(outs, ins)
