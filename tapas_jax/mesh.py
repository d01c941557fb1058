"""Device meshes for the whole stack: the one place meshes are built.

Every mesh made here has `AxisType.Auto` axes unless the caller asks otherwise. Since JAX 0.9
`jax.make_mesh` defaults to `AxisType.Explicit`, which rejects ordinary GSPMD-style code (a matmul
contracting over a sharded axis raises "ambiguous"); the packages of this stack rely on
propagation, so they never call `jax.make_mesh` directly.

A mesh spec is a string such as ``"data=2,model=4"`` or a mapping ``{"data": 2, "model": 4}``.
One axis may be ``-1``, meaning "all remaining devices". Three kinds of mesh come out:

- `make_mesh(spec)`: a real mesh over the local (or given) devices;
- `split_mesh(mesh, sizes)`: disjoint sub-meshes along one axis (asynchronous ParaGAN runs the
  generator and the discriminator on two of these);
- `abstract_mesh(spec, num_devices)`: an `AbstractMesh` of any size (1024 chips) for planning
  without devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh

MeshSpec = str | Mapping[str, int]

__all__ = [
    "MeshSpec",
    "MeshSpecError",
    "abstract_mesh",
    "axis_size",
    "make_mesh",
    "mesh_spec_string",
    "parse_mesh_spec",
    "split_mesh",
]


class MeshSpecError(ValueError):
    """A mesh spec that cannot describe the requested devices."""


def _parse_pairs(spec: MeshSpec) -> list[tuple[str, int]]:
    if isinstance(spec, Mapping):
        pairs = [(str(k), v) for k, v in spec.items()]
    elif isinstance(spec, str):
        text = spec.strip()
        if not text:
            raise MeshSpecError("empty mesh spec; expected something like 'data=2,model=4'")
        pairs = []
        for part in text.split(","):
            name, sep, size = part.partition("=")
            name = name.strip()
            if not sep or not name:
                raise MeshSpecError(
                    f"mesh spec {spec!r}: {part.strip()!r} is not of the form name=size"
                )
            try:
                pairs.append((name, int(size)))
            except ValueError:
                raise MeshSpecError(
                    f"mesh spec {spec!r}: size of axis {name!r} is {size.strip()!r}, not an integer"
                ) from None
    else:
        raise MeshSpecError(f"mesh spec must be a string or a mapping, got {type(spec).__name__}")
    names = [n for n, _ in pairs]
    if len(set(names)) != len(names):
        raise MeshSpecError(f"mesh spec {spec!r} names an axis twice")
    for name, size in pairs:
        if not isinstance(size, int | np.integer) or (size < 1 and size != -1):
            raise MeshSpecError(
                f"mesh spec {spec!r}: axis {name!r} has size {size}; sizes are >= 1, or -1 "
                "for 'the rest'"
            )
    if sum(1 for _, s in pairs if s == -1) > 1:
        raise MeshSpecError(f"mesh spec {spec!r}: at most one axis may be -1")
    return pairs


def parse_mesh_spec(spec: MeshSpec, num_devices: int) -> dict[str, int]:
    """Resolves a mesh spec against a device count.

    Args:
      spec: ``"data=2,model=4"``, ``"data=-1,model=2"`` or a mapping of axis name to size.
      num_devices: how many devices the mesh must cover exactly.

    Returns:
      An ordered dict of axis name to size whose product is `num_devices`.

    Raises:
      MeshSpecError: the spec is malformed or its sizes do not multiply to `num_devices`.
    """
    pairs = _parse_pairs(spec)
    known = math.prod(s for _, s in pairs if s != -1)
    if any(s == -1 for _, s in pairs):
        if num_devices % known:
            raise MeshSpecError(
                f"mesh spec {mesh_spec_string(dict(pairs))}: the fixed axes need a multiple of "
                f"{known} devices, but there are {num_devices}"
            )
        pairs = [(n, num_devices // known if s == -1 else s) for n, s in pairs]
    elif known != num_devices:
        raise MeshSpecError(
            f"mesh spec {mesh_spec_string(dict(pairs))} covers {known} devices, but there are "
            f"{num_devices}; use -1 on one axis to take the rest"
        )
    return dict(pairs)


def mesh_spec_string(axes: Mapping[str, int]) -> str:
    """The inverse of `parse_mesh_spec`: ``{"data": 2, "model": 4} -> "data=2,model=4"``."""
    return ",".join(f"{k}={v}" for k, v in axes.items())


def make_mesh(
    spec: MeshSpec,
    devices: Sequence[jax.Device] | None = None,
    axis_types: tuple[AxisType, ...] | None = None,
) -> Mesh:
    """Builds a device mesh with `AxisType.Auto` axes.

    Args:
      spec: mesh spec, e.g. ``"data=2,model=4"``; one axis may be -1.
      devices: devices to use, in order; defaults to all of `jax.devices()`.
      axis_types: override the axis types (defaults to Auto on every axis).

    Returns:
      A `jax.sharding.Mesh` over exactly those devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    axes = parse_mesh_spec(spec, len(devices))
    types = axis_types if axis_types is not None else (AxisType.Auto,) * len(axes)
    if len(types) != len(axes):
        raise MeshSpecError(f"{len(types)} axis types given for {len(axes)} mesh axes")
    if devices == list(jax.devices())[: len(devices)] and len(devices) == jax.device_count():
        # Let JAX pick a topology-aware device order (matters on TPU slices).
        return jax.make_mesh(tuple(axes.values()), tuple(axes.keys()), axis_types=types)
    grid = np.array(devices, dtype=object).reshape(tuple(axes.values()))
    return Mesh(grid, tuple(axes.keys()), axis_types=types)


