"""The roofline step times against the real CPU engine (`serve_jax.roofline_check`): the fit
of the efficiencies, and (slow) measured prefill and decode steps on held-out shapes."""

from __future__ import annotations

import pytest

from serve_jax.costmodel import RooflineCostModel
from serve_jax.model_config import get_model_config
from serve_jax.roofline_check import (
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
    StepShape("decode", batch=16, context=511),
    StepShape("prefill", tokens=128),
    StepShape("decode", batch=16, context=127),
)


def test_fit_recovers_the_efficiencies_that_made_the_times():
    model, cpu = get_model_config("small", dtype="float32"), get_profile("cpu")
    truth = dict(flops_efficiency=0.7, hbm_efficiency=0.5, kv_efficiency=0.25)
    costs = RooflineCostModel(model, cpu, overlap=False, step_overhead_s=3e-4, **truth)
    samples = [(s, predicted_seconds(costs, s)) for s in SHAPES]
    fitted = fit_efficiencies(model, cpu, 3e-4, samples[:4])
    assert fitted == pytest.approx(truth, rel=1e-6)
    with pytest.raises(ValueError, match=">= 3 step times"):
        fit_efficiencies(model, cpu, 3e-4, samples[:2])
    with pytest.raises(ValueError, match="unknown step kind"):
        StepShape("verify", tokens=4)
    with pytest.raises(ValueError, match="positive"):
        StepShape("decode", batch=2)


@pytest.mark.slow
def test_roofline_predicts_held_out_cpu_engine_steps_within_20_percent():
    """Efficiencies fitted on four shapes predict a prefill and a decode step it never saw."""
    out = check_shapes(RooflineCheckConfig(repeats=5), SHAPES, fit_on=SHAPES[:4])
    held_out = [r for r in out["rows"] if not r["fitted_on"]]
    assert len(held_out) == 2
    for r in held_out:
        assert abs(r["fitted_error"]) < 0.2, r
