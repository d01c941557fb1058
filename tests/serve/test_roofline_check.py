"""The roofline step times against the real CPU engine (`serve_jax.roofline_check`): the fit
of the efficiencies and the attention-loop cost, and (slow) measured prefill and decode steps
on held-out shapes."""

from __future__ import annotations

import pytest

from serve_jax.costmodel import RooflineCostModel
from serve_jax.model_config import get_model_config
from serve_jax.roofline_check import (
    DEFAULT_SHAPES,
    FIT_SHAPES,
    RooflineCheckConfig,
    StepShape,
    check_shapes,
    fit_efficiencies,
    predicted_seconds,
)
from tapas_jax.hardware import get_profile

SHAPES = (
    StepShape("prefill", tokens=64),
    StepShape("prefill", tokens=256),
    StepShape("decode", batch=1, context=127),
    StepShape("decode", batch=4, context=127),
    StepShape("decode", batch=1, context=511),
    StepShape("decode", batch=16, context=511),
    StepShape("prefill", tokens=128),
    StepShape("decode", batch=4, context=511),
)


def test_fit_recovers_the_figures_that_made_the_times():
    model, cpu = get_model_config("small", dtype="float32"), get_profile("cpu")
    truth = dict(
        flops_efficiency=0.7,
        hbm_efficiency=0.4,
        kv_efficiency=0.25,
        gemv_efficiency=0.8,
        attention_chunk_s=3e-5,
    )
    costs = RooflineCostModel(model, cpu, overlap=False, step_overhead_s=3e-4, **truth)
    samples = [(s, predicted_seconds(costs, s)) for s in SHAPES]
    fitted = fit_efficiencies(model, cpu, 3e-4, samples[:6])
    assert fitted == pytest.approx(truth, rel=1e-6)
    with pytest.raises(ValueError, match=">= 5 step times"):
        fit_efficiencies(model, cpu, 3e-4, samples[:4])
    with pytest.raises(ValueError, match="unknown step kind"):
        StepShape("verify", tokens=4)
    with pytest.raises(ValueError, match="positive"):
        StepShape("decode", batch=2)


def test_a_term_no_sample_exercises_keeps_its_default():
    """Without a one-token step the weights have one efficiency; an attention-loop cost the
    times do not support (here: none in them) is not fitted below zero."""
    model, cpu = get_model_config("small", dtype="float32"), get_profile("cpu")
    truth = dict(flops_efficiency=0.7, hbm_efficiency=0.5, kv_efficiency=0.25)
    costs = RooflineCostModel(model, cpu, overlap=False, step_overhead_s=3e-4, **truth)
    batched = [s for s in SHAPES if s.kind == "prefill" or s.batch > 1]
    fitted = fit_efficiencies(model, cpu, 3e-4, [(s, predicted_seconds(costs, s)) for s in batched])
    assert fitted["gemv_efficiency"] is None
    # The times hold no loop cost and the four columns are independent here (full rank): the
    # fit finds 0, not just a non-negative value (1 ns is 1/30000 of the cost the test above
    # recovers; a loop cost that small moves these steps by < 1e-5 of their time).
    assert fitted["attention_chunk_s"] == pytest.approx(0.0, abs=1e-9)
    refit = RooflineCostModel(model, cpu, overlap=False, step_overhead_s=3e-4, **fitted)
    for s in SHAPES:
        assert predicted_seconds(refit, s) == pytest.approx(predicted_seconds(costs, s), rel=1e-3)


def test_without_a_step_of_several_tokens_the_weight_efficiency_is_not_fitted():
    """Only one-token decodes: the batched weight reads are never timed, so ``hbm_efficiency``
    is left out (None, the cost model keeps its default), not reported as 1."""
    model, cpu = get_model_config("small", dtype="float32"), get_profile("cpu")
    truth = dict(flops_efficiency=0.7, hbm_efficiency=0.4, kv_efficiency=0.25, gemv_efficiency=0.8)
    costs = RooflineCostModel(model, cpu, overlap=False, step_overhead_s=3e-4, **truth)
    one = [StepShape("decode", batch=1, context=c) for c in (63, 127, 255, 511, 1023)]
    fitted = fit_efficiencies(model, cpu, 3e-4, [(s, predicted_seconds(costs, s)) for s in one])
    assert fitted["hbm_efficiency"] is None and fitted["gemv_efficiency"] is not None
    given = {k: v for k, v in fitted.items() if v is not None}
    assert RooflineCostModel(model, cpu, **given).hbm_efficiency == 0.8  # the default


def test_every_fitted_term_has_shapes_on_both_sides_of_the_split():
    """The held-out shapes include one-token decodes and long contexts at small batches (the
    regimes the two CPU terms price), and the fit sees each regime too."""
    assert set(FIT_SHAPES) < set(DEFAULT_SHAPES)
    held = [s for s in DEFAULT_SHAPES if s not in FIT_SHAPES]
    for group in (held, FIT_SHAPES):
        assert any(s.kind == "decode" and s.batch == 1 for s in group)
        assert any(s.kind == "decode" and s.batch <= 4 and s.context >= 511 for s in group)
    assert StepShape("decode", batch=4, context=511) in held


@pytest.mark.slow
def test_roofline_predicts_held_out_cpu_engine_steps_within_20_percent():
    """Figures fitted on six shapes predict a prefill and a decode step they never saw."""
    out = check_shapes(RooflineCheckConfig(repeats=5), SHAPES, fit_on=SHAPES[:6])
    held_out = [r for r in out["rows"] if not r["fitted_on"]]
    assert len(held_out) == 2
    for r in held_out:
        assert abs(r["fitted_error"]) < 0.2, r
