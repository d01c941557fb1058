"""Runs of quiet decode steps (serve_jax.sim_runs): the same results as stepping one by one."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from serve_jax.predictor import RemainingLengthPredictor
from serve_jax.preemption import PredictivePolicy
from serve_jax.scheduler import Request
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import RequestSpec, Workload, agentic_workload, reasoning_workload


def _same(a, b):
    ra, rb = a.row(), b.row()
    ra.pop("sim_wall_s"), rb.pop("sim_wall_s")
    assert json.dumps(ra) == json.dumps(rb)  # (NaN-safe)
    assert a.completed > 0
    assert a.preemption_log == b.preemption_log
    assert a.step_seconds == b.step_seconds
    assert np.array_equal(a.tpots_ms, b.tpots_ms)


CASES = [
    # (workload, config): memory pressure with offload, prefix caching across turns, SGLang's
    # per-step throttle state, and a roomy pool where almost every step is quiet.
    (
        "reasoning",
        SimConfig(kv_memory_gb=0.5, host_memory_gb=2.0, max_num_batched_tokens=512),
    ),
    ("agentic", SimConfig(kv_memory_gb=1.5, host_memory_gb=2.0, max_num_batched_tokens=1024)),
    ("agentic", SimConfig(kv_memory_gb=4.0, max_num_batched_tokens=1024)),
    (
        "agentic",
        SimConfig(
            kv_memory_gb=1.5,
            host_memory_gb=0.5,
            max_num_batched_tokens=1024,
            host_prefix_caching=True,
        ),
    ),
]


def _workload(name: str) -> Workload:
    if name == "reasoning":
        return reasoning_workload(rate=0.5, duration_s=30.0, seed=3)
    return agentic_workload(session_rate=0.3, duration_s=30.0, max_context=2000, seed=2)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(
    "policy", ["fcfs_last", "fcfs_last_offload", "fewest_output", "predictive", "predictive_nogate"]
)
def test_decode_runs_give_the_same_results(case, policy):
    name, cfg = CASES[case]
    wl = _workload(name)
    fast = simulate(wl, policy, cfg)
    slow = simulate(wl, policy, dataclasses.replace(cfg, decode_runs=False))
    _same(fast, slow)
    assert slow.decode_run_steps == 0
    assert fast.decode_run_steps > 0  # the fast path ran (so the comparison means something)
    if policy == "predictive":
        assert fast.predictor_error == slow.predictor_error


class _CountingGate(PredictivePolicy):
    """``predictive``, counting the times the simulator asks its gate about a later step."""

    asked_ahead = 0

    def admission_limit_ahead(self, sched, steps, free_blocks):
        self.asked_ahead += steps > 0
        return super().admission_limit_ahead(sched, steps, free_blocks)


def test_decode_runs_while_requests_wait_at_the_gate():
    # Memory pressure: requests wait at predictive's gate while the running ones decode. Those
    # steps run at once, the gate asked at each as `schedule` asks it (its predictions
    # re-conditioned at the same token counts), stopping at the first step that admits.
    name, cfg = CASES[0]
    wl = _workload(name)
    gate = _CountingGate()
    fast = simulate(wl, gate, cfg)
    slow = simulate(wl, "predictive", dataclasses.replace(cfg, decode_runs=False))
    _same(fast, slow)
    assert fast.predictor_error == slow.predictor_error
    assert gate.asked_ahead > 100


def test_decode_runs_stop_at_arrivals_and_finishes():
    # Two long requests and a late arrival: the run must end before the step that would see
    # the arrival, and before each request's last token.
    reqs = (
        RequestSpec("a", 0.0, 32, 300),
        RequestSpec("b", 0.0, 48, 180),
        RequestSpec("c", 2.5, 16, 40),
    )
    wl = Workload("three", reqs)
    cfg = SimConfig(kv_memory_gb=1.0)
    fast = simulate(wl, "fcfs_last", cfg)
    slow = simulate(wl, "fcfs_last", dataclasses.replace(cfg, decode_runs=False))
    _same(fast, slow)
    assert fast.completed == 3 and fast.decode_run_steps > 0.8 * fast.steps


def test_predictive_log_records_every_grid_point_of_a_run():
    # One call for 200 new tokens records the grid points 64, 128 and 192, as 200 calls do.
    def log_after(calls):
        pol = PredictivePolicy(RemainingLengthPredictor(), record_every=64)
        req = Request("r", [1] * 10, max_tokens=1000, arrival_time=0.0)
        for n_new in calls:
            req.output_token_ids.extend([1] * n_new)
            pol.on_tokens(req, 0.0, n_new)
        return pol.log._open["r"]

    one_by_one = log_after([1] * 200)
    assert [g for g, _ in one_by_one] == [64, 128, 192]
    assert log_after([200]) == one_by_one
    assert log_after([63, 1, 100, 36]) == one_by_one


def test_predictor_sums_stay_exact_past_the_tree_size():
    # Lengths past the Fenwick tree's first size (1024) grow it; the prediction must equal one
    # computed from the plain sorted samples.
    p = RemainingLengthPredictor(window=50, shrinkage=0.0)
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(1, 5000, size=120)]
    for n in lengths:
        p.observe(8, n)
    kept = sorted(lengths[-50:])
    for g in (0, 10, 900, 2500, 4990):
        above = [x for x in kept if x > g]
        if above:
            want = sum(above) / len(above) - g
            assert p.predict(8, g).mean == pytest.approx(want, rel=1e-12)
