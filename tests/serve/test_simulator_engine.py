"""The simulator against the real engine (same trace and step times -> same preemptions); the
Engine on the simulated executor; the one trace-replay path."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serve_jax.__main__ import main as serve_jax_main
from serve_jax.config import load_engine_config
from serve_jax.costmodel import RooflineCostModel
from serve_jax.crosscheck import replay_on_engine, simulate_replay
from serve_jax.engine import Engine
from serve_jax.model_config import get_model_config
from serve_jax.predictor import RemainingLengthPredictor
from serve_jax.preemption import PredictivePolicy
from serve_jax.replay import replay_trace
from serve_jax.sampling import SamplingParams
from serve_jax.sim_executor import TOKEN, SimulatedExecutor
from serve_jax.simulator import simulator_config_for_engine
from serve_jax.workloads import RequestSpec, Workload


def small_trace(n: int = 8, seed: int = 0, gap_s: float = 0.01) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload(
        "engine-check",
        tuple(
            RequestSpec(f"e{i}", gap_s * i, int(rng.integers(6, 20)), int(rng.integers(10, 30)))
            for i in range(n)
        ),
    )


def scaled_predictive() -> PredictivePolicy:
    """predictive with its predictor's prior at this trace's scale (outputs of 10-30 tokens, not
    the default prior's 256): it admits what it predicts will fit, is wrong for some requests,
    and preempts; with the default prior its gate runs one request at a time and never does."""
    return PredictivePolicy(RemainingLengthPredictor(prior_median=8.0))


@pytest.mark.parametrize(
    "make", [lambda: "fcfs_last", scaled_predictive], ids=["fcfs_last", "predictive"]
)
def test_same_preemption_sequence_as_the_engine(make):
    # 16 blocks of 4 tokens for 8 requests of up to ~50 tokens, all arrived by the end of the
    # first step however fast steps are (10 us apart): preemptions are certain. (10 ms apart,
    # warm steps of 0.4 ms let each request finish before the next arrived: no preemption.)
    cfg = load_engine_config("tiny_cpu", ["cache.num_device_blocks=16", "cache.num_host_blocks=0"])
    wl = small_trace(gap_s=1e-5)
    real = replay_on_engine(cfg, wl, make())
    assert all(r.num_output_tokens == s.output_len for r, s in zip(real.requests, wl.requests))
    sim = simulate_replay(wl, make(), simulator_config_for_engine(cfg), real)
    assert sim.completed == len(wl.requests)
    assert sim.steps == len(real.step_seconds)
    sim_events = sorted((t, rid) for _, t, rid, _ in sim.preemption_log)
    assert len(real.preemptions) > 0  # both policies preempt: the sequences are worth comparing
    assert sim_events == real.preemptions


def test_engine_runs_the_simulated_executor():
    # Engine = EngineCore + text: with executor= it builds no model and no JAX executor.
    cfg = load_engine_config("tiny_cpu")
    mc = get_model_config(cfg.model.preset)
    costs = RooflineCostModel.create(mc, "h100", block_size=cfg.cache.block_size)
    executor = SimulatedExecutor(costs, {}, emit_stop=False)
    engine = Engine(cfg, executor=executor, clock=executor.clock)
    assert engine.model is None and engine.executor is executor
    outs = engine.generate(["ab", "cde"], SamplingParams(max_tokens=3))
    assert [o.token_ids for o in outs] == [(TOKEN,) * 3] * 2
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.num_steps == executor.steps > 0
    assert outs[0].metrics.finish_time == pytest.approx(executor.now)


def test_replay_trace_in_real_time():
    cfg = load_engine_config("tiny_cpu")
    engine = Engine(cfg)
    trace = small_trace(3).requests
    run = replay_trace(engine, trace, seed=1)
    assert len(run.records) == 3 and run.duration > 0
    assert sorted(r.num_output_tokens for r in run.records) == sorted(s.output_len for s in trace)
    assert len(run.step_seconds) == len(run.step_starts) == engine.num_steps


def test_crosscheck_command(tmp_path):
    out = tmp_path / "check.json"
    argv = ["crosscheck", "--config", "tiny_cpu", "cache.num_device_blocks=16",
            "cache.num_host_blocks=0", "--workload", "reasoning", "--num-requests", "6",
            "--rate-scale", "400", "--token-scale", "0.005", "--policies", "fcfs_last,predictive",
            "--json", str(out)]  # fmt: skip
    assert serve_jax_main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["fcfs_last", "predictive"]
    assert all(r["same_preemption_sequence"] and r["completed"] == 6 for r in rows)


def test_simulator_config_follows_the_engine_cache_switches():
    """The cross-check's simulator runs with the engine's prefix-cache settings (it ran with
    caching on while the engine had it off)."""
    cfg = load_engine_config(
        "tiny_cpu",
        [
            "cache.enable_prefix_caching=false",
            "cache.host_prefix_caching=true",
            "cache.host_retention=all",
        ],
    )
    sim = simulator_config_for_engine(cfg)
    assert sim.enable_prefix_caching is False and sim.host_prefix_caching is True
    assert sim.host_retention == "all"
    assert simulator_config_for_engine(load_engine_config("tiny_cpu")).enable_prefix_caching
