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
the compiled HLO. A collective over an axis of size 1 costs nothing.
"""

from __future__ import annotations

from .hardware import HardwareProfile, get_profile

__all__ = ["KINDS", "collective_seconds", "bytes_moved"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")


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
    if kind == "all-reduce":
        return moved / w + 2 * (p - 1) * alpha
    if kind == "all-to-all":
        return max(moved / w, moved * (p / 4) / (2 * w)) + (p - 1) * alpha
    return moved / w + (p - 1) * alpha
