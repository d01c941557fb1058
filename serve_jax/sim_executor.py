"""The simulator's executor: a `SchedulerOutput` run in simulated time on a cost model.

`SimulatedExecutor` implements the scheduler's `Executor` protocol: a step's duration comes from
the roofline cost model (`serve_jax.costmodel`) of the scheduled prefill chunks and decodes (or,
to check the simulator against the real engine, from a list of step times measured there); KV
copies run on a modelled host link, one queue per direction: restores are copied before the
step's compute (on the critical path), offloads are issued after it and complete in the
background, and their device blocks come back only when the copy has landed, exactly as the
scheduler's in-flight accounting expects. Its clock (`SimulatedExecutor.clock`) is the
simulation's time, which `serve_jax.core.EngineCore` reads.

Requests stop the way the engine stops them: the executor samples `STOP_TOKEN` when a request
reaches its workload output length (``emit_stop``). `compact_tokens` keeps only the counts of a
finished request's tokens (long traces).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from serve_jax.costmodel import RooflineCostModel
from serve_jax.interface import ExecutorOutput, Request, SchedulerOutput

__all__ = ["SimulatedExecutor", "STOP_TOKEN", "TOKEN", "compact_tokens"]

STOP_TOKEN = 0
"""What the simulated executor samples to end a request."""
TOKEN = 1
"""Every other token (prompts and outputs) of a simulated request."""
_UNBOUNDED = 1 << 62


class _ConstTokens:
    """A read-only sequence of ``n`` copies of one token id (prompts of simulated requests)."""

    __slots__ = ("n", "tok")

    def __init__(self, n: int, tok: int = TOKEN):
        self.n, self.tok = n, tok

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.tok] * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return self.tok

    def __iter__(self):
        return iter([self.tok] * self.n)

    def __add__(self, other):
        return list(self) + list(other)


class SimulatedExecutor:
    """Executes a `SchedulerOutput` in simulated time.

    Args:
      costs: roofline cost model (step time and host-link transfers).
      output_lens: target output length of each request id (the executor samples
        `STOP_TOKEN` at that length when ``emit_stop`` is True).
      emit_stop: sample a stop token at the target length (else always a plain token).
      step_times: if given, step ``k`` takes ``step_times[k]`` seconds instead of the roofline
        figure (the real engine's measured step times), and copies complete within the step.
    """

    def __init__(
        self,
        costs: RooflineCostModel,
        output_lens: dict[str, int],
        *,
        emit_stop: bool = True,
        step_times: Sequence[float] | None = None,
    ):
        self.costs = costs
        self.output_lens = output_lens
        self.emit_stop = emit_stop
        self.step_times = list(step_times) if step_times is not None else None
        self.now = 0.0
        self._d2h_free_at = 0.0  # host link, device -> host direction
        self._pending_offloads: list[tuple[float, int, list[tuple[int, int]]]] = []
        self._seq = 0
        self.steps = 0

    def clock(self) -> float:
        """Simulated seconds: the end of the last step, or later after `set_time`."""
        return self.now

    def set_time(self, now: float) -> None:
        """Moves the executor's clock forward (idle time between steps)."""
        self.now = max(self.now, now)

    def has_copies_pending(self) -> bool:
        """Whether an offload issued by an earlier step has not landed yet."""
        return bool(self._pending_offloads)

    def steps_before_stop(self, req: Request) -> int:
        """How many more decode steps ``req`` runs before the one that samples its stop token
        (unbounded: a large number)."""
        if TOKEN in req.stop_token_ids:
            return 0
        if not self.emit_stop:
            return _UNBOUNDED
        target = self.output_lens.get(req.request_id)
        if target is None:
            return _UNBOUNDED
        return target - len(req.output_token_ids) - 1

    def sampled_token(self, req: Request) -> int:
        """The token `execute` samples for ``req``'s next decode (`STOP_TOKEN` at its length)."""
        n_out = len(req.output_token_ids) + 1
        stop = self.emit_stop and n_out >= self.output_lens.get(req.request_id, math.inf)
        return STOP_TOKEN if stop else TOKEN

    def decode_run_ends(
        self, batch: int, context: int, max_steps: int, until: float | None
    ) -> list[float]:
        """End times of up to ``max_steps`` decode-only steps of ``batch`` requests with
        ``context`` computed tokens (one more each step), as `execute` times them one by one; the
        run stops before a step that would start at or after ``until`` (the next arrival).

        Only for a run with no copies pending and roofline step times (`serve_jax.sim_runs`).
        """
        if self.step_times is not None or self._pending_offloads:
            raise ValueError("decode runs need roofline step times and no copies in flight")
        step = self.costs.step_seconds
        ends: list[float] = []
        now = self.now
        for j in range(max_steps):
            if j and until is not None and now >= until:
                break
            # As `execute` times a step of decodes only: their context counts the new token.
            now = now + step((), batch, context + (j + 1) * batch)
            ends.append(now)
        return ends

    def advance(self, ends: Sequence[float]) -> None:
        """Accounts for a run of steps that ended at ``ends`` (`decode_run_ends`)."""
        if ends:
            self.now = ends[-1]
            self.steps += len(ends)

    def compute_seconds(self, so: SchedulerOutput) -> float:
        """Roofline time of the step's prefill chunks and decodes."""
        chunks = [(c.num_tokens, c.start) for c in so.prefills]
        ctx = sum([c.start + c.num_tokens for c in so.decodes])
        return self.costs.step_seconds(chunks, len(so.decodes), ctx)

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        """Runs one step; returns sampled tokens, completed copies and the step's duration."""
        out = ExecutorOutput()
        start = self.now
        if self.step_times is not None:
            if self.steps >= len(self.step_times):
                raise ValueError(
                    f"step_times has {len(self.step_times)} entries; step {self.steps} needs one"
                )
            dur = float(self.step_times[self.steps])
            end = start + dur
            out.completed_restores = list(so.restores)
            out.completed_offloads = list(so.offloads)
        else:
            restore = self.costs.transfer_seconds(len(so.restores)) if so.restores else 0.0
            compute = self.compute_seconds(so)
            end = start + restore + compute
            out.completed_restores = list(so.restores)
            if so.offloads:
                begin = max(self._d2h_free_at, end)
                done = begin + self.costs.transfer_seconds(len(so.offloads))
                self._d2h_free_at = done
                heapq.heappush(self._pending_offloads, (done, self._seq, list(so.offloads)))
                self._seq += 1
            if not so.chunks and not so.restores and self._pending_offloads:
                # Nothing to compute: the engine waits for the next copy to land.
                end = max(end, self._pending_offloads[0][0])
            while self._pending_offloads and self._pending_offloads[0][0] <= end:
                out.completed_offloads.extend(heapq.heappop(self._pending_offloads)[2])
        sampled, output_lens, emit_stop = out.sampled, self.output_lens, self.emit_stop
        for chunks in (so.prefills, so.decodes):
            for c in chunks:
                if c.sample:
                    n_out = c.num_output_tokens + 1
                    stop = emit_stop and n_out >= output_lens.get(c.request_id, math.inf)
                    sampled[c.request_id] = STOP_TOKEN if stop else TOKEN
        out.step_seconds = end - start
        self.now = end
        self.steps += 1
        return out


def compact_tokens(req: Request) -> None:
    """Keeps only the counts of a finished request's tokens (memory of long traces)."""
    req.prompt_token_ids = _ConstTokens(req.num_prompt_tokens)  # type: ignore[assignment]
    req.output_token_ids = _ConstTokens(req.num_output_tokens)  # type: ignore[assignment]
