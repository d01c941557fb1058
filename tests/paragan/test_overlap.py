"""The overlap of the ParaGAN step read from its compiled schedule (`paragan_jax.overlap`): the
real programs of both schemes compiled for this machine's CPU devices."""

import pytest

from paragan_jax import overlap as O
from paragan_jax.scaling import load_model_config, measure_step_costs, predict
from paragan_jax.scaling_check import CPU_CHECK_OVERRIDES
from tapas_jax.hlo_schedule import analyse_schedule


def test_cpu_compiled_step_of_each_scheme(tmp_path):
    """The real programs, compiled for 4 CPU devices: the CPU backend's collectives are all
    synchronous, so nothing is hidden; the sync step's D all-reduce has G's next work after it."""
    cfg = load_model_config("tiny", 4, CPU_CHECK_OVERRIDES)
    reports, info = O.read_schedule(cfg, "cpu:4", 4, dump_dir=tmp_path / "hlo")
    assert set(reports) == {"sync", "async-g", "async-d"}
    assert info["devices"] == 4 and info["per_device_batch"] == 4  # two per async group
    for name, rep in reports.items():
        kinds = {c.kind for c in rep.collectives}
        assert "all-reduce" in kinds, name  # the gradient all-reduce
        assert not any(c.is_async for c in rep.collectives), name
        assert all(c.scheduled_share == 0.0 for c in rep.collectives)
        assert all(0.0 <= c.independent_share < 1.0 for c in rep.collectives)
        assert rep.total_flops > 0
    costs = measure_step_costs(cfg)
    for scheme in ("sync", "async"):
        row = predict(costs, 64, scheme, "tpu-v3")
        assert O.scheme_overlap(reports, row, "tpu-v3") == 0.0
        possible = O.scheme_overlap(reports, row, "tpu-v3", scheduled=False)
        assert 0.0 <= possible <= 1.0
    # The written programs read back the same, with nothing compiled.
    again, info_again = O.read_schedule(cfg, f"hlo:{tmp_path / 'hlo'}", 4)
    assert {k: r.summary() for k, r in again.items()} == {
        k: r.summary() for k, r in reports.items()
    }
    assert info_again["compiled_target"] == "cpu:4" and info_again["devices"] == 4
    with pytest.raises(ValueError, match="schedule target"):
        O.read_schedule(cfg, "gpu", 4)
    with pytest.raises(FileNotFoundError, match="info.json"):
        O.read_schedule(cfg, f"hlo:{tmp_path}", 4)


_TPU_ASYNC_FUSION = """HloModule m, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_start (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %ar = f32[64,64]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add
}

%async_collective_fusion.1 (p: f32[64,64], q: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %p = f32[64,64]{1,0} parameter(0)
  %q = f32[64,64]{1,0} parameter(1)
  %ar = f32[64,64]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add
  %h = f32[64,64]{1,0} dot(%q, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%ar, %h)
}

%fused_done (p: f32[64,64]) -> f32[64,64] {
  %p = f32[64,64]{1,0} parameter(0)
  ROOT %ar = f32[64,64]{1,0} all-reduce(%p), replica_groups={}, to_apply=%add
}

ENTRY %main (p0: f32[64,64], p1: f32[64,64]) -> (f32[64,64], f32[64,64]) {
  %p0 = f32[64,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  %g = f32[64,64]{1,0} dot(%p0, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %async-collective-start = f32[64,64]{1,0} fusion(%g), kind=kCustom, calls=%fused_start
  %fusion.1 = (f32[64,64]{1,0}, f32[64,64]{1,0}) fusion(%async-collective-start, %p1), kind=kOutput, calls=%async_collective_fusion.1
  %gte = f32[64,64]{1,0} get-tuple-element(%fusion.1), index=0
  %h = f32[64,64]{1,0} get-tuple-element(%fusion.1), index=1
  %async-collective-done = f32[64,64]{1,0} fusion(%gte), kind=kCustom, calls=%fused_done
  %k = f32[64,64]{1,0} dot(%async-collective-done, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %out = (f32[64,64]{1,0}, f32[64,64]{1,0}) tuple(%k, %h)
}
"""  # noqa: E501


def test_tpu_async_collective_fusion_is_one_async_collective():
    """How libtpu writes an async all-reduce on v4 and later (async collective fusion, as in the
    BigGAN step compiled for v5p with ``--xla_tpu_enable_async_collective_fusion``): a start
    fusion, a compute fusion carrying the collective along, a done fusion, each with a piece of
    the all-reduce inside. Read as one async all-reduce hiding the compute fusion's dot."""
    rep = analyse_schedule(_TPU_ASYNC_FUSION)
    assert rep.total_flops == 3 * 2 * 64**3
    (c,) = rep.collectives  # the pieces inside the fusions are not counted again
    assert (c.kind, c.is_async, c.payload_bytes) == ("all-reduce", True, 64 * 64 * 4)
    assert c.scheduled_share == pytest.approx(1 / 3)
    sync = (
        _TPU_ASYNC_FUSION.replace("async-collective-start", "fusion.0")
        .replace("async-collective-done", "fusion.2")
        .replace("async_collective_fusion.1", "fused_middle")
    )
    assert [x.is_async for x in analyse_schedule(sync).collectives] == [False] * 3
