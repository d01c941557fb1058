"""Trace-driven serving simulator: the real scheduler and policies, in simulated time.

Only the executor is simulated. `SimulatedExecutor` implements the scheduler's `Executor`
protocol: a step's duration comes from the roofline cost model (`serve_jax.costmodel`) of the
scheduled prefill chunks and decodes (or, to check the simulator against the real engine, from
a list of step times measured there); KV copies run on a modelled host link, one queue per
direction: restores are copied before the step's compute (on the critical path), offloads are
issued after it and complete in the background, and their device blocks come back only when
the copy has landed, exactly as the scheduler's in-flight accounting expects.

Requests stop the way the engine stops them: by default the executor samples a stop token when a
request reaches its workload output length and ``max_tokens`` is only the context limit, so no
policy or predictor can read a request's true length from ``max_tokens``. (With
``finish_by="max_tokens"``, the engine-replay convention, ``max_tokens`` is the output length.)

`simulate` runs one workload under one policy and returns a `SimulationResult` with the metrics
of the issue: preemptions (total, per request, over time), cascades (a request preempted again
within ``cascade_window_s`` of being resumed; steps with preemptions right after a step with
preemptions), recomputed tokens wasted, bytes offloaded and restored, TTFT/TPOT/E2EL statistics,
goodput under SLOs and throughput. Multi-turn workloads are closed-loop: a follow-up turn arrives
``think_time`` after its parent finishes.

Checking against the real engine: `replay_on_engine` runs a workload on `serve_jax.engine.Engine`
with a `StepClock` (one time per step, advanced by the step's measured wall time) and records the
engine's step times, preemptions and online cost-hint fits; `simulate` given those step times and
fits (``step_times``, ``costs``, ``cost_observations``) must produce the same preemption sequence.
With offload the engine's copies land asynchronously, which the step-time replay does not model.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from serve_jax.costmodel import RooflineCostModel
from serve_jax.metrics import Slo, record_from, request_latencies, summarize
from serve_jax.model_config import ModelConfig, get_model_config
from serve_jax.preemption import get_policy
from serve_jax.scheduler import (
    ExecutorOutput,
    PreemptMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    VictimPolicy,
)
from serve_jax.workloads import RequestSpec, Workload

__all__ = [
    "SimulatedExecutor",
    "SimConfig",
    "SimulationResult",
    "simulate",
    "count_cascades",
    "STOP_TOKEN",
]

STOP_TOKEN = 0
_TOKEN = 1


class _ConstTokens:
    """A read-only sequence of ``n`` copies of one token id (prompts of simulated requests)."""

    __slots__ = ("n", "tok")

    def __init__(self, n: int, tok: int = _TOKEN):
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


class _TokenView:
    """``prompt + output`` without building the concatenation (sliced by the scheduler)."""

    __slots__ = ("req",)

    def __init__(self, req: Request):
        self.req = req

    def __len__(self) -> int:
        return self.req.num_tokens

    def __getitem__(self, s: slice) -> list[int]:
        p, o = self.req.prompt_token_ids, self.req.output_token_ids
        n = len(p)
        start, stop, _ = s.indices(n + len(o))
        if start >= n:  # a decode: only output tokens
            return o[start - n : stop - n]
        head = p[start : min(stop, len(p))] if start < len(p) else []
        tail = o[max(start - len(p), 0) : max(stop - len(p), 0)] if stop > len(p) else []
        return list(head) + list(tail)


class SimRequest(Request):
    """A `Request` with a compact prompt: identical scheduling, no per-token list copies."""

    @property
    def all_token_ids(self) -> _TokenView:  # type: ignore[override]
        return _TokenView(self)


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

    def set_time(self, now: float) -> None:
        """Moves the executor's clock forward (idle time between steps)."""
        self.now = max(self.now, now)

    @property
    def next_copy_completion(self) -> float | None:
        """When the earliest offload in flight lands, if any."""
        return self._pending_offloads[0][0] if self._pending_offloads else None

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
                    sampled[c.request_id] = STOP_TOKEN if stop else _TOKEN
        out.step_seconds = end - start
        self.now = end
        self.steps += 1
        return out


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """Everything a simulation needs besides the workload and the policy."""

    model: str = "llama-7b"
    """Model preset (see `serve_jax.model_config.PRESETS`), priced at its dtype."""
    dtype: str | None = None
    """Parameter dtype of the model (None: the preset's, bfloat16 for the Llama shapes)."""
    hardware: str = "h100"
    """Hardware profile (see `tapas_jax.hardware.PROFILES`)."""
    kv_memory_gb: float | None = 8.0
    """Device memory for the KV cache (1e9 bytes); None: HBM left after the weights."""
    host_memory_gb: float = 64.0
    """Host memory for offloaded KV (0 disables offload)."""
    block_size: int = 16
    """Tokens per KV block."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    max_num_batched_tokens: int = 4096
    """Token budget per step (chunked prefill)."""
    cascade_window_s: float = 1.0
    """A preemption within this many seconds of the request's last resume is a cascade."""
    slo_ttft_ms: float = 10000.0
    """TTFT objective for goodput, ms."""
    slo_tpot_ms: float = 100.0
    """TPOT objective for goodput, ms."""
    no_admission_after_preemption: bool = False
    """vLLM V1's rule: a step that preempted admits no waiting request (see `GatedScheduler`)."""
    finish_by: str = "stop_token"
    """``stop_token`` (default) or ``max_tokens`` (engine replay convention)."""
    max_steps: int = 50_000_000
    """Safety limit on engine steps."""
    num_device_blocks: int | None = None
    """Device KV blocks, overriding the capacity computed from ``kv_memory_gb``."""
    num_host_blocks: int | None = None
    """Host KV blocks, overriding ``host_memory_gb``."""
    max_model_len: int | None = None
    """Longest prompt + output (default: all device blocks), as the engine's model limit."""

    def model_config(self) -> ModelConfig:
        """The simulated model's shapes (the preset at ``dtype``)."""
        return get_model_config(self.model, **({"dtype": self.dtype} if self.dtype else {}))

    def cost_model(self) -> RooflineCostModel:
        """The roofline cost model of this configuration."""
        return RooflineCostModel.create(
            self.model_config(), self.hardware, block_size=self.block_size
        )


