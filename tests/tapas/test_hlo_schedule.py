"""Reading a compiled program's schedule (`tapas_jax.hlo_schedule`) on hand-written scheduled
modules: an async all-reduce pair with compute inside it, and a synchronous one."""

import pytest

from tapas_jax import hlo_schedule as H

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
    rep = H.analyse_schedule(_module("async"))
    assert rep.total_flops == 3 * 2 * 64**3  # three 64x64x64 dots
    (c,) = rep.collectives
    assert (c.kind, c.is_async, c.payload_bytes) == ("all-reduce", True, 64 * 64 * 4)
    assert c.scheduled_share == pytest.approx(1 / 3)  # h runs between start and done
    assert c.independent_share == pytest.approx(1 / 3)  # g feeds it, k reads it
    # 1 s of collective behind 3 s of compute: h's 1 s hides all of it; 0.5 s of compute: half.
    assert H.hidden_fraction(rep, lambda _: 1.0, 3.0) == pytest.approx(1.0)
    assert H.hidden_fraction(rep, lambda _: 1.0, 1.5) == pytest.approx(0.5)


def test_sync_collective_hides_nothing_but_shows_what_could_be_hidden():
    rep = H.analyse_schedule(_module("sync"))
    (c,) = rep.collectives
    assert not c.is_async and c.scheduled_share == 0.0
    assert c.independent_share == pytest.approx(1 / 3)
    assert H.hidden_fraction(rep, lambda _: 1.0, 3.0) == 0.0
    assert H.hidden_fraction(rep, lambda _: 1.0, 3.0, scheduled=False) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ENTRY"):
        H.analyse_schedule("HloModule empty")
