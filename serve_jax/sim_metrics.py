"""The simulator's per-step counters (an `EngineCore` observer) and its cascade count.

`SimMetrics` is a `serve_jax.core.StepObserver`: after each step of the simulator's
`serve_jax.core.EngineCore` it counts preemptions (with their times and modes), steps with
preemptions right after a step with preemptions, recomputed tokens wasted (what a recompute
victim computes again when it resumes: its computed tokens at the preemption less those its
resumption found in the prefix cache), bytes offloaded and restored, and step durations;
`serve_jax.simulator` turns them and the finished requests into a `SimulationResult`.
`count_cascades` counts preemptions that hit a request within a window of its previous resume
(engine and simulator alike).
"""

from __future__ import annotations

from collections.abc import Sequence

from serve_jax.core import StepOutput
from serve_jax.interface import PreemptMode, Request
from serve_jax.scheduler import Scheduler

__all__ = ["SimMetrics", "count_cascades"]


def count_cascades(requests: Sequence[Request], window_s: float) -> int:
    """Preemptions that hit a request within ``window_s`` seconds of its previous resume.

    Preemption ``k`` (``k >= 1``) of a request follows its resume ``k - 1``.
    """
    n = 0
    for r in requests:
        for k in range(1, len(r.preemption_times)):
            if k - 1 < len(r.resume_times):
                gap = r.preemption_times[k] - r.resume_times[k - 1]
                if 0 <= gap <= window_s:
                    n += 1
    return n


class SimMetrics:
    """Counts what each simulated step did (a `serve_jax.core.StepObserver`).

    Args:
      scheduler: the simulation's scheduler (for the computed tokens a recompute throws away).
      block_bytes: bytes of one KV block (offload and restore traffic).
      num_blocks: device blocks of the run (reported).
    """

    def __init__(self, scheduler: Scheduler, block_bytes: float, num_blocks: int):
        self.scheduler = scheduler
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.back_to_back = 0
        self.wasted = 0
        self.bytes_off = 0.0
        self.bytes_res = 0.0
        self.preempt_times: list[float] = []
        self.preempt_log: list[tuple[int, float, str, str]] = []
        self.step_seconds: list[float] = []
        self.steps = 0
        """Executed steps of the run (set when it ends)."""
        self.run_steps = 0
        """Of those, steps applied in runs of quiet decodes (`add_decode_run`)."""
        self.wall = 0.0
        """Wall-clock seconds of the run (set when it ends)."""
        self._prev_step_preempted = False
        # recompute victims not resumed yet -> their computed tokens at the preemption
        self._to_recompute: dict[str, int] = {}

    def add_decode_run(self, starts_and_ends: Sequence[float]) -> None:
        """Counts a run of decode-only steps (`serve_jax.sim_runs`): ``starts_and_ends`` is the
        start of the first step followed by the end of each."""
        t = starts_and_ends
        self.step_seconds.extend(map(float.__sub__, t[1:], t))  # (each end less its start)
        self.run_steps += len(t) - 1
        self._prev_step_preempted = False

    def __call__(self, out: StepOutput) -> None:
        so = out.scheduler_output
        self.step_seconds.append(float(out.executor_output.step_seconds or 0.0))
        pending = self._to_recompute
        if pending:
            for chunk in so.prefills:
                lost = pending.pop(chunk.request_id, None)
                if lost is not None:  # resumed: it starts after its cached prefix
                    self.wasted += max(lost - chunk.start, 0)
        if so.preemptions:
            if self._prev_step_preempted:
                self.back_to_back += 1
            t_sched = out.scheduled_at
            computed = self.scheduler.preempted_computed_tokens
            for rid, mode in so.preemptions:
                self.preempt_times.append(t_sched)
                self.preempt_log.append((out.step, t_sched, rid, mode.value))
                if mode == PreemptMode.RECOMPUTE:
                    pending[rid] = computed[rid]
        self._prev_step_preempted = bool(so.preemptions)
        if so.offloads:
            self.bytes_off += len(so.offloads) * self.block_bytes
        if so.restores:
            self.bytes_res += len(so.restores) * self.block_bytes
