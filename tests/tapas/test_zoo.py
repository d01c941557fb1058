"""Every zoo model plans (default run) and verifies on the simulated mesh (slow run)."""

import time

import jax
import pytest

from tapas_jax import cli, zoo
from tapas_jax.config import PlanConfig, load_config, preset_path
from tapas_jax.planner import plan
from tapas_jax.verification import verify

ZOO = ["gpt_scan", "t5", "vit", "moe", "dcgan"]
TINY = {"layers": 2, "d_model": 32, "heads": 4, "seq_len": 8, "batch": 4, "vocab": 64}


def _check_divisible(p, model, mesh):
    sizes = dict(mesh.shape)
    shapes = [leaf.shape for leaf in jax.tree.leaves(model.params)]
    assert len(shapes) == len(p.param_paths)
    for shape, spec in zip(shapes, p.param_paths.values()):
        assert len(spec) == len(shape)
        for dim, axis in zip(shape, spec):
            assert axis is None or dim % sizes[axis] == 0


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_plans(name, mesh_2x4):
    model = zoo.build(name, **TINY)
    p = plan(model.fn, model.params, *model.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    _check_divisible(p, model, mesh_2x4)
    assert p.fold["layers"] >= 2
    assert p.fold["eqns_after"] <= p.fold["eqns_before"]
    assert 0 < p.predicted["step_seconds"] < 1.0


def test_scan_gpt_on_abstract_1024_chip_mesh(abstract_mesh_1024):
    model = zoo.build("gpt_scan", layers=4, d_model=256, heads=8, seq_len=64, batch=64, vocab=512)
    p = plan(model.fn, model.params, *model.inputs, mesh=abstract_mesh_1024, hardware="tpu-v5p")
    assert p.fold["layers"] == 4
    assert p.input_paths[0]["arg1"][0] == "data"
    with pytest.raises(ValueError, match="no concrete mesh"):
        p.in_shardings  # noqa: B018


@pytest.mark.slow
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_verifies(name, mesh_2x4):
    model = zoo.build(name, **TINY)
    p = plan(model.fn, model.params, *model.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    r = verify(p, model.fn, model.init(0), *model.example_inputs(0))
    assert r.max_rel_error <= 1e-5
    if name in ("t5", "vit", "gpt_scan"):
        assert r.compiled_comm_bytes == pytest.approx(r.predicted_comm_bytes, rel=0.10)


@pytest.mark.slow
def test_gpt3_shaped_96_layers_on_1024_chips_under_a_minute():
    cfg = load_config(PlanConfig, preset_path("tapas", "gpt3_scan_1024_tpu"))
    t0 = time.perf_counter()
    model = cli.build_model(cfg)
    p = plan(model.fn, model.params, *model.inputs, mesh=cli.mesh_for(cfg), hardware=cfg.hardware)
    assert time.perf_counter() - t0 < 60
    assert p.fold["layers"] == 96
    assert p.predicted["peak_memory_bytes"] <= 95 * 2**30


TP_DIMS = {
    "vit": {"layers": 2, "d_model": 128, "heads": 4, "batch": 8, "image": 32, "patch": 4},
    "t5": {"layers": 2, "d_model": 128, "heads": 4, "seq_len": 64, "batch": 8, "vocab": 256},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(TP_DIMS))
def test_tensor_parallel_vit_and_t5_verify(name, mesh_2x4):
    model = zoo.build(name, **TP_DIMS[name])
    p = plan(model.fn, model.params, *model.inputs, mesh=mesh_2x4, hardware="tpu-v5e")
    assert any("model" in spec for spec in p.param_paths.values())
    r = verify(p, model.fn, model.init(0), *model.example_inputs(0))
    assert r.max_rel_error <= 1e-5
    assert r.compiled_comm_bytes == pytest.approx(r.predicted_comm_bytes, rel=0.10)
