"""Verification of a plan: compile it on a mesh, count what the HLO communicates, check numerics.

`count_collectives(hlo_text)` reads the optimised HLO and, for every ``all-reduce``,
``all-gather``, ``reduce-scatter``, ``all-to-all`` and ``collective-permute`` (and their
``-start`` forms), takes its result shape (every element of a tuple result, which is how XLA
combines several all-reduces), its replica group size ``p``, and the bytes one device sends
under the ring model of `tapas_jax.collectives.bytes_moved`, the same model the planner
predicts with. Collectives inside a ``while`` body count once per known trip count.

`verify(plan, fn, params, *inputs)` runs ``plan.jit(fn)`` and the unsharded ``jax.jit(fn)`` on
the same values and compares every output leaf; the relative error is the largest absolute
difference over the largest output magnitude.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

import jax
import numpy as np

from .collectives import bytes_moved

__all__ = ["VerifyResult", "count_collectives", "verify"]

_DTYPE_BYTES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "s64": 8,
    "s32": 4,
    "s16": 2,
    "s8": 1,
    "u64": 8,
    "u32": 4,
    "u16": 2,
    "u8": 1,
    "pred": 1,
    "c64": 8,
    "c128": 16,
}
_OP = re.compile(
    r"=\s*(?P<shape>\(.*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<start>-start)?\("
)
_ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass
class VerifyResult:
    """What the compiled program communicates, against the plan's prediction."""

    predicted_comm_bytes: float
    compiled_comm_bytes: float
    collectives: dict[str, int]
    compiled_bytes_by_kind: dict[str, float]
    max_abs_error: float
    max_rel_error: float

    @property
    def comm_ratio(self) -> float:
        """Compiled over predicted bytes (1.0 when both are zero)."""
        if self.predicted_comm_bytes == 0:
            return 1.0 if self.compiled_comm_bytes == 0 else float("inf")
        return self.compiled_comm_bytes / self.predicted_comm_bytes

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["comm_ratio"] = self.comm_ratio
        return d


def _array_bytes(text: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(text):
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        out.append(n * _DTYPE_BYTES.get(dtype, 4))
    return out


def _group_size(line: str, num_devices: int) -> int:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if m:
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
        axes = re.findall(r"'([^']+)'", m.group(2))
        if axes and all(a in sizes for a in axes):
            return int(np.prod([sizes[a] for a in axes]))
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)
    if m:
        return int(m.group(2))
    m = re.search(r"replica_groups=\{\{([0-9,]*)\}", line)
    if m:
        return len([x for x in m.group(1).split(",") if x])
    m = re.search(r"source_target_pairs=\{([^}]*)\}", line)
    if m:
        return 2
    return num_devices


def _trip_counts(hlo: str) -> dict[str, int]:
    """Computation name -> how many times it runs (while bodies with a known trip count)."""
    counts: dict[str, int] = {}
    for m in re.finditer(
        r"while\(.*?body=%?([\w.\-]+).*?known_trip_count\"?:\{\"n\":\"(\d+)\"", hlo
    ):
        counts[m.group(1)] = int(m.group(2))
    return counts


def count_collectives(hlo: str, num_devices: int) -> tuple[dict[str, int], dict[str, float]]:
    """Counts collectives in optimised HLO text and the bytes each device sends, by kind."""
    counts: Counter = Counter()
    moved: Counter = Counter()
    trips = _trip_counts(hlo)
    current = ""
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", line)  # unindented
        if header:
            current = header.group(1)
        m = _OP.search(line)
        if not m:
            continue
        kind = m.group("op")
        sizes = _array_bytes(m.group("shape"))
        if m.group("start") and kind in ("all-gather", "collective-permute") and len(sizes) > 1:
            sizes = sizes[len(sizes) // 2 :]
        p = _group_size(line, num_devices)
        reps = trips.get(current, 1)
        counts[kind] += reps
        total = float(sum(sizes))
        if kind == "reduce-scatter":
            total *= p
        if kind == "collective-permute":
            moved[kind] += reps * total
        else:
            moved[kind] += reps * bytes_moved(kind, total, p)
    return dict(counts), {k: float(v) for k, v in moved.items()}


def verify(plan, fn, params, *inputs, mesh=None) -> VerifyResult:
    """Compiles ``plan.jit(fn)`` on the mesh and checks it against the unsharded function.

    Args:
      plan: a `tapas_jax.Plan` (with a concrete mesh, or pass `mesh`).
      fn: the planned function.
      params: real params (arrays).
      *inputs: real inputs.
      mesh: overrides the plan's mesh.

    Returns:
      A `VerifyResult`: predicted and compiled bytes per device, collective counts, and the
      largest absolute and relative output differences.
    """
    if plan.in_treedef is None:
        plan = plan.with_structure(fn, params, *inputs, mesh=mesh)
    sharded = plan.jit(fn, mesh)
    args = jax.device_put((params, *inputs), plan.in_shardings_on(mesh))
    compiled = sharded.lower(*args).compile()
    n = int(np.prod(list(plan.mesh_axes.values())))
    counts, by_kind = count_collectives(compiled.as_text(), n)
    got = compiled(*args)
    want = jax.jit(fn)(params, *inputs)
    max_abs = max_rel = 0.0
    scale = 0.0
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.size:
            max_abs = max(max_abs, float(np.max(np.abs(a - b))))
            scale = max(scale, float(np.max(np.abs(b))))
    max_rel = max_abs / scale if scale > 0 else max_abs
    return VerifyResult(
        predicted_comm_bytes=float(plan.predicted["comm_bytes"]),
        compiled_comm_bytes=float(sum(by_kind.values())),
        collectives=counts,
        compiled_bytes_by_kind=by_kind,
        max_abs_error=max_abs,
        max_rel_error=max_rel,
    )
