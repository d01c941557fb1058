"""Simulator: the real scheduler under a simulated executor; metrics, determinism, replay."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from serve_jax.preemption import ABLATIONS, POLICY_NAMES, FewestOutputPolicy
from serve_jax.scheduler import PreemptMode, Request, VictimPolicy
from serve_jax.sim_metrics import count_cascades
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import RequestSpec, Workload, agentic_workload

# 0.1 GB of KV for a 7B model: 11 blocks of 16 tokens (176 tokens): heavy memory pressure.
TINY = SimConfig(kv_memory_gb=0.1, host_memory_gb=1.0, max_num_batched_tokens=256)


def small_workload(n: int = 12, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    reqs = tuple(
        RequestSpec(f"q{i}", float(i) * 0.05, int(rng.integers(8, 40)), int(rng.integers(20, 90)))
        for i in range(n)
    )
    return Workload("small", reqs)


@pytest.mark.parametrize("policy", POLICY_NAMES + ABLATIONS)
def test_every_policy_completes_every_request(policy):
    wl = small_workload()
    res = simulate(wl, policy, TINY)  # also asserts every block came back
    assert res.completed == res.submitted == len(wl.requests)
    assert res.output_tokens == sum(r.output_len for r in wl.requests)
    # The memory is small enough to force preemptions, except under an admission gate
    # (predictive's, and SGLang's new_token_ratio throttle).
    if policy not in ("predictive", "predictive_recompute", "fewest_output"):
        assert res.preemptions > 0
    row = res.row()
    for key in ("policy", "preemptions", "cascades", "p99_tpot_ms", "p99_ttft_ms",
                "throughput_tok_s", "completed", "submitted"):  # fmt: skip
        assert key in row
    assert row["throughput_tok_s"] > 0 and row["p99_tpot_ms"] > 0


def test_simulation_is_deterministic():
    a = simulate(small_workload(), "predictive", TINY)
    b = simulate(small_workload(), "predictive", TINY)
    assert a.preemption_log == b.preemption_log
    assert a.row()["p99_tpot_ms"] == b.row()["p99_tpot_ms"]


def test_progress_sees_simulated_time_advance_and_changes_nothing():
    seen = []
    a = simulate(small_workload(), "predictive", TINY)
    b = simulate(small_workload(), "predictive", TINY, progress=seen.append)
    assert a.preemption_log == b.preemption_log
    ra, rb = a.row(), b.row()
    ra.pop("sim_wall_s"), rb.pop("sim_wall_s")
    assert ra == rb
    assert len(seen) > 1 and seen == sorted(seen) and seen[-1] > seen[0]


def test_replaying_step_times_gives_the_same_preemptions():
    # The engine-agreement mode: feed a run's step durations back as measured step times.
    cfg = SimConfig(kv_memory_gb=0.1, host_memory_gb=1.0, max_num_batched_tokens=256,
                    finish_by="max_tokens")  # fmt: skip
    first = simulate(small_workload(seed=1), "fcfs_last", cfg)
    again = simulate(small_workload(seed=1), "fcfs_last", cfg, step_times=first.step_seconds)
    assert first.preemptions > 0
    assert again.preemption_log == first.preemption_log
    # Different step times give a different preemption sequence (the check can fail).
    slower = [2 * t for t in first.step_seconds] * 2
    other = simulate(small_workload(seed=1), "fcfs_last", cfg, step_times=slower)
    assert other.preemption_log != first.preemption_log


def test_offload_moves_bytes_both_ways():
    nocache = dataclasses.replace(TINY, enable_prefix_caching=False)
    res = simulate(small_workload(), "predictive_nogate", nocache)
    assert res.offload_preemptions > 0
    assert res.bytes_offloaded > 0 and res.bytes_restored == res.bytes_offloaded
    # With prefix caching, blocks still cached on the device at a restore are not copied back.
    cached = simulate(small_workload(), "predictive_nogate", TINY)
    assert cached.offload_preemptions > 0
    assert 0 < cached.bytes_restored < cached.bytes_offloaded
    block_bytes = TINY.cost_model().block_bytes
    hits = cached.restore_cache_hit_blocks * block_bytes
    assert cached.bytes_restored + hits == cached.bytes_offloaded
    recompute = simulate(small_workload(), "fcfs_last", TINY)
    assert recompute.bytes_offloaded == 0 and recompute.wasted_recompute_tokens > 0


def test_follow_up_turns_arrive_after_their_parent():
    wl = agentic_workload(session_rate=0.5, duration_s=10, mean_turns=3, output_median=20,
                          system_prompt_median=60, tool_tokens_median=20, max_context=170,
                          seed=2)  # fmt: skip
    first_run, finished = {}, {}

    def observer(out):  # a serve_jax.core.StepObserver
        for c in out.scheduler_output.prefills:
            first_run.setdefault(c.request_id, out.scheduled_at)
        for ev in out.events:
            if ev.finished:
                finished[ev.request_id] = out.finished_at

    res = simulate(wl, "fcfs_last", TINY, observers=[observer])
    assert res.completed == len(wl.requests) == len(finished)
    turns = [r for r in wl.requests if r.parent_id]
    assert turns
    for r in turns:
        assert first_run[r.request_id] >= finished[r.parent_id] + r.think_time


def test_count_cascades_by_hand():
    r = Request("x", [1], max_tokens=5, arrival_time=0.0)
    r.preemption_times = [1.0, 2.5, 10.0]
    r.resume_times = [2.0, 3.0]
    # 2nd preemption 0.5 s after the 1st resume (cascade); 3rd 7 s after the 2nd (not).
    assert count_cascades([r], window_s=1.0) == 1
    assert count_cascades([r], window_s=10.0) == 2


def test_request_that_cannot_fit_is_rejected_and_counted():
    """A prompt beyond the device pool is refused at arrival (with its follow-up turn, whose
    context is longer still); the requests that fit all complete."""
    wl = Workload(
        "big",
        (
            RequestSpec("b", 0.0, 5000, 10),
            RequestSpec("b2", 0.0, 5100, 10, parent_id="b", think_time=1.0),
            RequestSpec("ok", 0.5, 20, 10),
        ),
    )
    for policy in ("fcfs_last", "least_computed", "predictive"):
        res = simulate(wl, policy, TINY)
        assert (res.rejected, res.completed, res.submitted) == (2, 1, 3)
        assert res.row()["rejected"] == 2


def test_sglang_throttle_is_what_spares_fewest_output_its_preemptions():
    """Without its new_token_ratio throttle, SGLang's victims preempt on the small workload."""
    wl = small_workload()
    bare = simulate(wl, FewestOutputPolicy(throttle=False), TINY)
    assert bare.preemptions > 0 and bare.completed == len(wl.requests)
    throttled = simulate(wl, FewestOutputPolicy(), TINY)
    assert throttled.preemptions < bare.preemptions


