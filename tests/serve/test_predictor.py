"""Remaining-length predictor: cold start, online learning, conditioning, calibration, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest

from serve_jax.predictor import PredictionLog, RemainingLengthPredictor


def test_cold_start_is_the_prior():
    p = RemainingLengthPredictor(prior_median=300.0, prior_sigma=0.5)
    pred = p.predict(100, 0, levels=(0.5,))
    assert pred.quantiles[0.5] == pytest.approx(300.0, rel=1e-5)
    assert pred.mean == pytest.approx(300.0 * math.exp(0.5**2 / 2), rel=1e-5)
    # Conditioning on tokens already generated moves the prediction even with no data.
    later = p.predict(100, 600)
    assert later.mean > 1.0 and later.quantiles[0.9] > later.quantiles[0.1]


def test_learns_a_constant_length_online():
    p = RemainingLengthPredictor()
    for _ in range(4000):
        p.observe(50, 100)
    assert p.num_observed == 4000
    pred = p.predict(50, 40)
    assert pred.mean == pytest.approx(60.0, abs=1.0)
    assert pred.quantiles[0.5] == pytest.approx(60.0, abs=1.0)


def test_conditions_on_generated_tokens_for_a_bimodal_mix():
    p = RemainingLengthPredictor()
    for i in range(2000):
        p.observe(64, 100 if i % 2 else 1000)
    assert p.predict(64, 0).mean == pytest.approx(550.0, rel=0.02)
    # Past 100 tokens only the long mode is left: 1000 - 200 remaining.
    assert p.predict(64, 200).mean == pytest.approx(800.0, rel=0.02)


def test_conditions_on_prompt_length_buckets():
    p = RemainingLengthPredictor()
    for _ in range(1000):
        p.observe(10, 50)
        p.observe(5000, 500)
    # An unseen bucket gets the global estimate; a seen one shrinks towards it by k / (n + k).
    global_ = p.predict(300, 0).mean
    assert global_ == pytest.approx(275.0, rel=0.02)
    w = 1000 / (1000 + p.shrinkage)
    assert p.predict(10, 0).mean == pytest.approx(w * 50 + (1 - w) * global_, rel=1e-6)
    assert p.predict(5000, 0).mean == pytest.approx(w * 500 + (1 - w) * global_, rel=1e-6)


def test_window_forgets_old_lengths():
    p = RemainingLengthPredictor(window=100)
    for _ in range(100):
        p.observe(32, 10)
    for _ in range(100):
        p.observe(32, 1000)
    assert p.predict(32, 0).mean == pytest.approx(1000.0, rel=0.05)


def test_quantiles_are_calibrated_on_lognormal_lengths():
    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.lognormal(math.log(400), 0.7, size=6000).astype(int), 1)
    p = RemainingLengthPredictor()
    for n in lengths[:3000]:
        p.observe(128, int(n))
    log = PredictionLog(p, record_every=32)
    for i, n in enumerate(lengths[3000:4000]):
        for g in range(0, int(n), 32):
            log.maybe_record(str(i), 128, g)
        log.finish(str(i), int(n))
    s = log.summary()
    assert s["predictions_scored"] > 1000
    for q in (0.1, 0.5, 0.9):
        assert s[f"coverage_q{int(q * 100):02d}"] == pytest.approx(q, abs=0.05)


def test_prediction_log_mae_by_hand():
    p = RemainingLengthPredictor()
    for _ in range(10000):
        p.observe(8, 100)
    log = PredictionLog(p, record_every=50)
    for g in (0, 50):
        log.maybe_record("a", 8, g)
    log.finish("a", 120)  # predictions ~100 and ~50 remaining; truth 120 and 70
    s = log.summary()
    assert s["predictions_scored"] == 2
    assert s["mae_tokens"] == pytest.approx(20.0, abs=0.5)


def test_cap_and_bad_input():
    p = RemainingLengthPredictor()
    assert p.predict(10, 5, cap=3).mean <= 3.0
    with pytest.raises(ValueError, match="bad request state"):
        p.predict(10, -1)
    with pytest.raises(ValueError, match="bad completed request"):
        p.observe(-1, 3)
    with pytest.raises(ValueError, match="quantile"):
        RemainingLengthPredictor(quantiles=(1.5,))
