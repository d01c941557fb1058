"""Alpha-beta cost of collectives over one mesh axis: the communication model of the whole stack.

With ``p`` devices on the axis, per-device bandwidth ``W`` (`HardwareProfile.axis_bandwidth`) and
per-hop latency ``alpha``, ring algorithms cost (scaling-book conventions):

- all-gather of an array whose *gathered* size is ``V`` bytes: ``(p-1)/p * V / W + (p-1) alpha``
- reduce-scatter of an array whose *input* size is ``V``: the same as all-gather
- all-reduce of ``V`` bytes (reduce-scatter + all-gather): ``2 (p-1)/p * V / W + 2(p-1) alpha``
- all-to-all of a ``V``-byte per-device buffer: each device sends ``(p-1)/p * V``; on a
  bidirectional ring the mean distance is ``p/4`` hops, so ``(p-1)/p * V * max(1, p/4) / (2 W)``
  bounded below by the one-hop cost ``(p-1)/p * V / W``, plus ``(p-1) alpha``.

`bytes_moved` gives the matching per-device traffic, which is what the verifier compares against
the compiled HLO, and `latency_hops` the alpha count. A collective over an axis of size 1 costs
nothing.

Beyond one axis: `torus_allreduce_seconds` prices an all-reduce over a whole 2-D torus slice
(`torus_shape`) as reduce-scatter, all-reduce of the shard, all-gather; `compiled_collective_terms`
re-prices the collectives counted in a compiled program (`tapas_jax.verification.count_collectives`)
at another device count; `op_seconds` prices one compiled collective on a torus slice;
`fit_alpha_beta` recovers ``alpha`` and ``W`` from timed all-reduces.
"""

from __future__ import annotations

import math

import numpy as np

from .hardware import HardwareProfile, get_profile

__all__ = [
    "KINDS",
    "bytes_moved",
    "collective_seconds",
    "compiled_collective_terms",
    "fit_alpha_beta",
    "latency_hops",
    "op_seconds",
    "torus_allreduce_seconds",
    "torus_shape",
]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")

POINT_TO_POINT = "collective-permute"
"""The HLO collective that sends to one neighbour (one hop, its payload as the bytes sent)."""


def latency_hops(kind: str, p: int) -> int:
    """Latency terms (alphas) of one collective over `p` devices: ring algorithms, and one hop
    for a collective-permute (it sends to its neighbour)."""
    if p <= 1:
        return 0
    if kind == "all-reduce":
        return 2 * (p - 1)
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return p - 1
    if kind == POINT_TO_POINT:
        return 1
    raise ValueError(
        f"unknown collective kind {kind!r}; known: {', '.join(KINDS)}, {POINT_TO_POINT}"
    )


def bytes_moved(kind: str, nbytes: float, p: int) -> float:
    """Bytes one device sends for a collective of `kind` over `p` devices (ring algorithms)."""
    if p <= 1 or nbytes <= 0:
        return 0.0
    frac = (p - 1) / p
    if kind == "all-reduce":
        return 2 * frac * nbytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return frac * nbytes
    raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(KINDS)}")


