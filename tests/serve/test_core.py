"""EngineCore: the one loop, driven here by the simulated executor (no JAX); the admission hook."""

from __future__ import annotations

import pytest

from serve_jax.core import EngineCore
from serve_jax.costmodel import RooflineCostModel
from serve_jax.interface import ExecutorOutput, Request, VictimPolicy
from serve_jax.model_config import get_model_config
from serve_jax.scheduler import Scheduler
from serve_jax.sim_executor import STOP_TOKEN, SimulatedExecutor


def make_core(num_blocks: int = 64, policy=None, **sched_kw):
    sched = Scheduler(num_blocks, block_size=4, max_num_seqs=8, max_num_batched_tokens=32,
                      policy=policy, **sched_kw)  # fmt: skip
    costs = RooflineCostModel.create(get_model_config("llama-7b"), "h100", block_size=4)
    lens = {f"r{i}": 5 for i in range(4)}
    executor = SimulatedExecutor(costs, lens)
    return EngineCore(sched, executor, executor.clock), executor


def test_step_plans_runs_applies_then_observes():
    core, executor = make_core()
    assert core.step() is None and core.num_steps == 0  # nothing to run
    for i in range(2):
        core.add_request(Request(f"r{i}", [1] * 6, 20, 0.0, stop_token_ids=frozenset({0})))
    seen = []
    core.add_observer(lambda out: seen.append(("a", out.step)))
    core.add_observer(lambda out: seen.append(("b", out.step)))
    outs = []
    while core.has_work():
        outs.append(core.step())
    assert [o.step for o in outs] == list(range(len(outs))) == list(range(core.num_steps))
    assert seen == [(k, s) for s in range(core.num_steps) for k in "ab"]  # in order, each step
    first = outs[0]
    assert [c.request_id for c in first.scheduler_output.prefills] == ["r0", "r1"]
    # The clock is the executor's: each step starts where the last ended and lasts its time.
    assert first.scheduled_at == 0.0
    for prev, out in zip(outs, outs[1:]):
        assert out.scheduled_at == prev.finished_at
    for out in outs:
        dur = out.finished_at - out.scheduled_at
        assert dur == pytest.approx(out.executor_output.step_seconds) and dur > 0
    # Each request stops on the stop token at its 5th output token, stamped at the step's end.
    final = [ev for o in outs for ev in o.events if ev.finished]
    assert sorted(ev.request_id for ev in final) == ["r0", "r1"]
    assert all(ev.new_token_ids == (STOP_TOKEN,) for ev in final)
    assert outs[-1].finished_at == executor.now
    core.scheduler.blocks.assert_all_free()


class AdmitOnePerStep(VictimPolicy):
    """A policy that uses only the admission hook (preempts nobody)."""

    name = "admit_one"

    def select_victims(self, view):
        return []

    def admission_limit(self, sched):
        return 1


def test_any_policy_may_gate_admission_through_the_hook():
    sched = Scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                      policy=AdmitOnePerStep())  # fmt: skip
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1] * 4, 8, 0.0))
    admitted = []
    for _ in range(3):
        so = sched.schedule(0.0)
        admitted.append([c.request_id for c in so.prefills])
        sched.update_from_output(so, ExecutorOutput(sampled={c.request_id: 1 for c in so.chunks
                                                             if c.sample}), 0.0)  # fmt: skip
    assert admitted == [["r0"], ["r1"], ["r2"]]
    # Without the hook (the default: no limit) all three join the first step.
    plain = Scheduler(64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(3):
        plain.add_request(Request(f"r{i}", [1] * 4, 8, 0.0))
    assert [c.request_id for c in plain.schedule(0.0).prefills] == ["r0", "r1", "r2"]
