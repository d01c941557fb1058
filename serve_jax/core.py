"""`EngineCore`: the one engine loop of serve_jax, shared by the JAX engine and the simulator.

::

    core = EngineCore(scheduler, executor, clock)
    core.add_request(request)               # a `serve_jax.interface.Request`
    while core.has_work():
        out = core.step()                   # StepOutput, or None when nothing could run

One `step` is ``scheduler.schedule(now) -> executor.execute(plan) ->
scheduler.update_from_output(plan, result, now)``, then every observer is called with the
`StepOutput`. What differs between serving and simulating is only what is plugged in:

* `serve_jax.engine.Engine`: the JAX executor, a wall clock, and an observer that fits the
  policy's cost hints on measured step times; it adds tokenizer, detokenizer and text.
* `serve_jax.simulator.simulate`: the simulated executor (whose clock is simulated time), an
  arrival feeder and a metrics observer.

Pure Python: no JAX here (the executor brings it when it is the JAX one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from serve_jax.interface import (
    Executor,
    ExecutorOutput,
    Request,
    RequestEvent,
    SchedulerOutput,
)
from serve_jax.scheduler import Scheduler

__all__ = ["EngineCore", "StepOutput", "StepObserver"]


@dataclasses.dataclass(slots=True)
class StepOutput:
    """What one executed step planned, ran and produced."""

    step: int
    """Index of the step among the executed ones (0, 1, ...)."""
    scheduled_at: float
    """Clock when the step was planned."""
    finished_at: float
    """Clock when its results were applied (token and finish times)."""
    scheduler_output: SchedulerOutput
    executor_output: ExecutorOutput
    events: list[RequestEvent]
    """New tokens per request (finished ones included)."""


StepObserver = Callable[[StepOutput], None]
"""Called after every executed step, in the order the observers were added."""


class EngineCore:
    """Scheduler + executor + clock: add requests, step, observe.

    Args:
      scheduler: the `Scheduler` (queues, admission, preemption, block accounting).
      executor: runs a `SchedulerOutput` (`serve_jax.executor.JaxExecutor`, or the simulator's).
      clock: seconds since some origin; read before planning and after executing each step.
      observers: callables invoked with each `StepOutput`.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock: Callable[[], float],
        observers: Iterable[StepObserver] = (),
    ):
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.observers: list[StepObserver] = list(observers)
        self.num_steps = 0

    def add_observer(self, observer: StepObserver) -> None:
        """Calls ``observer`` after every later step."""
        self.observers.append(observer)

    def add_request(self, request: Request) -> None:
        """Queues ``request`` (see `Scheduler.add_request`)."""
        self.scheduler.add_request(request)

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or offloaded."""
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Unfinished requests, or host copies still in flight (keep stepping until False)."""
        return self.scheduler.has_work()

    def step(self) -> StepOutput | None:
        """Plans, runs and applies one step; None if there was nothing to run.

        A step with nothing to compute still runs while host copies are in flight (the
        executor reports them when they land).
        """
        scheduler = self.scheduler
        now = self.clock()
        plan = scheduler.schedule(now)
        if plan.is_empty and not scheduler.blocks.has_copies_in_flight():
            return None
        result = self.executor.execute(plan)
        end = self.clock()
        events = scheduler.update_from_output(plan, result, end)
        out = StepOutput(self.num_steps, now, end, plan, result, events)
        self.num_steps += 1
        for observer in self.observers:
            observer(out)
        return out