def collective_seconds(
    kind: str,
    nbytes: float,
    p: int,
    hardware: str | HardwareProfile,
    bandwidth: float | None = None,
) -> float:
    """Time of one collective under the alpha-beta model.

    Args:
      kind: one of `KINDS`.
      nbytes: the array size as described in the module docstring.
      p: devices on the mesh axis.
      hardware: profile (or its name) giving bandwidth and latency.
      bandwidth: overrides the profile's per-axis bandwidth (e.g. DCN between slices).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    hw = get_profile(hardware)
    w = hw.axis_bandwidth if bandwidth is None else bandwidth
    alpha = hw.collective_latency
    moved = bytes_moved(kind, nbytes, p)
    hops = latency_hops(kind, p)
    if kind == "all-to-all":
        return max(moved / w, moved * (p / 4) / (2 * w)) + hops * alpha
    return moved / w + hops * alpha


def torus_shape(chips: int) -> tuple[int, int]:
    """The most square ``a x b`` (a <= b) factorisation of a slice of `chips` chips."""
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    a = int(math.isqrt(chips))
    while chips % a:
        a -= 1
    return a, chips // a


def torus_allreduce_seconds(nbytes: float, chips: int, hardware: str | HardwareProfile) -> float:
    """All-reduce of `nbytes` over a 2-D torus of `chips` (`torus_shape` ``a x b``): reduce-scatter
    over ``b``, all-reduce of the ``1/b`` shard over ``a``, all-gather over ``b``.

    Cheaper than one ring over all the chips (`collective_seconds` with ``p = chips``, which is
    how the sharding search prices a collective over one mesh axis): the latency term grows with
    ``a + b`` instead of ``a b``.
    """
    a, b = torus_shape(chips)
    return (
        collective_seconds("reduce-scatter", nbytes, b, hardware)
        + collective_seconds("all-reduce", nbytes / b, a, hardware)
        + collective_seconds("all-gather", nbytes, b, hardware)
    )


def op_seconds(kind: str, nbytes: float, chips: int, hardware: str | HardwareProfile) -> float:
    """Time of one compiled collective of `kind` over a 2-D torus slice of `chips`.

    An all-reduce takes the torus algorithm (`torus_allreduce_seconds`); a collective-permute
    sends its `nbytes` payload one hop over one link; the others take a ring over all the chips
    (`collective_seconds`, an upper bound on a torus). `nbytes` is the larger side of the
    collective (`paragan_jax.overlap.CollectiveOp.payload_bytes`).
    """
    if chips <= 1 or nbytes <= 0:
        return 0.0
    hw = get_profile(hardware)
    if kind == "all-reduce":
        return torus_allreduce_seconds(nbytes, chips, hw)
    if kind == POINT_TO_POINT:
        return nbytes / hw.ici_link_bandwidth + hw.collective_latency
    return collective_seconds(kind, nbytes, chips, hw)


def compiled_collective_terms(
    counts: dict[str, int], moved: dict[str, float], p_compiled: int, p: int
) -> tuple[int, float]:
    """Latency hops and bytes each device sends for a compiled program's collectives at `p`.

    `counts` and `moved` are `tapas_jax.verification.count_collectives` of the program compiled
    at `p_compiled` devices. Under data parallelism each collective keeps its payload as the
    device count changes, so the payloads are recovered from the bytes moved at `p_compiled` and
    priced again at `p` with `bytes_moved` (a collective-permute sends its payload itself).
    """
    hops, sent = 0, 0.0
    if p <= 1:
        return 0, 0.0
    for kind, count in counts.items():
        if count <= 0:
            continue
        hops += count * latency_hops(kind, p)
        if kind == POINT_TO_POINT:
            sent += moved.get(kind, 0.0)
        else:
            per_byte = bytes_moved(kind, 1.0, max(p_compiled, 2))
            sent += bytes_moved(kind, moved.get(kind, 0.0) / per_byte, p)
    return hops, sent


def fit_alpha_beta(sizes_to_seconds: dict[int, float], p: int) -> tuple[float, float]:
    """Per-hop latency ``alpha`` and bandwidth ``W`` of a ring all-reduce over `p` devices.

    Fits ``t = 2(p-1) alpha + 2(p-1)/p V / W`` by least squares over the measured sizes ``V``
    (bytes) -> seconds.
    """
    if p < 2 or len(sizes_to_seconds) < 2:
        raise ValueError("need p >= 2 and at least two message sizes")
    v = np.array([float(s) for s in sizes_to_seconds])
    t = np.array(list(sizes_to_seconds.values()))
    a = np.stack([np.full_like(v, 2 * (p - 1)), 2 * (p - 1) / p * v], axis=1)
    (alpha, inv_w), *_ = np.linalg.lstsq(a, t, rcond=None)
    alpha, inv_w = max(float(alpha), 1e-7), max(float(inv_w), 1e-12)
    return alpha, 1.0 / inv_w
