"""The simulator against the real engine: same trace and step times -> same preemptions."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from serve_jax.config import load_engine_config
from serve_jax.simulator import replay_on_engine, simulate, simulator_config_for_engine
from serve_jax.workloads import RequestSpec, Workload


def small_trace(n: int = 8, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload(
        "engine-check",
        tuple(
            RequestSpec(f"e{i}", 0.01 * i, int(rng.integers(6, 20)), int(rng.integers(10, 30)))
            for i in range(n)
        ),
    )


@pytest.mark.parametrize("policy", ["fcfs_last", "predictive"])
def test_same_preemption_sequence_as_the_engine(policy):
    # 16 blocks of 4 tokens for 8 requests of up to ~50 tokens: preemptions are certain.
    cfg = load_engine_config("tiny_cpu", ["cache.num_device_blocks=16", "cache.num_host_blocks=0"])
    wl = small_trace()
    real = replay_on_engine(cfg, wl, policy)
    assert all(r.num_output_tokens == s.output_len for r, s in zip(real.requests, wl.requests))
    sim = simulate(
        wl,
        policy,
        simulator_config_for_engine(cfg),
        step_times=real.step_seconds,
        costs=copy.deepcopy(real.initial_costs),
        cost_observations=real.cost_observations,
    )
    assert sim.completed == len(wl.requests)
    assert sim.steps == len(real.step_seconds)
    sim_events = sorted((t, rid) for _, t, rid, _ in sim.preemption_log)
    if policy == "fcfs_last":
        assert len(real.preemptions) > 0
    assert sim_events == real.preemptions