class PreemptAll(VictimPolicy):
    """Preempts every running request: a step can end with nothing running."""

    name = "preempt_all"

    def select_victims(self, view):
        return [(r, PreemptMode.RECOMPUTE) for r in view.running]


def test_a_step_that_preempts_everything_is_not_a_stall():
    """Under vLLM's rule (no admission in a step that preempted) a step may preempt every
    running request and admit nothing; the next step must still run. (Before the fix this
    raised 'simulation stalled' with every block free, as the issue's long-context run did.)"""
    wl = small_workload()
    res = simulate(wl, PreemptAll(), TINY)
    assert res.completed == res.submitted == len(wl.requests) and res.preemptions > 0
    assert res.rejected == 0


def test_prefix_cache_spares_recompute_victims_part_of_their_prefill():
    """fcfs_last's recompute victims resume from their blocks still cached: same preemptions,
    fewer tokens computed again than with caching off (where every computed token is lost)."""
    wl = small_workload()
    on = simulate(wl, "fcfs_last", TINY)
    off = simulate(wl, "fcfs_last", dataclasses.replace(TINY, enable_prefix_caching=False))
    assert on.preemptions == off.preemptions > 0
    assert off.prefix_hit_rate == 0.0 < on.prefix_hit_rate
    assert 0 < on.wasted_recompute_tokens < off.wasted_recompute_tokens


def test_agentic_turns_hit_the_previous_turns_context():
    """Every turn re-sends its session's context, found in the cache; on 4 GB (7.6k tokens) the
    turns whose context outgrew the device are rejected, never lost."""
    wl = agentic_workload(duration_s=60.0, session_rate=0.5, seed=1)
    cfg = SimConfig(kv_memory_gb=8.0, max_num_batched_tokens=1024)
    res = simulate(wl, "fcfs_last", cfg)
    assert res.completed == res.submitted and res.prefix_hit_rate > 0.2
    off = simulate(wl, "fcfs_last", dataclasses.replace(cfg, enable_prefix_caching=False))
    assert off.prefix_hit_rate == 0.0 and off.completed == off.submitted
    small = simulate(wl, "least_computed", dataclasses.replace(cfg, kv_memory_gb=4.0))
    assert small.rejected > 0 and small.completed + small.rejected == small.submitted
