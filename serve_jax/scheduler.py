"""Continuous-batching scheduler with chunked prefill and policy-driven preemption (pure Python).

This module is a contract shared by the real JAX engine and the trace-driven simulator, so it
imports no JAX and never reads a clock: time is passed in (``schedule(now)``,
``update_from_output(out, now)``), which lets a simulator drive it with simulated time.

One engine step (vLLM v1 style; `serve_jax.core.EngineCore.step` is the one place that runs it,
under the JAX engine and the simulator alike)::

    out = scheduler.schedule(now)                 # SchedulerOutput: plain data
    result = executor.execute(out)                # ExecutorOutput: sampled tokens, finished copies
    events = scheduler.update_from_output(out, result, now)

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
   blocks fit, and resume right away in the same step; blocks of theirs still cached on the
   device (prefix caching) are shared instead of copied back.
4. Waiting requests are admitted FCFS while there are sequence slots, token budget and free
   device blocks for their first chunk; admission never preempts. With prefix caching (on by
   default) an admitted request starts from the longest prefix of its tokens whose full blocks
   are cached (`serve_jax.kv_blocks`): those blocks are shared and their tokens count as
   computed, so only the rest is prefilled. With the host cache level on
   (``host_prefix_caching``) the prefix continues into blocks cached in the host pool, copied
   back (``SchedulerOutput.restores``) instead of computed; cached device blocks freed by their
   last holder are demoted there (``SchedulerOutput.offloads``).

The same rules hold for every policy:

* a step's victims sit the rest of that step out: they are requeued (recompute: at the front of
  the waiting queue; offload: at the back of the offloaded queue) once the plan is complete;
* ``no_admission_after_preemption`` (on by default): vLLM V1's rule (``if not
  preempted_reqs``): a step that preempted admits no waiting request;
* the policy's admission hook, ``policy.admission_limit(scheduler)``, asked once at the start of
  each step: at most that many requests from the head of ``[offloaded..., waiting...]`` are
  restored or admitted in the step (None, the default, means no limit).

A request that could never fit (prompt plus ``max_tokens`` beyond ``max_model_len``, the model's
context limit capped by the device pool) is refused by `Scheduler.add_request` with the reason
(`Scheduler.admission_error`), so nothing can wait for memory that will never exist.

(At ~560 lines this module is past the stack's ~500: it is one class whose ``schedule`` pass
shares the queues, the token budget and the block manager across its four phases; split apart,
those would be passed around as state. The data types it exchanges live in
`serve_jax.interface`.)

`update_from_output` advances ``num_computed_tokens`` (registering newly full blocks in the
prefix cache), appends sampled tokens, finishes requests
at ``max_tokens`` or a stop token, releases blocks whose copies completed, and calls the policy
hooks. The engine finishes requests for other reasons (stop strings, aborts) with
`Scheduler.finish_request`.

Every field a policy may read is on `Request` and `SchedulerView`; policies may keep their own
per-request state in ``Request.predictor_state``. The data types live in `serve_jax.interface`
and are re-exported here; block accounting and the prefix cache are `serve_jax.kv_blocks`. The
module stays one file past 500 lines because it is one class whose `schedule` and
`update_from_output` are the two halves of the same bookkeeping (and the simulator's hot loop).
"""

from __future__ import annotations

from collections import deque

from serve_jax.interface import (
    CostHints,
    Executor,
    ExecutorOutput,
    FcfsLastPolicy,
    LinearCostHints,
    PreemptMode,
    Request,
    RequestEvent,
    RequestStatus,
    ScheduledChunk,
    SchedulerOutput,
    SchedulerView,
    VictimPolicy,
)
from serve_jax.kv_blocks import KVBlockManager

