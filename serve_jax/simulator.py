"""Trace-driven serving simulator: the real scheduler and policies, in simulated time.

The simulator is `serve_jax.core.EngineCore` (the engine's own loop) with three parts plugged in:

* `serve_jax.sim_executor.SimulatedExecutor`: the executor, whose step durations come from the
  roofline cost model of a `serve_jax.model_config.ModelConfig` on a chip (or from a list of
  step times measured on the real engine), and whose clock is the simulation's time;
* `ArrivalFeeder`: adds each workload request when simulated time reaches its arrival; a
  follow-up turn of a multi-turn workload arrives ``think_time`` after its parent finishes
  (closed loop);
* `serve_jax.sim_metrics.SimMetrics`: an observer counting preemptions, cascades' ingredients,
  recomputed tokens wasted, bytes offloaded and restored, and step times.

Requests stop the way the engine stops them: by default the executor samples a stop token when a
request reaches its workload output length and ``max_tokens`` is only the context limit, so no
policy or predictor can read a request's true length from ``max_tokens``. (With
``finish_by="max_tokens"``, the engine-replay convention, ``max_tokens`` is the output length.)

`simulate` runs one workload under one policy and returns a `SimulationResult` with the metrics
of the issue: preemptions (total, per request, over time), cascades (a request preempted again
within ``cascade_window_s`` of being resumed; steps with preemptions right after a step with
preemptions), recomputed tokens wasted, bytes offloaded and restored, latency statistics
(`serve_jax.metrics`), goodput under SLOs and throughput. `serve_jax.crosscheck` checks it
against the real engine. This module imports no JAX and not the engine.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from serve_jax.core import EngineCore, StepObserver, StepOutput
from serve_jax.costmodel import RooflineCostModel
from serve_jax.metrics import Slo, record_from, request_latencies, summarize
from serve_jax.model_config import ModelConfig, get_model_config
from serve_jax.preemption import get_policy
from serve_jax.scheduler import (
    Request,
    RequestStatus,
    Scheduler,
    VictimPolicy,
)
from serve_jax.sim_executor import STOP_TOKEN, TOKEN, SimulatedExecutor, compact_tokens
from serve_jax.sim_metrics import SimMetrics, count_cascades
from serve_jax.sim_runs import run_quiet_decodes
from serve_jax.workloads import RequestSpec, Workload

__all__ = [
    "SimConfig",
    "SimulationResult",
    "ArrivalFeeder",
    "simulate",
    "simulator_config_for_engine",
]


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
    no_admission_after_preemption: bool = True
    """vLLM V1's rule: a step that preempted admits no waiting request (a `Scheduler` option,
    on for every policy)."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching in the block manager (`serve_jax.kv_blocks`), as the engine's
    ``cache.enable_prefix_caching``."""
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
    host_prefix_caching: bool = False
    """The host pool as a second prefix-cache level (`serve_jax.kv_blocks`): freed cached
    blocks are demoted to host memory and promoted back instead of recomputed."""
    host_retention: str = "predicted"
    """Which freed blocks the host cache level keeps (`serve_jax.host_retention`):
    ``predicted`` (those an online reuse estimate expects back) or ``all``."""
    decode_runs: bool = True
    """Apply runs of quiet decode steps at once (`serve_jax.sim_runs`; the same results, much
    faster); off, every step goes through `EngineCore.step`. Runs are only used without extra
    observers, replayed step times or replayed cost observations."""

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
    rejected: int
    """Requests refused at arrival because they could never fit (`Scheduler.admission_error`)."""
    prefix_hit_rate: float
    """Prompt and context tokens found in the prefix cache over those looked up at admission."""
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
    restore_cache_hit_blocks: int = 0
    """Blocks of restored requests found cached on the device (shared, not copied back)."""
    host_hit_rate: float = 0.0
    """Of the looked-up tokens, those found in the host cache (promoted, not computed)."""
    demoted_blocks: int = 0
    """Cached blocks copied to the host cache when freed (host-tier caching)."""
    admission_prefill_tokens: int = 0
    """Tokens the admissions had to compute: looked up in the prefix cache and not found (0
    with prefix caching off, where nothing is looked up)."""
    decode_run_steps: int = 0
    """Steps applied in runs of quiet decodes (`serve_jax.sim_runs`; not a result, a speed)."""
    start_s: float = 0.0
    """Simulated time of the first arrival: ``makespan_s`` counts from here, while
    ``preemption_times`` are absolute (the run ends at ``start_s + makespan_s``)."""

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
            "rejected": self.rejected,
            "prefix_hit_rate": self.prefix_hit_rate,
            "workload": self.workload,
            "offload_preemptions": self.offload_preemptions,
            "preempted_requests": self.preempted_requests,
            "max_preemptions_per_request": self.preemptions_per_request_max,
            "preemptions_per_request": self.preemptions / max(self.submitted, 1),
            "back_to_back_preemption_steps": self.back_to_back_steps,
            "wasted_recompute_tokens": self.wasted_recompute_tokens,
            "bytes_offloaded": self.bytes_offloaded,
            "bytes_restored": self.bytes_restored,
            "restore_cache_hit_blocks": self.restore_cache_hit_blocks,
            "prefix_hit_rate_host": self.host_hit_rate,
            "demoted_blocks": self.demoted_blocks,
            "admission_prefill_tokens": self.admission_prefill_tokens,
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


class ArrivalFeeder:
    """Adds a workload's requests to an `EngineCore` as simulated time reaches their arrivals.

    Follow-up turns (``parent_id``) are queued when their parent finishes, ``think_time`` later;
    call the feeder as a `StepObserver` for that. Finished requests keep only their token counts.
    A request the scheduler refuses (`Scheduler.admission_error`: it could never fit) is counted
    in ``rejected`` with its reason, and its follow-up turns arrive as if it had finished.

    Args:
      workload: the requests.
      core: where requests go.
      make_request: builds the scheduler request of a spec arriving at a time.
    """

    def __init__(self, workload: Workload, core: EngineCore, make_request):
        self.core = core
        self.make_request = make_request
        self.specs = {r.request_id: r for r in workload.requests}
        self.order = {r.request_id: i for i, r in enumerate(workload.requests)}
        self.children: dict[str, list[RequestSpec]] = {}
        self.arrivals: list[tuple[float, int, str]] = []
        for i, r in enumerate(workload.requests):
            if r.parent_id is not None and r.parent_id in self.specs:
                self.children.setdefault(r.parent_id, []).append(r)
            else:
                self.arrivals.append((r.arrival_time, i, r.request_id))
        heapq.heapify(self.arrivals)
        self.requests: dict[str, Request] = {}
        self.rejected: dict[str, str] = {}
        """Reason of each refused request."""

    @property
    def next_arrival(self) -> float | None:
        """When the next queued request arrives (None: none is queued)."""
        return self.arrivals[0][0] if self.arrivals else None

    def feed(self, now: float) -> None:
        """Adds every request arriving by ``now``."""
        arrivals = self.arrivals
        scheduler = self.core.scheduler
        while arrivals and arrivals[0][0] <= now:
            t, _, rid = heapq.heappop(arrivals)
            req = self.make_request(self.specs[rid], t)
            error = scheduler.admission_error(req.num_prompt_tokens)
            if error is not None:
                self.rejected[rid] = error
                self._release_children(rid, t)
                continue
            self.requests[rid] = req
            self.core.add_request(req)

    def _release_children(self, rid: str, t: float) -> None:
        for child in self.children.pop(rid, ()):
            cid = child.request_id
            heapq.heappush(self.arrivals, (t + child.think_time, self.order[cid], cid))

    def finished(self, rid: str, t: float) -> None:
        """``rid`` finished at ``t``: keeps its token counts only and queues its follow-ups."""
        compact_tokens(self.requests[rid])
        self._release_children(rid, t)

    def __call__(self, out: StepOutput) -> None:
        for ev in out.events:
            if ev.finished:
                self.finished(ev.request_id, out.finished_at)


def simulate(
    workload: Workload,
    policy: str | VictimPolicy,
    config: SimConfig = SimConfig(),
    *,
    step_times: Sequence[float] | None = None,
    observers: Sequence[StepObserver] = (),
    costs: Any = None,
    cost_observations: Sequence[tuple | None] | None = None,
    progress: Callable[[float], None] | None = None,
) -> SimulationResult:
    """Runs ``workload`` under ``policy`` with the real scheduler and a simulated executor.

    Args:
      workload: requests to replay (closed-loop turns follow their parents).
      policy: a policy name (`serve_jax.preemption.get_policy`) or instance.
      config: model, chip, memory sizes, scheduler limits and metric settings.
      step_times: replay these step durations instead of the roofline (engine agreement).
      observers: more `StepObserver` s, called after every step (after the simulator's own).
      progress: called with the simulated time (s) before every step or run of steps (a
        progress bar; unlike an observer it keeps runs of quiet decodes on).
      costs: cost hints the policy sees instead of the roofline (e.g. a copy of the engine's
        `MeasuredCostHints` as it was before a replay).
      cost_observations: arguments of ``costs.observe`` after each executed step, replayed in
        order (the engine fits its cost hints online; this keeps the policy's view identical).

    Returns:
      A `SimulationResult`.

    Requests that can never fit (prompt plus one token beyond the device pool or the model's
    context) are refused at arrival and counted in ``SimulationResult.rejected``.

    Raises:
      ValueError: a bad configuration.
      RuntimeError: the simulation stalls (a scheduler bug: nothing runnable, nothing to come)
        or passes ``max_steps``.
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
        enable_prefix_caching=config.enable_prefix_caching,
        block_hash="builtin",  # (placeholder tokens, no adversary: the cheap key)
        host_prefix_caching=config.host_prefix_caching,
        host_retention=config.host_retention,
    )
    capacity = sched.max_model_len
    output_lens = {
        r.request_id: max(min(r.output_len, capacity - r.prompt_len), 1) for r in workload.requests
    }
    by_max_tokens = config.finish_by == "max_tokens"
    sessions = _session_roots(workload)

    def make_request(spec: RequestSpec, t: float) -> Request:
        # Placeholder tokens; the salt (the session's first turn) makes a turn's context match
        # the cached context of the turns before it, and nothing else.
        return Request(
            request_id=spec.request_id,
            prompt_token_ids=(TOKEN,) * spec.prompt_len,  # type: ignore[arg-type]
            max_tokens=output_lens[spec.request_id]
            if by_max_tokens
            else max(capacity - spec.prompt_len, 1),
            arrival_time=t,
            stop_token_ids=frozenset({STOP_TOKEN}),
            cache_salt=sessions[spec.request_id],
        )

    executor = SimulatedExecutor(
        roofline, output_lens, emit_stop=not by_max_tokens, step_times=step_times
    )
    tally = SimMetrics(sched, roofline.block_bytes, num_blocks)
    core = EngineCore(sched, executor, executor.clock, [tally])
    if cost_observations is not None:

        def replay_fit(out: StepOutput) -> None:
            if cost_observations[out.step] is not None:
                costs.observe(*cost_observations[out.step])

        core.add_observer(replay_fit)
    feeder = ArrivalFeeder(workload, core, make_request)
    core.add_observer(feeder)
    for observer in observers:
        core.add_observer(observer)
    runs = config.decode_runs and not observers and step_times is None and cost_observations is None
    idle_steps = 0
    while feeder.arrivals or sched.has_work():
        if progress is not None:
            progress(executor.now)
        feeder.feed(executor.now)
        if not sched.has_work():  # (demotions may still be copying after the last finish)
            if feeder.arrivals:  # (everything fed so far may have been refused)
                executor.set_time(feeder.next_arrival)
            continue
        if runs:
            applied, finished = run_quiet_decodes(
                core, executor, tally, feeder.next_arrival, config.max_steps - core.num_steps
            )
            if applied:
                for rid in finished:  # (what the feeder does with the step's finish events)
                    feeder.finished(rid, executor.now)
                continue
        if core.step() is None:
            # Nothing can run until a new request arrives (e.g. everything waits on the gate).
            idle_steps += 1
            if not feeder.arrivals or idle_steps > 3:
                raise RuntimeError(
                    f"simulation stalled at t={executor.now:.3f}s: {sched.stats()} "
                    f"(policy {pol.name})"
                )
            executor.set_time(feeder.next_arrival)
            continue
        idle_steps = 0
        if core.num_steps > config.max_steps:
            raise RuntimeError(f"simulation passed max_steps={config.max_steps}")
    sched.blocks.assert_all_free()  # nothing leaked: every block back, every copy landed
    tally.steps = core.num_steps
    tally.wall = time.perf_counter() - wall0
    return _result(pol, workload, feeder, sched, config, tally)


def _session_roots(workload: Workload) -> dict[str, str]:
    """The first turn of each request's session (the request itself when it has no parent)."""
    parent = {r.request_id: r.parent_id for r in workload.requests}
    roots: dict[str, str] = {}
    for rid in parent:
        chain = []
        node = rid
        while node not in roots and parent.get(node) is not None and parent[node] in parent:
            chain.append(node)
            node = parent[node]
        root = roots.get(node, node)
        for n in chain:
            roots[n] = root
        roots[node] = root
    return roots


def _result(pol, workload, feeder, sched, config: SimConfig, tally: SimMetrics) -> SimulationResult:
    reqs = feeder.requests
    ok = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
    completed = [r for r in reqs.values() if r.status in ok]
    cascades = count_cascades(list(reqs.values()), config.cascade_window_s)
    t0 = min((r.arrival_time for r in reqs.values()), default=0.0)
    t1 = max((r.finish_time or 0.0 for r in reqs.values()), default=0.0)
    makespan = max(t1 - t0, 0.0)
    records = [record_from(r) for r in completed]
    slo = Slo(config.slo_ttft_ms, config.slo_tpot_ms)
    latencies = request_latencies(records)
    summary = summarize(records, makespan if makespan > 0 else None, slo, latencies)
    per_req = [r.num_preemptions for r in reqs.values()]
    pred_err = pol.log.summary() if hasattr(pol, "log") else None
    blocks = sched.blocks
    return SimulationResult(
        policy=pol.name,
        workload=workload.name,
        submitted=len(workload.requests),
        completed=len(completed),
        rejected=len(feeder.rejected),
        prefix_hit_rate=sched.blocks.prefix_hit_rate,
        preemptions=sched.num_preemptions,
        offload_preemptions=sched.num_offload_preemptions,
        cascades=cascades,
        back_to_back_steps=tally.back_to_back,
        wasted_recompute_tokens=tally.wasted,
        bytes_offloaded=tally.bytes_off,
        bytes_restored=tally.bytes_res,
        makespan_s=makespan,
        start_s=t0,
        output_tokens=sum(r.num_output_tokens for r in completed),
        steps=tally.steps,
        wall_seconds=tally.wall,
        summary=summary,
        tpots_ms=latencies["tpot"],
        preemption_times=np.asarray(tally.preempt_times, dtype=np.float64),
        preemptions_per_request_max=max(per_req, default=0),
        preempted_requests=sum(1 for x in per_req if x > 0),
        goodput_req_s=summary["goodput"] if makespan > 0 else 0.0,
        slo_attainment=summary["slo_met"] / max(len(workload.requests), 1),
        device_blocks=tally.num_blocks,
        predictor_error=pred_err,
        preemption_log=tally.preempt_log,
        step_seconds=tally.step_seconds,
        restore_cache_hit_blocks=sched.blocks.restore_hit_blocks,
        decode_run_steps=tally.run_steps,
        host_hit_rate=blocks.host_hits / blocks.prefix_queries if blocks.prefix_queries else 0.0,
        demoted_blocks=blocks.demoted_blocks,
        admission_prefill_tokens=blocks.prefix_queries - blocks.prefix_hits,
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
        enable_prefix_caching=cc.enable_prefix_caching,
        host_prefix_caching=cc.host_prefix_caching,
        host_retention=cc.host_retention,
    )
    base.update(overrides)
    return SimConfig(**base)
