"""Mesh helpers: shapes, Auto axes, -1, sub-mesh disjointness, abstract meshes, clear errors."""

import jax
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from tapas_jax import mesh as mesh_lib
from tapas_jax.mesh import MeshSpecError


def test_make_mesh_shape_and_auto_axes(mesh_2x4):
    assert dict(mesh_2x4.shape) == {"data": 2, "model": 4}
    assert mesh_2x4.axis_types == (AxisType.Auto, AxisType.Auto)
    assert len(set(mesh_2x4.devices.flat)) == 8


def test_minus_one_takes_the_rest():
    assert mesh_lib.parse_mesh_spec("data=-1,model=2", 8) == {"data": 4, "model": 2}
    assert mesh_lib.parse_mesh_spec({"model": 4, "data": -1}, 8) == {"model": 4, "data": 2}
    m = mesh_lib.make_mesh("data=-1")
    assert dict(m.shape) == {"data": 8}


def test_auto_mesh_allows_contracting_over_sharded_axis(mesh_2x4):
    # The reason the stack builds Auto meshes: this matmul raises on an Explicit mesh.
    x = jax.device_put(jax.numpy.ones((8, 16)), NamedSharding(mesh_2x4, P("data", "model")))
    w = jax.device_put(jax.numpy.ones((16, 4)), NamedSharding(mesh_2x4, P("model", None)))
    y = jax.jit(lambda a, b: a @ b)(x, w)
    assert float(y[0, 0]) == 16.0


@pytest.mark.parametrize(
    "spec, match",
    [
        ("data=3,model=4", "covers 12 devices, but there are 8"),
        ("data=3,model=-1", "multiple of 3"),
        ("data=-1,model=-1", "at most one axis"),
        ("data=2,data=4", "twice"),
        ("data", "name=size"),
        ("data=two", "not an integer"),
        ("data=0,model=8", "sizes are >= 1"),
        ("", "empty"),
    ],
)
def test_bad_specs_raise_clear_errors(spec, match):
    with pytest.raises(MeshSpecError, match=match):
        mesh_lib.make_mesh(spec)


def test_split_mesh_disjoint_and_covering(mesh_2x4):
    parts = mesh_lib.split_mesh(mesh_2x4, 2, axis="data")
    assert [dict(p.shape) for p in parts] == [{"data": 1, "model": 4}] * 2
    sets = [set(p.devices.flat) for p in parts]
    assert not sets[0] & sets[1]
    assert sets[0] | sets[1] == set(mesh_2x4.devices.flat)
    uneven = mesh_lib.split_mesh(mesh_lib.make_mesh("data=8"), [3, 5])
    assert [p.devices.size for p in uneven] == [3, 5]
    assert all(p.axis_types == (AxisType.Auto,) for p in uneven)


def test_split_mesh_errors(mesh_2x4):
    with pytest.raises(MeshSpecError, match="no axis 'pipe'"):
        mesh_lib.split_mesh(mesh_2x4, 2, axis="pipe")
    with pytest.raises(MeshSpecError, match="3 equal parts"):
        mesh_lib.split_mesh(mesh_2x4, 3, axis="model")
    with pytest.raises(MeshSpecError, match="add up to 4"):
        mesh_lib.split_mesh(mesh_2x4, [1, 2], axis="model")


def test_submesh_runs_a_computation(mesh8):
    g, d = mesh_lib.split_mesh(mesh8, 2)
    x = jax.device_put(jax.numpy.arange(8.0), NamedSharding(g, P("data")))
    y = jax.jit(lambda a: a * 2)(x)
    assert set(y.sharding.device_set) == set(g.devices.flat)
    assert not set(y.sharding.device_set) & set(d.devices.flat)


def test_abstract_mesh_1024(abstract_mesh_1024):
    assert abstract_mesh_1024.size == 1024
    assert dict(abstract_mesh_1024.shape) == {"data": 32, "model": 32}
    assert mesh_lib.axis_size(abstract_mesh_1024, "model") == 32
    assert mesh_lib.axis_size(abstract_mesh_1024, None) == 1
    with pytest.raises(MeshSpecError):
        mesh_lib.abstract_mesh("data=3,model=-1", 1024)


def test_make_mesh_from_device_subset():
    devs = jax.devices()[4:]
    m = mesh_lib.make_mesh("data=2,model=2", devices=devs)
    assert set(m.devices.flat) == set(devs)