__all__ = [  # the data types are re-exported from serve_jax.interface
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
      no_admission_after_preemption: vLLM V1's rule: a step that preempted admits no waiting
        request (on by default, for every policy).
      enable_prefix_caching: automatic prefix caching in the block manager (on by default; see
        `serve_jax.kv_blocks`): an admission starts from the longest cached prefix of its tokens.
      block_hash: the prefix cache's key function (``blake2b``; the simulator uses ``builtin``).
      host_prefix_caching: the host pool as a second cache level (`serve_jax.kv_blocks`): freed
        cached blocks are demoted to it (copies issued with the next step's offloads) and an
        admission promotes the host-cached continuation of its prefix (copies issued with the
        step's restores) instead of computing it.
      host_retention: which freed cached blocks are demoted (`serve_jax.host_retention`):
        ``predicted`` (default) or ``all``.
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
        no_admission_after_preemption: bool = True,
        enable_prefix_caching: bool = True,
        block_hash: str = "blake2b",
        host_prefix_caching: bool = False,
        host_retention: str = "predicted",
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.blocks = KVBlockManager(
            num_device_blocks,
            num_host_blocks,
            block_size,
            enable_prefix_caching,
            block_hash,
            host_caching=host_prefix_caching,
            host_retention=host_retention,
        )
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
        self.no_admission_after_preemption = no_admission_after_preemption
        self.preempted_computed_tokens: dict[str, int] = {}
        """Computed tokens of each request at its latest preemption (what a recompute wastes)."""
        self._admissions = 0
        # Victims of the step being planned, requeued at its end.
        self._held_waiting: list[Request] = []
        self._held_offloaded: list[Request] = []
        self.policy.attach(self)

    # ---- requests ------------------------------------------------------------------------
    def admission_error(self, num_prompt_tokens: int, max_tokens: int = 1) -> str | None:
        """Why a request of this size can never run here (None: it can).

        ``max_model_len`` is the model's context limit capped by the device KV pool, so a
        prompt plus ``max_tokens`` beyond it could never be held at once.
        """
        total = num_prompt_tokens + max_tokens
        if total <= self.max_model_len:
            return None
        device_tokens = self.blocks.device.num_blocks * self.block_size
        limit = "the device KV cache" if self.max_model_len == device_tokens else "the model"
        return (
            f"prompt ({num_prompt_tokens}) + max_tokens ({max_tokens}) = {total} exceeds "
            f"max_model_len {self.max_model_len} (the context limit of {limit})"
        )

    def add_request(self, req: Request) -> None:
        """Queues ``req`` (status WAITING).

        Raises:
          ValueError: a duplicate id, or a request that can never fit (`admission_error`).
        """
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id!r}")
        error = self.admission_error(req.num_prompt_tokens, req.max_tokens)
        if error is not None:
            raise ValueError(f"request {req.request_id!r}: {error}")
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
        self.policy.on_finished(req, now)

    def has_unfinished(self) -> bool:
        """Whether any request is queued, running or offloaded."""
        return bool(self.requests)

    def has_work(self) -> bool:
        """Unfinished requests, or copies still in flight (keep stepping until False)."""
        return bool(self.requests) or self.blocks.has_copies_in_flight()

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
        self.preempted_computed_tokens[req.request_id] = req.num_computed_tokens
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
            self._held_offloaded.append(req)
            self.num_offload_preemptions += 1
        else:
            mode = PreemptMode.RECOMPUTE
            self.blocks.free_device(req.request_id)
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self._held_waiting.append(req)
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
        return ScheduledChunk(
            req.request_id,
            start,
            n,
            tokens,
            stop == num_prompt + len(output),
            len(output),
            req.sampling,
        )

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
        budget = self.max_num_batched_tokens
        # The admission hook: how many queued requests (offloaded first) this step may take.
        limit = self.policy.admission_limit(self)
        quota = len(self.requests) if limit is None else max(int(limit), 0)

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
                decodes.append(
                    ScheduledChunk(
                        req.request_id,
                        start,
                        1,
                        (output[start - num_prompt],),
                        start + 1 == num_prompt + len(output),
                        len(output),
                        req.sampling,
                    )
                )
            else:
                (decodes if n == 1 and output else prefills).append(self._chunk(req, n))
            budget -= n

        # 3. restore offloaded requests (oldest preemption first), resuming them at once.
        while quota > 0 and self.offloaded and len(self.running) < self.max_num_seqs and budget > 0:
            req = self.offloaded[0]
            if self.blocks.offload_in_flight(req.request_id):
                break  # its pages are still being copied out; restore once they land
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            held = len(self.blocks.host_tables.get(req.request_id, ()))
            # Blocks still cached on the device are shared, not copied back.
            hits = self.blocks.lookup_prefix(req, req.num_computed_tokens)[:held]
            need = max(held, self.blocks.num_blocks_for(req.num_computed_tokens + n)) - len(hits)
            if need + device.num_free_among(hits) > device.num_free:
                break
            self.offloaded.popleft()
            out.restores.extend(self.blocks.begin_restore(req.request_id, hits))
            self._admit(req, now)
            self.blocks.grow(req.request_id, req.num_computed_tokens + n)
            chunk = self._chunk(req, n)
            (out.decodes if req.num_output_tokens > 0 and n == 1 else out.prefills).append(chunk)
            budget -= n
            quota -= 1

        # 4. admit waiting requests FCFS (never preempting for them).
        if self.no_admission_after_preemption and out.preemptions:
            quota = 0
        while (
            quota > 0
            and self.waiting
            and not self.offloaded
            and len(self.running) < self.max_num_seqs
            and budget > 0
        ):
            req = self.waiting[0]
            # A waiting request holds no blocks and has nothing computed; it starts from the
            # longest cached prefix of its tokens.
            # Cached on the device, then the host cache's continuation (promoted).
            hits, promote = self.blocks.lookup(req)
            computed = (len(hits) + len(promote)) * bs
            n = min(req.num_tokens - computed, budget)
            need = self.blocks.num_blocks_for(computed + n) - len(hits)
            if need + device.num_free_among(hits) > device.num_free:
                break
            self.waiting.popleft()
            out.restores.extend(self.blocks.take_prefix(req, hits, promote))
            req.num_computed_tokens = computed
            self._admit(req, now)
            self.blocks.grow(req.request_id, computed + n)
            chunk = self._chunk(req, n)
            out.prefills.append(chunk)
            budget -= n
            quota -= 1

        # The step's victims sat the rest of it out (every policy alike); they rejoin their
        # queues now: recompute ones in front (the last preempted first, as vLLM prepends each
        # victim), offloaded ones at the back in preemption order.
        if self._held_waiting:
            self.waiting.extendleft(self._held_waiting)
            self._held_waiting = []
        if self._held_offloaded:
            self.offloaded.extend(self._held_offloaded)
            self._held_offloaded = []

        if self.blocks.host_caching:
            # Cached blocks freed since the last plan are copied to the host cache, keeping free
            # what the next step needs (a block per running request, the queue head's blocks);
            # what is demoted next depends on whether anything waits for memory.
            queue = self.offloaded or self.waiting
            keep = len(self.running)
            if queue:
                keep += self.blocks.num_blocks_for(queue[0].num_tokens)
            out.offloads.extend(self.blocks.take_demotions(keep))
            self.blocks.memory_contended = bool(self.waiting or self.offloaded)
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
        bs = self.block_size
        cache_computed = self.blocks.cache_computed if self.blocks.enable_prefix_caching else None
        on_tokens = self.tokens_hook()
        every = self.policy.on_tokens_every
        for chunks in (scheduler_output.prefills, scheduler_output.decodes):
            for chunk in chunks:
                rid = chunk.request_id
                req = requests.get(rid)
                if req is None or req.status is not running_status:
                    continue  # finished or aborted while the step ran
                if req.num_computed_tokens != chunk.start:
                    continue  # preempted and restarted since (stale chunk)
                req.num_computed_tokens += chunk.num_tokens
                if cache_computed is not None and req.num_computed_tokens % bs < chunk.num_tokens:
                    # the chunk completed a block: register it in the prefix cache
                    cache_computed(req)
                if not chunk.sample:
                    continue
                if rid not in sampled:
                    raise ValueError(f"executor returned no token for {rid!r}")
                token = int(sampled[rid])
                if req.first_token_time is None:
                    req.first_token_time = now
                done = self.append_token(req, token, now, on_tokens, every)
                events.append(RequestEvent(rid, (token,), done, req.status))
        return events

    def tokens_hook(self):
        """The policy's ``on_tokens``, or None when it keeps the base hook (which does
        nothing), so callers skip a call per token."""
        on_tokens = self.policy.on_tokens
        if getattr(on_tokens, "__func__", None) is VictimPolicy.on_tokens:
            return None
        return on_tokens

    def append_token(self, req: Request, token: int, now: float, on_tokens, every: int) -> bool:
        """Appends one sampled token at ``now``, calls ``on_tokens`` (from `tokens_hook`)
        every ``every`` tokens and finishes the request on a stop token or at max_tokens;
        returns whether it finished. Shared by `update_from_output` and the simulator's
        quiet decode runs (`serve_jax.sim_runs`)."""
        output = req.output_token_ids
        output.append(token)
        req.token_times.append(now)
        status = None
        if token in req.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif len(output) >= req.max_tokens:
            status = RequestStatus.FINISHED_LENGTH
        if on_tokens is not None and len(output) % every == 0:
            on_tokens(req, now)
        if status is not None:
            self.finish_request(req.request_id, status, now)
        return status is not None

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
            "prefix_cache_queries": self.blocks.prefix_queries,
            "prefix_cache_hits": self.blocks.prefix_hits,
            "restore_cache_hit_blocks": self.blocks.restore_hit_blocks,
            "prefix_cache_host_hits": self.blocks.host_hits,
            "demoted_blocks": self.blocks.demoted_blocks,
            "offload_host_hit_blocks": self.blocks.offload_hit_blocks,
        }