def split_mesh(mesh: Mesh, sizes: int | Sequence[int], axis: str | None = None) -> list[Mesh]:
    """Splits a mesh into disjoint sub-meshes along one axis.

    Args:
      mesh: the mesh to split.
      sizes: either the number of equal parts, or the size of each part along `axis`
        (they must add up to the axis size).
      axis: the axis to cut; defaults to the first axis.

    Returns:
      Sub-meshes with the same axis names and types; their device sets are disjoint and together
      cover the mesh.
    """
    axis = mesh.axis_names[0] if axis is None else axis
    if axis not in mesh.axis_names:
        raise MeshSpecError(f"mesh has no axis {axis!r}; its axes are {mesh.axis_names}")
    dim = mesh.axis_names.index(axis)
    length = mesh.devices.shape[dim]
    if isinstance(sizes, int):
        if sizes < 1 or length % sizes:
            raise MeshSpecError(
                f"cannot split axis {axis!r} of size {length} into {sizes} equal parts"
            )
        sizes = [length // sizes] * sizes
    sizes = list(sizes)
    if any(s < 1 for s in sizes) or sum(sizes) != length:
        raise MeshSpecError(
            f"part sizes {sizes} along axis {axis!r} must be >= 1 and add up to {length}"
        )
    bounds = np.cumsum([0, *sizes])
    return [
        Mesh(
            np.take(mesh.devices, np.arange(lo, hi), axis=dim),
            mesh.axis_names,
            axis_types=mesh.axis_types,
        )
        for lo, hi in zip(bounds[:-1], bounds[1:])
    ]


def abstract_mesh(
    spec: MeshSpec, num_devices: int, axis_types: tuple[AxisType, ...] | None = None
) -> AbstractMesh:
    """An `AbstractMesh` of any size, for planning without devices (e.g. 1024 chips)."""
    axes = parse_mesh_spec(spec, num_devices)
    types = axis_types if axis_types is not None else (AxisType.Auto,) * len(axes)
    return AbstractMesh(tuple(axes.values()), tuple(axes.keys()), axis_types=types)


def axis_size(mesh: Mesh | AbstractMesh, axis: str | None) -> int:
    """Size of a mesh axis; 1 for None or an axis the mesh lacks."""
    if axis is None or axis not in mesh.axis_names:
        return 1
    return int(dict(mesh.shape)[axis])
