"""The one step loop of paragan_jax: drives a runner over batches for N steps or T seconds.

The `Trainer` (`paragan_jax.train`), the multi-process async workers (`paragan_jax.distributed`),
the benchmarks and the scaling check all run their steps through `run_steps`, so they time steps
the same way:

- the first step compiles (and so does a multi-process runner's first exchange): it is waited
  for and kept out of ``wall_s`` (``compile_s`` is the time until it finished);
- at most one step is in flight: the host prepares step i+1 while step i runs, but never races
  further ahead, so a loader's wait for input measures input stalls rather than queued device
  work (what the adaptive pipeline reads); ``block_each_step`` waits for every step instead and
  records per-step wall and CPU times;
- the loop stops after ``steps`` steps, or once ``seconds`` have passed since the first step
  finished; every runner then gets a say through ``end_step`` (a multi-process runner agrees on
  the stop with its peers there, so all processes leave the loop at the same step).

A runner (`Runner`) is anything with ``run_step(batches) -> metrics`` and
``end_step(stop) -> bool``: `paragan_jax.steps.SyncRunner`, `paragan_jax.async_scheme.AsyncRunner`
and `paragan_jax.distributed.ProcessPairRunner`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import jax
import numpy as np

__all__ = ["LoopStats", "Runner", "grouped", "run_steps"]

HostBatch = dict[str, np.ndarray]


class Runner(Protocol):
    """What `run_steps` drives: one scheme's state and compiled programs."""

    def run_step(self, batches: list[HostBatch]) -> dict[str, jax.Array]:
        """Dispatches one G step (with its ``n_disc`` D steps) on the loader batches given
        (empty for a runner that reads no data); returns the step's metrics (device arrays)."""
        ...

    def end_step(self, stop: bool) -> bool:
        """Finishes the iteration; `stop` is this loop's decision, the result the one all
        processes of the run follow."""
        ...


@dataclasses.dataclass
class LoopStats:
    """What one `run_steps` call did and how long it took."""

    steps: int  # steps run
    wall_s: float  # from the end of the first (compiling) step to the end of the last
    compile_s: float  # from the start to the end of the first step
    metrics: dict[str, Any]  # the last step's metrics (device arrays, ready)
    step_times: list[float] = dataclasses.field(default_factory=list)  # block_each_step only
    cpu_times: list[float] = dataclasses.field(default_factory=list)  # process CPU s per step

    @property
    def timed_steps(self) -> int:
        """Steps inside ``wall_s`` (all but the first)."""
        return max(self.steps - 1, 0)

    @property
    def steps_per_sec(self) -> float:
        timed = self.timed_steps
        return timed / self.wall_s if self.wall_s > 0 and timed else float("nan")


def grouped(loader: Iterator[HostBatch], n: int) -> Iterator[list[HostBatch]]:
    """Each step's ``n`` consecutive loader batches (``n_disc`` of them: one per D update)."""
    while True:
        yield [next(loader) for _ in range(n)]


def run_steps(
    runner: Runner,
    batches: Iterable[list[HostBatch]] | None,
    steps: int,
    *,
    seconds: float | None = None,
    on_step: Callable[[int, dict[str, Any]], bool | None] | None = None,
    block_each_step: bool = False,
) -> LoopStats:
    """Runs up to `steps` steps of `runner`.

    Args:
      runner: the scheme (see `Runner`).
      batches: each step's loader batches (see `grouped`), or None for a runner that reads no
        data (the generator process of the two-process scheme).
      steps: the most steps to run (0 runs none).
      seconds: stop once this much time has passed after the first (compiling) step.
      on_step: called after each step with the number of steps run so far in this call and the
        step's metrics (logging, checkpoints, progress); the step may still be running. A true
        result stops the loop after this step (a preemption notice).
      block_each_step: wait for every step and record its wall and CPU time.

    Returns:
      `LoopStats`.
    """
    stats = LoopStats(steps=0, wall_s=0.0, compile_s=0.0, metrics={})
    if steps <= 0:
        return stats
    source = iter(batches) if batches is not None else None
    t_start = t0 = time.perf_counter()
    in_flight = metrics = None
    while True:
        step_batches = next(source) if source is not None else []
        t_step, c_step = time.perf_counter(), time.process_time()
        metrics = runner.run_step(step_batches)
        if block_each_step:
            jax.block_until_ready(metrics)
            stats.step_times.append(time.perf_counter() - t_step)
            stats.cpu_times.append(time.process_time() - c_step)
        if in_flight is not None:
            jax.block_until_ready(in_flight)
        in_flight = metrics
        stats.steps += 1
        stop = stats.steps >= steps
        if on_step is not None and on_step(stats.steps, metrics):
            stop = True
        if stats.steps > 1 and seconds is not None and time.perf_counter() - t0 >= seconds:
            stop = True
        stop = runner.end_step(stop)
        if stats.steps == 1:  # the first iteration compiles (its exchange too): not timed
            jax.block_until_ready(metrics)
            t0 = time.perf_counter()
            stats.compile_s = t0 - t_start
        if stop:
            break
    jax.block_until_ready(metrics)
    stats.wall_s = time.perf_counter() - t0
    stats.metrics = metrics
    return stats
