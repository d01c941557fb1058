"""Continuous-batching scheduler with chunked prefill and policy-driven preemption (pure Python).

This module is a contract shared by the real JAX engine and the trace-driven simulator, so it
imports no JAX and never reads a clock: time is passed in (``schedule(now)``,
``update_from_output(out, now)``), which lets a simulator drive it with simulated time.

One engine step (vLLM v1 style)::

    out = scheduler.schedule(now)                 # SchedulerOutput: plain data
    result = executor.execute(out)                # ExecutorOutput: sampled tokens, finished copies
    events = scheduler.update_from_output(result, now)

`schedule`:

1. Running requests (in admission order) get tokens under the per-step token budget: one for a
   decoding request, a chunk of the remaining prompt for one still prefilling (chunked prefill).
2. If their new tokens need more device blocks than are free, the `VictimPolicy` is asked for
   victims (``select_victims(view)``) with `PreemptMode` per victim; the scheduler applies them
   and asks again while the shortfall remains. RECOMPUTE frees the victim's blocks and requeues it
   at the FRONT of the waiting queue with ``num_computed_tokens = 0``; OFFLOAD moves its pages to
   host blocks (``SchedulerOutput.offloads``) and parks it in the offloaded queue. An OFFLOAD
   choice falls back to RECOMPUTE when the host pool cannot hold the victim.
   Blocks being offloaded stay in flight (unusable) until the executor reports the copy
   complete; they count towards the shortfall, and a running request that still cannot get its
   blocks this step sits the step out (it keeps its place and its pages).
   If the policy returns no victim, requests that do not fit sit the step out.
3. Offloaded requests are restored (``SchedulerOutput.restores``) in preemption order when their
   blocks fit, and resume right away in the same step.
4. Waiting requests are admitted FCFS while there are sequence slots, token budget and free
   device blocks for their first chunk; admission never preempts.

`update_from_output` advances ``num_computed_tokens``, appends sampled tokens, finishes requests
at ``max_tokens`` or a stop token, releases blocks whose copies completed, and calls the policy
hooks. The engine finishes requests for other reasons (stop strings, aborts) with
`Scheduler.finish_request`.

Every field a policy may read is on `Request` and `SchedulerView`; policies may keep their own
per-request state in ``Request.predictor_state``.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import deque
from collections.abc import Sequence
from typing import Any, Protocol

from serve_jax.kv_blocks import KVBlockManager

__all__ = [
    "RequestStatus",
    "PreemptMode",
    "Request",
    "CostHints",
    "LinearCostHints",
    "SchedulerView",
    "VictimPolicy",
    "FcfsLastPolicy",
    "ScheduledChunk",
    "SchedulerOutput",
    "ExecutorOutput",
    "Executor",
    "RequestEvent",
    "Scheduler",
]


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    """Queued, never run (or nothing computed yet)."""
    RUNNING = "running"
    """Holds device blocks and gets tokens each step."""
    PREEMPTED = "preempted"
    """Preempted by recompute: back in the waiting queue, its KV to be recomputed."""
    OFFLOADED = "offloaded"
    """Preempted by offload: its pages are in host blocks, restored before it runs again."""
    FINISHED_STOPPED = "finished_stopped"
    """Ended on a stop token or stop string."""
    FINISHED_LENGTH = "finished_length"
    """Ended at max_tokens (or the context limit)."""
    FINISHED_ABORTED = "finished_aborted"
    """Aborted by the client or the engine."""

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class PreemptMode(enum.Enum):
    """How a victim gives back its device blocks."""

    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request as the scheduler sees it (no text, no tensors)."""

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    stop_token_ids: frozenset[int] = frozenset()
    """Sampling one of these ends the request (FINISHED_STOPPED); the token is kept."""
    sampling: Any = None
    """Opaque sampling parameters, passed to the executor with each chunk."""
    output_token_ids: list[int] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (device, or host when offloaded)."""
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    admission_seq: int = -1
    """Increases with every admission to the running set (re-admissions get a new one)."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    """When each output token was produced (``now`` of its update_from_output)."""
    preemption_times: list[float] = dataclasses.field(default_factory=list)
    resume_times: list[float] = dataclasses.field(default_factory=list)
    finish_time: float | None = None
    predictor_state: Any = None
    """Free for policies and predictors."""

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_tokens must be >= 1")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_preempted_time(self) -> float | None:
        return self.preemption_times[-1] if self.preemption_times else None

    @property
    def last_resumed_time(self) -> float | None:
        return self.resume_times[-1] if self.resume_times else None


class CostHints:
    """Predicted costs a policy may weigh (the engine fits them; the simulator uses a roofline)."""

    def prefill_seconds(self, num_tokens: int) -> float:
        """Time to (re)compute the KV of ``num_tokens`` tokens."""
        raise NotImplementedError

    def transfer_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` blocks one way over the host link."""
        raise NotImplementedError

    def decode_seconds(self, batch_size: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch_size`` requests holding ``context_tokens`` in all."""
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class LinearCostHints(CostHints):
    """Affine costs: a fixed part plus a per-token (or per-block) part."""

    prefill_base: float = 1e-3
    prefill_per_token: float = 1e-5
    transfer_base: float = 1e-4
    transfer_per_block: float = 1e-5
    decode_base: float = 1e-3
    decode_per_seq: float = 1e-4
    decode_per_context_token: float = 1e-7

    def prefill_seconds(self, num_tokens: int) -> float:
        return self.prefill_base + self.prefill_per_token * num_tokens

    def transfer_seconds(self, num_blocks: int) -> float:
        return self.transfer_base + self.transfer_per_block * num_blocks

    def decode_seconds(self, batch_size: int, context_tokens: int) -> float:
        return (
            self.decode_base
            + self.decode_per_seq * batch_size
            + self.decode_per_context_token * context_tokens
        )


@dataclasses.dataclass(frozen=True)
class SchedulerView:
    """What a victim policy sees when the running set needs more device blocks than are free."""

    step: int
    now: float
    block_size: int
    free_device_blocks: int
    free_host_blocks: int
    blocks_needed: int
    """Shortfall: device blocks still missing for this step's running requests."""
    running: tuple[Request, ...]
    """Running requests in admission order (oldest first)."""
    waiting: tuple[Request, ...]
    offloaded: tuple[Request, ...]
    costs: CostHints
    device_blocks_held: dict[str, int] = dataclasses.field(default_factory=dict)
    """Device blocks held by each running request (what preempting it gives back)."""


class VictimPolicy:
    """Chooses which running requests to preempt, and how. Subclass and set ``name``."""

    name: str = "base"

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        """Returns victims (from ``view.running``) and a mode for each; [] to preempt nobody."""
        raise NotImplementedError

    def on_admitted(self, req: Request, now: float) -> None:
        """A request joined the running set (first time or after a preemption)."""

    def on_tokens(self, req: Request, now: float) -> None:
        """A request got output tokens (after each update_from_output)."""

    def on_finished(self, req: Request, now: float) -> None:
        """A request finished or was aborted."""


class FcfsLastPolicy(VictimPolicy):
    """vLLM V1's default: preempt the most recently admitted running request, by recompute.

    Args:
      mode: the preemption mode for every victim (RECOMPUTE as vLLM; OFFLOAD to use the host tier).
    """

    name = "fcfs_last"

    def __init__(self, mode: PreemptMode = PreemptMode.RECOMPUTE):
        self.mode = PreemptMode(mode)

    def select_victims(self, view: SchedulerView) -> list[tuple[Request, PreemptMode]]:
        if not view.running:
            return []
        return [(view.running[-1], self.mode)]


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request to run this step."""

    request_id: str
    start: int
    """Position of the first token (== num_computed_tokens before the step)."""
    num_tokens: int
    token_ids: tuple[int, ...]
    sample: bool
    """Whether this chunk reaches the end of the known tokens, so a token is sampled after it."""
    num_output_tokens: int
    """Output tokens so far (the index of the token sampled after this chunk; seeds RNG)."""
    sampling: Any = None


@dataclasses.dataclass
class SchedulerOutput:
    """One step's plan: plain data for an executor."""

    step: int
    prefills: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    decodes: list[ScheduledChunk] = dataclasses.field(default_factory=list)
    preemptions: list[tuple[str, PreemptMode]] = dataclasses.field(default_factory=list)
    offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(device block, host block) pairs to copy device -> host, issued after this step's compute."""
    restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(host block, device block) pairs to copy host -> device before this step's compute."""
    block_tables: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Device blocks of each scheduled request (copies; safe to keep)."""
    finished_request_ids: list[str] = dataclasses.field(default_factory=list)
    """Requests that ended since the last step (executors drop their per-request state)."""

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.prefills + self.decodes

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefills) + sum(c.num_tokens for c in self.decodes)

    @property
    def is_empty(self) -> bool:
        return not (self.prefills or self.decodes or self.offloads or self.restores)


@dataclasses.dataclass
class ExecutorOutput:
    """What an executor reports back for one `SchedulerOutput`."""

    sampled: dict[str, int] = dataclasses.field(default_factory=dict)
    """Token sampled for each chunk with ``sample=True``."""
    completed_offloads: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    completed_restores: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    step_seconds: float | None = None
    """Measured (or simulated) duration of the step, if known."""


class Executor(Protocol):
    """Runs a `SchedulerOutput`: the JAX executor and the simulated executor implement this."""

    def execute(self, scheduler_output: SchedulerOutput) -> ExecutorOutput: ...


@dataclasses.dataclass(frozen=True)
class RequestEvent:
    """New tokens of one request after a step (and whether it finished)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    status: RequestStatus


class Scheduler:
    """Queues, admission, chunked prefill and preemption; see the module docstring.

    Args:
      num_device_blocks: blocks in the device KV pool.
      num_host_blocks: blocks in the host pool (0: no offload; OFFLOAD falls back to RECOMPUTE).
      block_size: tokens per block.
      max_num_seqs: most requests running at once.
      max_num_batched_tokens: token budget per step (chunked prefill splits prompts to fit).
      policy: victim policy (default `FcfsLastPolicy`).
      costs: cost hints handed to the policy (default `LinearCostHints`).
      max_model_len: longest prompt + output allowed; default all device blocks.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int = 0,
        block_size: int = 16,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 256,
        policy: VictimPolicy | None = None,
        costs: CostHints | None = None,
        max_model_len: int | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = KVBlockManager(num_device_blocks, num_host_blocks, block_size)
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy if policy is not None else FcfsLastPolicy()
        self.costs = costs if costs is not None else LinearCostHints()
        capacity = num_device_blocks * block_size
        self.max_model_len = min(max_model_len or capacity, capacity)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.offloaded: deque[Request] = deque()
        self.step_count = 0
        self.num_preemptions = 0
        self.num_offload_preemptions = 0
        self._admissions = 0
        self._finished_since_step: list[str] = []

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queues ``req`` (status WAITING)."""
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        total = req.num_prompt_tokens + req.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"request {req.request_id!r}: prompt ({req.num_prompt_tokens}) + max_tokens "
                f"({req.max_tokens}) = {total} exceeds max_model_len {self.max_model_len}"
            )
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_request(self, request_id: str, status: RequestStatus, now: float) -> None:
        """Ends a request (stop string, abort, ...), freeing its blocks; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if not status.finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status}")
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.OFFLOADED:
            self.offloaded.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(request_id)
        req.status = status
        req.finish_time = now
        self._finished_since_step.append(request_id)
        self.policy.on_finished(req, now)

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or offloaded."""
        return bool(self.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or copies still in flight (keep stepping until False)."""
        return bool(self.requests) or self.blocks.has_copies_in_flight()

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    # ---- scheduling ----------------------------------------------------------------------
    def _view(self, now: float, shortfall: int) -> SchedulerView:
        return SchedulerView(
            step=self.step_count,
            now=now,
            block_size=self.block_size,
            free_device_blocks=self.blocks.device.num_free,
            free_host_blocks=self.blocks.host.num_free,
            blocks_needed=shortfall,
            running=tuple(self.running),
            waiting=tuple(self.waiting),
            offloaded=tuple(self.offloaded),
            costs=self.costs,
            device_blocks_held={
                r.request_id: len(self.blocks.device_table(r.request_id)) for r in self.running
            },
        )

    def _preempt(self, req: Request, mode: PreemptMode, now: float, out: SchedulerOutput) -> None:
        self.running.remove(req)
        req.num_preemptions += 1
        req.preemption_times.append(now)
        self.num_preemptions += 1
        if (
            mode == PreemptMode.OFFLOAD
            and req.num_computed_tokens > 0
            and self.blocks.can_offload(req.request_id)
        ):
            out.offloads.extend(self.blocks.begin_offload(req.request_id))
            req.status = RequestStatus.OFFLOADED
            self.offloaded.append(req)
            self.num_offload_preemptions += 1
        else:
            mode = PreemptMode.RECOMPUTE
            self.blocks.free_device(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
        out.preemptions.append((req.request_id, mode))

    def _chunk(self, req: Request, n: int) -> ScheduledChunk:
        start = req.num_computed_tokens
        stop = start + n
        prompt, output = req.prompt_token_ids, req.output_token_ids
        num_prompt = len(prompt)
        # Slices of ``prompt + output`` without building the concatenation (one per step for
        # every running request).
        if start >= num_prompt:
            tokens = tuple(output[start - num_prompt : stop - num_prompt])
        elif stop <= num_prompt:
            tokens = tuple(prompt[start:stop])
        else:
            tokens = tuple(prompt[start:]) + tuple(output[: stop - num_prompt])
        # ScheduledChunk(...) without the frozen dataclass's per-field object.__setattr__ calls.
        chunk = _object_new(ScheduledChunk)
        chunk.__dict__.update(
            request_id=req.request_id,
            start=start,
            num_tokens=n,
            token_ids=tokens,
            sample=stop == num_prompt + len(output),
            num_output_tokens=len(output),
            sampling=req.sampling,
        )
        return chunk

    def _admit(self, req: Request, now: float) -> None:
        req.status = RequestStatus.RUNNING
        req.admission_seq = self._admissions
        self._admissions += 1
        if req.first_scheduled_time is None:
            req.first_scheduled_time = now
        if req.num_preemptions:
            req.resume_times.append(now)
        self.running.append(req)
        self.policy.on_admitted(req, now)

    def schedule(self, now: float) -> SchedulerOutput:
        """Plans one step at time ``now``; see the module docstring for the order of decisions."""
        out = SchedulerOutput(step=self.step_count)
        out.finished_request_ids = self._finished_since_step
        self._finished_since_step = []
        budget = self.max_num_batched_tokens

        # 1-2. running requests, preempting while their new blocks do not fit.
        tables = self.blocks.device_tables
        bs = self.block_size
        device = self.blocks.device
        while True:
            plan: list[tuple[Request, int, int]] = []
            b = budget
            need = 0
            for req in self.running:
                if b <= 0:
                    break
                computed = req.num_computed_tokens
                n = len(req.prompt_token_ids) + len(req.output_token_ids) - computed
                if n > b:
                    n = b
                if n <= 0:
                    continue
                # extra_blocks_needed(request_id, computed + n), inlined (hot loop)
                extra = -(-(computed + n) // bs) - len(tables.get(req.request_id, ()))
                if extra < 0:
                    extra = 0
                plan.append((req, n, extra))
                need += extra
                b -= n
            available = device.num_free + device.num_in_flight
            shortfall = need - available
            if shortfall <= 0 or not self.running:
                break
            # Each round preempts at least one running request, so the loop ends.
            victims = self.policy.select_victims(self._view(now, shortfall))
            if not victims:
                break
            seen: set[str] = set()
            for victim, mode in victims:
                if victim.status != RequestStatus.RUNNING or victim not in self.running:
                    raise ValueError(
                        f"policy {self.policy.name!r} chose {victim.request_id!r}, "
                        f"which is not running"
                    )
                if victim.request_id in seen:
                    raise ValueError(
                        f"policy {self.policy.name!r} chose {victim.request_id!r} twice"
                    )
                seen.add(victim.request_id)
                self._preempt(victim, PreemptMode(mode), now, out)

        running_status = RequestStatus.RUNNING
        decodes, prefills = out.decodes, out.prefills
        for req, n, extra in plan:
            if req.status is not running_status:
                continue
            if extra:
                if extra > device.num_free:
                    continue  # sits this step out (blocks still in flight or policy declined)
                # Nothing changed this request's table since ``extra`` was computed.
                tables.setdefault(req.request_id, []).extend(device.allocate(req.request_id, extra))
            output = req.output_token_ids
            start = req.num_computed_tokens
            num_prompt = len(req.prompt_token_ids)
            if n == 1 and output and start >= num_prompt:
                # A decode: `_chunk` inlined (one per running request per step).
                chunk = _object_new(ScheduledChunk)
                chunk.__dict__.update(
                    request_id=req.request_id,
                    start=start,
                    num_tokens=1,
                    token_ids=(output[start - num_prompt],),
                    sample=start + 1 == num_prompt + len(output),
                    num_output_tokens=len(output),
                    sampling=req.sampling,
                )
                decodes.append(chunk)
            else:
                (decodes if n == 1 and output else prefills).append(self._chunk(req, n))
            budget -= n

        # 3. restore offloaded requests (oldest preemption first), resuming them at once.
        while self.offloaded and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.offloaded[0]
            if self.blocks.offload_in_flight(req.request_id):
                break  # its pages are still being copied out; restore once they land
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            held = len(self.blocks.host_tables.get(req.request_id, ()))
            need = max(held, self.blocks.num_blocks_for(req.num_computed_tokens + n))
            if need > self.blocks.device.num_free:
                break
            self.offloaded.popleft()
            out.restores.extend(self.blocks.begin_restore(req.request_id))
            self._admit(req, now)
            self.blocks.grow(req.request_id, req.num_computed_tokens + n)
            chunk = self._chunk(req, n)
            (out.decodes if req.num_output_tokens > 0 and n == 1 else out.prefills).append(chunk)
            budget -= n

        # 4. admit waiting requests FCFS (never preempting for them).
        while (
            self.waiting
            and not self.offloaded
            and len(self.running) < self.max_num_seqs
            and budget > 0
        ):
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self.blocks.extra_blocks_needed(req.request_id, n) > self.blocks.device.num_free:
                break
            self.waiting.popleft()
            self._admit(req, now)
            self.blocks.grow(req.request_id, req.num_computed_tokens + n)
            chunk = self._chunk(req, n)
            out.prefills.append(chunk)
            budget -= n

        block_tables = out.block_tables
        for chunk in prefills:
            block_tables[chunk.request_id] = list(tables[chunk.request_id])
        for chunk in decodes:
            block_tables[chunk.request_id] = list(tables[chunk.request_id])
        self.step_count += 1
        return out

    # ---- results -------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, result: ExecutorOutput, now: float
    ) -> list[RequestEvent]:
        """Applies one executed step; returns new tokens per request (finished ones included)."""
        if result.completed_offloads:
            self.blocks.complete_offload(result.completed_offloads)
        if result.completed_restores:
            self.blocks.complete_restore(result.completed_restores)
        events: list[RequestEvent] = []
        requests = self.requests
        sampled = result.sampled
        running_status = RequestStatus.RUNNING
        # The base hook does nothing; skip a call per token when the policy keeps it.
        on_tokens = self.policy.on_tokens
        if getattr(on_tokens, "__func__", None) is VictimPolicy.on_tokens:
            on_tokens = None
        for chunks in (scheduler_output.prefills, scheduler_output.decodes):
            for chunk in chunks:
                rid = chunk.request_id
                req = requests.get(rid)
                if req is None or req.status is not running_status:
                    continue  # finished or aborted while the step ran
                if req.num_computed_tokens != chunk.start:
                    continue  # preempted and restarted since (stale chunk)
                req.num_computed_tokens += chunk.num_tokens
                if not chunk.sample:
                    continue
                if rid not in sampled:
                    raise ValueError(f"executor returned no token for {rid!r}")
                token = int(sampled[rid])
                output = req.output_token_ids
                output.append(token)
                req.token_times.append(now)
                if req.first_token_time is None:
                    req.first_token_time = now
                status = None
                if token in req.stop_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                elif len(output) >= req.max_tokens:
                    status = RequestStatus.FINISHED_LENGTH
                if on_tokens is not None:
                    on_tokens(req, now)
                if status is not None:
                    self.finish_request(rid, status, now)
                event = _object_new(RequestEvent)  # RequestEvent(...), without its setattrs
                event.__dict__.update(
                    request_id=rid,
                    new_token_ids=(token,),
                    finished=status is not None,
                    status=req.status,
                )
                events.append(event)
        return events

    # ---- introspection -------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block invariants plus queue consistency; raises on the first violation."""
        self.blocks.check_invariants()
        ids = [r.request_id for r in self.running]
        ids += [r.request_id for r in self.waiting] + [r.request_id for r in self.offloaded]
        if len(ids) != len(set(ids)) or set(ids) != set(self.requests):
            raise AssertionError("a request is in two queues, or in none")
        for r in self.running:
            if r.status != RequestStatus.RUNNING:
                raise AssertionError(f"{r.request_id!r} in running with status {r.status}")
        for r in self.offloaded:
            if r.request_id in self.blocks.device_tables and self.blocks.device_table(r.request_id):
                raise AssertionError(f"offloaded {r.request_id!r} still holds device blocks")
        for r in self.waiting:
            if self.blocks.device_table(r.request_id):
                raise AssertionError(f"waiting {r.request_id!r} holds device blocks")
        if len(self.running) > self.max_num_seqs:
            raise AssertionError("more running requests than max_num_seqs")

    def stats(self) -> dict[str, int]:
        """Queue lengths and free blocks (for /metrics)."""
        return {
            "running": len(self.running),
            "waiting": len(self.waiting),
            "offloaded": len(self.offloaded),
            "free_device_blocks": self.blocks.device.num_free,
            "free_host_blocks": self.blocks.host.num_free,
            "preemptions": self.num_preemptions,
        }


_object_new = object.__new__


def requests_in_order(requests: Sequence[Request]) -> list[Request]:
    """Requests sorted by admission sequence (oldest admission first)."""
    return sorted(requests, key=lambda r: r.admission_seq)
