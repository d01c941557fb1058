"""The simulator checked against the real engine: same trace and step times, same preemptions.

`replay_on_engine` runs a workload on `serve_jax.engine.Engine` through the one trace-replay path
(`serve_jax.replay.replay_trace`) with a `serve_jax.replay.StepClock` (one time per step,
advanced by the step's measured wall time), and records the engine's step times, preemptions and
the online fits of its cost hints (an `EngineCore` observer). `simulate_replay` then runs the
simulator on those step times and fits; the scheduler and policy being the same code, it must
produce the same preemption sequence (`EngineReplay.preemptions` against
`serve_jax.simulator.SimulationResult.preemption_log`). With offload the engine's copies land
asynchronously, which the step-time replay does not model.

This module imports the JAX engine; the simulator itself never does.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from serve_jax.config import EngineConfig
from serve_jax.core import StepOutput
from serve_jax.engine import Engine
from serve_jax.interface import Request, VictimPolicy
from serve_jax.preemption import get_policy
from serve_jax.replay import StepClock, replay_trace
from serve_jax.simulator import SimConfig, SimulationResult, simulate
from serve_jax.workloads import Workload

__all__ = ["EngineReplay", "replay_on_engine", "simulate_replay"]


@dataclasses.dataclass
class EngineReplay:
    """What a real-engine replay produced."""

    step_seconds: list[float]
    """Measured wall time of each executed step."""
    preemptions: list[tuple[float, str]]
    """(schedule time, request id) of every preemption, sorted."""
    requests: list[Request]
    """The engine's requests (finished)."""
    num_offload_preemptions: int
    initial_costs: Any = None
    """A copy of the engine's cost hints before the replay."""
    cost_observations: list = dataclasses.field(default_factory=list)
    """Arguments of each ``costs.observe`` the engine made (None where it made none)."""


def replay_on_engine(
    engine_config: EngineConfig,
    workload: Workload,
    policy: str | VictimPolicy,
    *,
    seed: int = 0,
    max_steps: int = 1_000_000,
) -> EngineReplay:
    """Runs ``workload`` on the real `Engine` with a step-synchronous clock.

    Args:
      engine_config: the engine's config.
      workload: open-loop requests (no follow-up turns).
      policy: a policy name or instance.
      seed: seed of the random prompts.
      max_steps: safety limit.

    Raises:
      ValueError: a closed-loop workload.
      RuntimeError: the engine stops making progress.
    """
    if any(r.parent_id for r in workload.requests):
        raise ValueError("replay_on_engine takes open-loop workloads (no follow-up turns)")
    pol = get_policy(policy) if isinstance(policy, str) else policy
    clock = StepClock()
    engine = Engine(engine_config, policy=pol, clock=clock)
    initial_costs = copy.deepcopy(engine.costs)
    observations: list[tuple | None] = []

    def record_fit(out: StepOutput) -> None:  # what the engine fits its cost hints on
        seconds = out.executor_output.step_seconds
        plan = out.scheduler_output
        prefill = sum(c.num_tokens for c in plan.prefills)
        observations.append(None if seconds is None else (prefill, len(plan.decodes), seconds))

    engine.core.add_observer(record_fit)
    run = replay_trace(engine, workload.requests, seed=seed, step_clock=clock, max_steps=max_steps)
    reqs = run.requests
    events = sorted((t, r.request_id) for r in reqs for t in r.preemption_times)
    # The engine saw one clock value per step (its start); a token sampled in a step exists at
    # the step's end, so token and finish times move there for latency metrics.
    end_of = {t: t + dt for t, dt in zip(run.step_starts, run.step_seconds)}
    for r in reqs:
        r.token_times = [end_of.get(x, x) for x in r.token_times]
        if r.first_token_time is not None:
            r.first_token_time = end_of.get(r.first_token_time, r.first_token_time)
        if r.finish_time is not None:
            r.finish_time = end_of.get(r.finish_time, r.finish_time)
    return EngineReplay(
        run.step_seconds,
        events,
        reqs,
        engine.scheduler.num_offload_preemptions,
        initial_costs,
        observations,
    )


def simulate_replay(
    workload: Workload, policy: str | VictimPolicy, config: SimConfig, real: EngineReplay
) -> SimulationResult:
    """The simulator on the engine's step times and cost-hint fits (see the module docstring).

    ``config`` is usually `serve_jax.simulator.simulator_config_for_engine` of the engine's.
    """
    return simulate(
        workload,
        policy,
        config,
        step_times=real.step_seconds,
        costs=copy.deepcopy(real.initial_costs),
        cost_observations=real.cost_observations,
    )
