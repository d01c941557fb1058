"""Trace replay into the `Engine`: the one path from a workload's requests to engine steps.

`replay_trace` adds each `serve_jax.workloads.RequestSpec` once the engine's clock reaches its
arrival time (stamped with that arrival time, so queueing behind a busy step counts in its TTFT),
with a prompt of random token ids of the spec's length and its output forced to the spec's length
(``max_tokens``, ``ignore_eos``), as benchmark harnesses do with prompt-less traces. It drives the
engine with one of two clocks:

* real time (the engine's own clock; ``python -m serve_jax replay``): idle gaps are slept;
* a `StepClock` (the engine/simulator cross-check, `serve_jax.crosscheck`): the clock shows one
  time per step and moves only by each step's measured wall time, or to the next arrival when
  the engine is idle, so the timeline is reproducible from the list of step times.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from serve_jax.engine import Engine
from serve_jax.interface import Request
from serve_jax.loadgen import synthetic_prompt
from serve_jax.metrics import RequestRecord, record_from
from serve_jax.sampling import SamplingParams
from serve_jax.workloads import RequestSpec

__all__ = ["StepClock", "ReplayRun", "replay_trace"]


class StepClock:
    """A clock that only moves when told: the engine sees one time per step."""

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@dataclasses.dataclass
class ReplayRun:
    """What a replay produced."""

    records: list[RequestRecord]
    """One record per finished request (engine timestamps), in finishing order."""
    duration: float
    """Clock seconds from the start of the replay to its end."""
    requests: list[Request]
    """The engine's scheduler requests, in arrival order."""
    step_starts: list[float]
    """Clock at the start of each executed step."""
    step_seconds: list[float]
    """Measured wall time of each executed step."""


def replay_trace(
    engine: Engine,
    trace: Sequence[RequestSpec],
    *,
    seed: int = 0,
    step_clock: StepClock | None = None,
    max_steps: int = 1_000_000,
    progress: Callable[[int], None] | None = None,
) -> ReplayRun:
    """Runs ``trace`` through ``engine``; see the module docstring.

    Args:
      engine: the engine (built with ``clock=step_clock`` when one is given).
      trace: open-loop requests (follow-up turns are replayed at their open-loop arrival).
      seed: request ``i`` of ``trace`` gets the prompt of seed ``seed + i`` (and sampling
        seed ``i``).
      step_clock: drive the engine's `StepClock` (else the engine's clock is real time).
      max_steps: safety limit with a step clock.
      progress: called with the number of finished requests after each finish.

    Raises:
      RuntimeError: with a step clock, a step that executes nothing, or past ``max_steps``.
    """
    if step_clock is not None and engine.clock is not step_clock:
        raise ValueError("replay_trace: the engine must be built with clock=step_clock")
    clock = engine.clock
    vocab = engine.model_config.vocab_size
    t0 = clock()
    pending = sorted(enumerate(trace), key=lambda x: x[1].arrival_time)
    run = ReplayRun([], 0.0, [], [], [])
    i = 0
    while i < len(pending) or engine.has_work():
        now = clock()
        while i < len(pending) and t0 + pending[i][1].arrival_time <= now:
            idx, spec = pending[i]
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, seed=idx)
            prompt = synthetic_prompt(spec.prompt_len, seed + idx, high=min(259, vocab))
            arrival = t0 + spec.arrival_time
            engine.add_request(prompt, params, request_id=spec.request_id, arrival_time=arrival)
            run.requests.append(engine.scheduler.requests[spec.request_id])
            i += 1
        if not engine.has_work():
            if step_clock is not None:
                step_clock.t = max(step_clock.t, t0 + pending[i][1].arrival_time)
            else:
                time.sleep(max(0.0, t0 + pending[i][1].arrival_time - clock()))
            continue
        before = engine.num_steps
        start = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - start
        if engine.num_steps != before:
            run.step_starts.append(now)
            run.step_seconds.append(seconds)
        for out in outputs:
            if out.finished:
                run.records.append(record_from(out.metrics))
                if progress:
                    progress(len(run.records))
        if step_clock is not None:
            if engine.num_steps == before:
                raise RuntimeError(f"engine made no progress at t={now:.4f}s")
            if len(run.step_seconds) > max_steps:
                raise RuntimeError(f"engine replay passed max_steps={max_steps}")
            step_clock.t += seconds
    run.duration = clock() - t0
    return run