@dataclasses.dataclass
class SimulationResult:
    """Metrics of one simulated run (``row()`` is the JSON row of the `simulate` command)."""

    policy: str
    workload: str
    submitted: int
    completed: int
    preemptions: int
    offload_preemptions: int
    cascades: int
    back_to_back_steps: int
    wasted_recompute_tokens: int
    bytes_offloaded: float
    bytes_restored: float
    makespan_s: float
    output_tokens: int
    steps: int
    wall_seconds: float
    summary: dict[str, Any]
    """`serve_jax.metrics.summarize` of the finished requests over the makespan (ms)."""
    tpots_ms: np.ndarray
    """TPOT of each finished request with more than one token, ms."""
    preemption_times: np.ndarray
    preemptions_per_request_max: int
    preempted_requests: int
    goodput_req_s: float
    slo_attainment: float
    device_blocks: int
    predictor_error: dict[str, float] | None = None
    preemption_log: list[tuple[int, float, str, str]] = dataclasses.field(default_factory=list)
    """(step, time of the step's schedule, request id, mode) of every preemption, in order."""
    step_seconds: list[float] = dataclasses.field(default_factory=list)

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def row(self) -> dict[str, Any]:
        """The JSON row: the issue's keys first, then the other metrics."""
        row: dict[str, Any] = {
            "policy": self.policy,
            "preemptions": self.preemptions,
            "cascades": self.cascades,
            "p99_tpot_ms": self.summary["tpot_ms"]["p99"],
            "p99_ttft_ms": self.summary["ttft_ms"]["p99"],
            "throughput_tok_s": self.throughput_tok_s,
            "completed": self.completed,
            "submitted": self.submitted,
            "workload": self.workload,
            "offload_preemptions": self.offload_preemptions,
            "preempted_requests": self.preempted_requests,
            "max_preemptions_per_request": self.preemptions_per_request_max,
            "preemptions_per_request": self.preemptions / max(self.submitted, 1),
            "back_to_back_preemption_steps": self.back_to_back_steps,
            "wasted_recompute_tokens": self.wasted_recompute_tokens,
            "bytes_offloaded": self.bytes_offloaded,
            "bytes_restored": self.bytes_restored,
            "goodput_req_s": self.goodput_req_s,
            "slo_attainment": self.slo_attainment,
            "makespan_s": self.makespan_s,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "device_blocks": self.device_blocks,
            "sim_wall_s": self.wall_seconds,
        }
        row.update({k: self.summary[k] for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")})
        if self.predictor_error is not None:
            row["predictor"] = self.predictor_error
        return row


def simulate(
    workload: Workload,
    policy: str | VictimPolicy,
    config: SimConfig = SimConfig(),
    *,
    step_times: Sequence[float] | None = None,
    on_step: Callable[[int, float, SchedulerOutput], None] | None = None,
    costs: Any = None,
    cost_observations: Sequence[tuple] | None = None,
) -> SimulationResult:
    """Runs ``workload`` under ``policy`` with the real scheduler and a simulated executor.

    Args:
      workload: requests to replay (closed-loop turns follow their parents).
      policy: a policy name (`serve_jax.preemption.get_policy`) or instance.
      config: model, chip, memory sizes, scheduler limits and metric settings.
      step_times: replay these step durations instead of the roofline (engine agreement).
      on_step: called after every step with (step, now, scheduler output).
      costs: cost hints the policy sees instead of the roofline (e.g. a copy of the engine's
        `MeasuredCostHints` as it was before a replay).
      cost_observations: arguments of ``costs.observe`` after each executed step, replayed in
        order (the engine fits its cost hints online; this keeps the policy's view identical).

    Returns:
      A `SimulationResult`.

    Raises:
      ValueError: a request that cannot fit the device at all, or a bad configuration.
      RuntimeError: the simulation stalls (no progress possible) or passes ``max_steps``.
    """
    if config.finish_by not in ("stop_token", "max_tokens"):
        raise ValueError(
            f"finish_by must be 'stop_token' or 'max_tokens', got {config.finish_by!r}"
        )
    wall0 = time.perf_counter()
    pol = get_policy(policy) if isinstance(policy, str) else policy
    roofline = config.cost_model()
    num_blocks = config.num_device_blocks or roofline.kv_capacity_blocks(config.kv_memory_gb)
    host_blocks = config.num_host_blocks
    if host_blocks is None:
        host_blocks = int(config.host_memory_gb * 1e9 // roofline.block_bytes)
    sched = Scheduler(
        num_device_blocks=num_blocks,
        num_host_blocks=host_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        policy=pol,
        costs=costs if costs is not None else roofline,
        no_admission_after_preemption=config.no_admission_after_preemption,
        max_model_len=config.max_model_len,
    )
    capacity = sched.max_model_len
    specs = {r.request_id: r for r in workload.requests}
    children: dict[str, list[RequestSpec]] = {}
    arrivals: list[tuple[float, int, str]] = []
    for i, r in enumerate(workload.requests):
        if r.prompt_len + 1 > capacity:
            raise ValueError(
                f"request {r.request_id!r}: prompt of {r.prompt_len} tokens cannot fit "
                f"{num_blocks} blocks of {config.block_size} tokens"
            )
        if r.parent_id is not None and r.parent_id in specs:
            children.setdefault(r.parent_id, []).append(r)
        else:
            arrivals.append((r.arrival_time, i, r.request_id))
    heapq.heapify(arrivals)
    order = {r.request_id: i for i, r in enumerate(workload.requests)}
    output_lens = {
        r.request_id: min(r.output_len, capacity - r.prompt_len) for r in workload.requests
    }
    executor = SimulatedExecutor(
        roofline, output_lens, emit_stop=config.finish_by == "stop_token", step_times=step_times
    )
    reqs: dict[str, Request] = {}
    tally = _Tally(num_blocks=num_blocks)
    block_bytes = roofline.block_bytes
    now = 0.0
    step = 0
    prev_step_preempted = False
    idle_steps = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= now:
            t, _, rid = heapq.heappop(arrivals)
            spec = specs[rid]
            limit = capacity - spec.prompt_len
            max_tokens = output_lens[rid] if config.finish_by == "max_tokens" else limit
            req = SimRequest(
                request_id=rid,
                prompt_token_ids=[_TOKEN] * spec.prompt_len,
                max_tokens=max_tokens,
                arrival_time=t,
                stop_token_ids=frozenset({STOP_TOKEN}),
            )
            reqs[rid] = req
            sched.add_request(req)
        if not sched.has_unfinished():
            now = max(now, arrivals[0][0])
            executor.set_time(now)
            continue
        t_sched = now
        so = sched.schedule(now)
        if so.is_empty and executor.next_copy_completion is None:
            # Nothing can run until a new request arrives (e.g. everything waits on the gate).
            idle_steps += 1
            if not arrivals or idle_steps > 3:
                raise RuntimeError(
                    f"simulation stalled at t={now:.3f}s: {sched.stats()} (policy {pol.name})"
                )
            now = max(now, arrivals[0][0])
            executor.set_time(now)
            continue
        idle_steps = 0
        res = executor.execute(so)
        now = executor.now
        tally.step_seconds.append(float(res.step_seconds or 0.0))
        if so.preemptions:
            if prev_step_preempted:
                tally.back_to_back += 1
            for rid, mode in so.preemptions:
                tally.preempt_times.append(t_sched)
                tally.preempt_log.append((step, t_sched, rid, mode.value))
                if mode == PreemptMode.RECOMPUTE:
                    tally.wasted += sched.preempted_computed_tokens[rid]
        prev_step_preempted = bool(so.preemptions)
        if so.offloads:
            tally.bytes_off += len(so.offloads) * block_bytes
        if so.restores:
            tally.bytes_res += len(so.restores) * block_bytes
        if cost_observations is not None and cost_observations[step] is not None:
            costs.observe(*cost_observations[step])
        events = sched.update_from_output(so, res, now)
        for ev in events:
            if not ev.finished:
                continue
            # Keep only the counts of a finished request's tokens (memory of long traces).
            done = reqs[ev.request_id]
            done.prompt_token_ids = _ConstTokens(done.num_prompt_tokens)  # type: ignore[assignment]
            done.output_token_ids = _ConstTokens(done.num_output_tokens)  # type: ignore[assignment]
            if ev.request_id in children:
                for child in children.pop(ev.request_id):
                    t = now + child.think_time
                    heapq.heappush(arrivals, (t, order[child.request_id], child.request_id))
        if on_step is not None:
            on_step(step, now, so)
        step += 1
        if step > config.max_steps:
            raise RuntimeError(f"simulation passed max_steps={config.max_steps}")
    sched.blocks.assert_all_free()  # nothing leaked: every block back, every copy landed
    tally.steps = step
    tally.wall = time.perf_counter() - wall0
    return _result(pol, workload, reqs, sched, config, tally)


@dataclasses.dataclass
class _Tally:
    """Counters the simulation loop accumulates."""

    num_blocks: int
    back_to_back: int = 0
    wasted: int = 0
    bytes_off: float = 0.0
    bytes_res: float = 0.0
    steps: int = 0
    wall: float = 0.0
    preempt_times: list[float] = dataclasses.field(default_factory=list)
    preempt_log: list[tuple[int, float, str, str]] = dataclasses.field(default_factory=list)
    step_seconds: list[float] = dataclasses.field(default_factory=list)


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


def _result(pol, workload, reqs, sched, config: SimConfig, tally: _Tally) -> SimulationResult:
    ok = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
    completed = [r for r in reqs.values() if r.status in ok]
    cascades = count_cascades(list(reqs.values()), config.cascade_window_s)
    t0 = min((r.arrival_time for r in reqs.values()), default=0.0)
    t1 = max((r.finish_time or 0.0 for r in reqs.values()), default=0.0)
    makespan = max(t1 - t0, 0.0)
    records = [record_from(r) for r in completed]
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    summary = summarize(records, makespan if makespan > 0 else None, slo)
    per_req = [r.num_preemptions for r in reqs.values()]
    pred_err = pol.log.summary() if hasattr(pol, "log") else None
    return SimulationResult(
        policy=pol.name,
        workload=workload.name,
        submitted=len(workload.requests),
        completed=len(completed),
        preemptions=sched.num_preemptions,
        offload_preemptions=sched.num_offload_preemptions,
        cascades=cascades,
        back_to_back_steps=tally.back_to_back,
        wasted_recompute_tokens=tally.wasted,
        bytes_offloaded=tally.bytes_off,
        bytes_restored=tally.bytes_res,
        makespan_s=makespan,
        output_tokens=sum(r.num_output_tokens for r in completed),
        steps=tally.steps,
        wall_seconds=tally.wall,
        summary=summary,
        tpots_ms=request_latencies(records)["tpot"],
        preemption_times=np.asarray(tally.preempt_times, dtype=np.float64),
        preemptions_per_request_max=max(per_req, default=0),
        preempted_requests=sum(1 for x in per_req if x > 0),
        goodput_req_s=summary["goodput"] if makespan > 0 else 0.0,
        slo_attainment=summary["slo_met"] / max(len(workload.requests), 1),
        device_blocks=tally.num_blocks,
        predictor_error=pred_err,
        preemption_log=tally.preempt_log,
        step_seconds=tally.step_seconds,
    )


# -- checking the simulator against the real engine ------------------------------------------


class StepClock:
    """A clock that only moves when told: the engine sees one time per step.

    `replay_on_engine` advances it by each step's measured wall time, so the engine's timeline
    (schedule times, arrivals admitted before each step) is exactly reproducible from the list of
    step times, which is what the simulator replays.
    """

    def __init__(self, t: float = 0.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


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
    engine_config: Any,
    workload: Workload,
    policy: str | VictimPolicy,
    *,
    seed: int = 0,
    max_steps: int = 1_000_000,
) -> EngineReplay:
    """Runs ``workload`` on the real `serve_jax.engine.Engine` with a step-synchronous clock.

    Prompts are random token ids of the trace's lengths; outputs are forced to the trace's
    lengths (``max_tokens``, ``ignore_eos``). Requests arriving by the engine's time are added
    before each step; the clock then advances by the step's measured wall time.

    Args:
      engine_config: a `serve_jax.config.EngineConfig`.
      workload: open-loop requests (no follow-up turns).
      policy: a policy name or instance.
      seed: seed of the random prompts.
      max_steps: safety limit.

    Raises:
      ValueError: a closed-loop workload.
      RuntimeError: the engine stops making progress.
    """
    from serve_jax.engine import Engine
    from serve_jax.sampling import SamplingParams

    if any(r.parent_id for r in workload.requests):
        raise ValueError("replay_on_engine takes open-loop workloads (no follow-up turns)")
    pol = get_policy(policy) if isinstance(policy, str) else policy
    clock = StepClock()
    engine = Engine(engine_config, policy=pol, clock=clock)
    initial_costs = copy.deepcopy(engine.costs)
    observations: list[tuple] = []
    observe = engine.costs.observe

    def recording_observe(*args: Any) -> None:
        observations.append(args)
        observe(*args)

    engine.costs.observe = recording_observe  # record what the engine fits its costs on
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed)
    pending = sorted(workload.requests, key=lambda r: r.arrival_time)
    reqs: list[Request] = []
    steps: list[float] = []
    starts: list[float] = []
    i = 0
    while i < len(pending) or engine.has_unfinished():
        while i < len(pending) and pending[i].arrival_time <= clock.t:
            spec = pending[i]
            ids = rng.integers(1, vocab, size=spec.prompt_len).tolist()
            params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True)
            engine.add_request(ids, params, request_id=spec.request_id, arrival_time=clock.t)
            reqs.append(engine.scheduler.requests[spec.request_id])
            i += 1
        if not engine.has_unfinished():
            clock.t = max(clock.t, pending[i].arrival_time)
            continue
        before = engine.num_steps
        starts.append(clock.t)
        t0 = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t0
        if engine.num_steps == before:
            raise RuntimeError(f"engine made no progress at t={clock.t:.4f}s")
        if len(observations) != engine.num_steps:
            observations.append(None)  # the engine had no step time to fit on
        steps.append(dt)
        clock.t += dt
        if len(steps) > max_steps:
            raise RuntimeError(f"engine replay passed max_steps={max_steps}")
    events = sorted((t, r.request_id) for r in reqs for t in r.preemption_times)
    # The engine saw one clock value per step (its start); a token sampled in a step exists at
    # the step's end, so token and finish times move there for latency metrics.
    end_of = {t: t + dt for t, dt in zip(starts, steps)}
    for r in reqs:
        r.token_times = [end_of.get(x, x) for x in r.token_times]
        if r.first_token_time is not None:
            r.first_token_time = end_of.get(r.first_token_time, r.first_token_time)
        if r.finish_time is not None:
            r.finish_time = end_of.get(r.finish_time, r.finish_time)
    return EngineReplay(
        steps,
        events,
        reqs,
        engine.scheduler.num_offload_preemptions,
        initial_costs,
        observations,
    )


def simulator_config_for_engine(engine_config: Any, **overrides: Any) -> SimConfig:
    """The `SimConfig` of an engine config: its model (priced at its dtype), blocks, limits."""
    cc, sc, mc = engine_config.cache, engine_config.scheduler, engine_config.model
    kw = {"max_seq_len": mc.max_seq_len} if mc.max_seq_len else {}
    max_len = get_model_config(mc.preset, **kw).max_seq_len
    base = dict(
        model=mc.preset,
        dtype=mc.dtype,
        block_size=cc.block_size,
        num_device_blocks=cc.num_device_blocks,
        num_host_blocks=cc.num_host_blocks,
        max_num_seqs=sc.max_num_seqs,
        max_num_batched_tokens=sc.max_num_batched_tokens,
        max_model_len=max_len,
        finish_by="max_tokens",
    )
    base.update(overrides)
    return SimConfig(**base)
