"""The overlap read from a compiled schedule (`paragan_jax.overlap`): the HLO reading on a
hand-written scheduled module, and the real step compiled for this machine's CPU devices."""

import jax
import pytest

from paragan_jax import overlap as O
from paragan_jax.scaling import load_model_config, measure_step_costs, predict
from paragan_jax.scaling_check import CPU_CHECK_OVERRIDES

_ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
"""


def _module(collective: str) -> str:
    """g = p0 p0 feeds the all-reduce; h = p1 p1 is independent; k reads the result."""
    if collective == "async":
        body = """  %ars = f32[64,64]{1,0} all-reduce-start(%g), replica_groups={}, to_apply=%add
  %h = f32[64,64]{1,0} dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ard = f32[64,64]{1,0} all-reduce-done(%ars)"""
    else:
        body = """  %ard = f32[64,64]{1,0} all-reduce(%g), replica_groups={}, to_apply=%add
  %h = f32[64,64]{1,0} dot(%p1, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}"""
    return f"""HloModule m, is_scheduled=true
{_ADD}
ENTRY %main (p0: f32[64,64], p1: f32[64,64]) -> (f32[64,64], f32[64,64]) {{
  %p0 = f32[64,64]{{1,0}} parameter(0)
  %p1 = f32[64,64]{{1,0}} parameter(1)
  %g = f32[64,64]{{1,0}} dot(%p0, %p0), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
{body}
  %k = f32[64,64]{{1,0}} dot(%ard, %p1), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}
  ROOT %t = (f32[64,64]{{1,0}}, f32[64,64]{{1,0}}) tuple(%k, %h)
}}
"""


def test_async_pair_hides_the_compute_scheduled_inside_it():
    rep = O.analyse_schedule(_module("async"))
    assert rep.total_flops == 3 * 2 * 64**3  # three 64x64x64 dots
    (c,) = rep.collectives
    assert (c.kind, c.is_async, c.payload_bytes) == ("all-reduce", True, 64 * 64 * 4)
    assert c.scheduled_share == pytest.approx(1 / 3)  # h runs between start and done
    assert c.independent_share == pytest.approx(1 / 3)  # g feeds it, k reads it
    # 1 s of collective behind 3 s of compute: h's 1 s hides all of it; 0.5 s of compute: half.
    assert O.hidden_fraction(rep, lambda _: 1.0, 3.0) == pytest.approx(1.0)
    assert O.hidden_fraction(rep, lambda _: 1.0, 1.5) == pytest.approx(0.5)


def test_sync_collective_hides_nothing_but_shows_what_could_be_hidden():
    rep = O.analyse_schedule(_module("sync"))
    (c,) = rep.collectives
    assert not c.is_async and c.scheduled_share == 0.0
    assert c.independent_share == pytest.approx(1 / 3)
    assert O.hidden_fraction(rep, lambda _: 1.0, 3.0) == 0.0
    assert O.hidden_fraction(rep, lambda _: 1.0, 3.0, scheduled=False) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ENTRY"):
        O.analyse_schedule("HloModule empty")


def test_cpu_compiled_step_of_each_scheme(capsys):
    """The real programs, compiled for 2 CPU devices: the CPU backend's collectives are all
    synchronous, so nothing is hidden; the sync step's D all-reduce has G's next work after it."""
    cfg = load_model_config("tiny", 4, CPU_CHECK_OVERRIDES)
    reports, info = O.read_schedule(cfg, "cpu", 4)
    assert set(reports) == {"sync", "async-g", "async-d"}
    assert info["devices"] == min(8, jax.device_count())
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
    with pytest.raises(ValueError, match="schedule target"):
        O.read_schedule(cfg, "gpu", 4)
