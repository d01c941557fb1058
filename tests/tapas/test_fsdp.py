"""FSDP / ZeRO-3 pricing: reduce-scattered gradients, params kept split over the data axis."""

import jax
import numpy as np
import pytest

import tapas_jax
from tapas_jax import zoo
from tapas_jax.collectives import bytes_moved
from tapas_jax.graph import build_graph
from tapas_jax.leader_rules import leader_strategies
from tapas_jax.spec_algebra import MeshAxes

DIMS = dict(layers=2, d_model=128, heads=4, seq_len=64, batch=8, vocab=256)
TIGHT = 5 * 2**20
"""Bytes per device: below the unconstrained plan's ~8 MiB, so the plan is memory-bound."""


@pytest.fixture(scope="module")
def gpt():
    return zoo.build("gpt", **DIMS)


def test_summed_dot_may_reduce_scatter_instead_of_all_reduce():
    def f(x, w):
        return x.T @ w  # contracts the batch: a weight gradient's shape

    x = jax.ShapeDtypeStruct((8, 16), np.float32)
    g = build_graph(f, x, x)
    (eqn,) = [e for e in g.eqns if e.prim == "dot_general"]
    axes = MeshAxes({"data": 2, "model": 4})
    plain = leader_strategies(eqn, g, axes)
    zero = leader_strategies(eqn, g, axes, reduce_scatter=True)
    assert zero[: len(plain)] == plain
    assert all(c[0] != "reduce-scatter" for s in plain for c in s.comms)
    summed = next(s for s in plain if s.comms == (("all-reduce", "data", 16 * 16 * 4.0),))
    scattered = [
        s for s in zero[len(plain) :] if s.in_specs == summed.in_specs and len(s.comms) == 1
    ]
    assert {s.out_specs[0] for s in scattered} == {("data", None), (None, "data")}
    for s in scattered:
        kind, axis, nbytes = s.comms[0]
        assert (kind, axis) == ("reduce-scatter", "data")
        # half the traffic of the all-reduce it replaces
        assert bytes_moved(kind, nbytes, 2) == bytes_moved("all-reduce", nbytes, 2) / 2


def test_plans_without_memory_pressure_are_unchanged(gpt, mesh_2x4):
    auto = tapas_jax.plan(gpt.fn, gpt.params, *gpt.inputs, mesh=mesh_2x4)
    plain = tapas_jax.plan(gpt.fn, gpt.params, *gpt.inputs, mesh=mesh_2x4, fsdp=False)
    assert auto.to_dict() | {"search_seconds": 0} == plain.to_dict() | {"search_seconds": 0}
    assert auto.predicted["comm_bytes_by_kind"]["reduce-scatter"] == 0


@pytest.fixture(scope="module")
def zero_plan(gpt, mesh_2x4):
    return tapas_jax.plan(gpt.fn, gpt.params, *gpt.inputs, mesh=mesh_2x4, memory_limit_bytes=TIGHT)


def test_memory_bound_plan_shards_params_over_data(gpt, mesh_2x4, zero_plan):
    plain = tapas_jax.plan(
        gpt.fn, gpt.params, *gpt.inputs, mesh=mesh_2x4, memory_limit_bytes=TIGHT, fsdp=False
    )
    p = zero_plan.predicted
    assert p["peak_memory_bytes"] <= TIGHT
    assert p["comm_bytes_by_kind"]["reduce-scatter"] > 0
    assert sum("data" in s for s in zero_plan.param_paths.values()) >= 3
    assert p["step_seconds"] < 0.9 * plain.predicted["step_seconds"]
    # the next step reads its params as this one wrote them (ZeRO-3: they stay split)
    n = len(zero_plan.param_paths)
    assert zero_plan.output_specs[:n] == list(zero_plan.param_paths.values())


def test_memory_bound_fsdp_plan_verifies(gpt, mesh_2x4, zero_plan):
    r = tapas_jax.verify(zero_plan, gpt.fn, gpt.init(0), *gpt.example_inputs(1))
    assert r.max_rel_error <= 1e-5
    assert r.compiled_comm_bytes == pytest.approx(r.predicted_comm_bytes, rel=0.10)
