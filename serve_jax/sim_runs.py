"""Runs of quiet decode steps, applied at once: the simulator's fast path (pure Python).

Most steps of a long trace are *quiet*: nothing is offloaded, nothing queued is admitted (the
queue is empty, or the policy's gate admits nothing: `VictimPolicy.admission_limit_ahead` says
so for each step, asked step by step as the scheduler would ask `admission_limit`), no copy is
in flight, every running request decodes one token, no request arrives and the free device
blocks cover every block boundary the run crosses. Such a step's plan is known in advance, so
`run_quiet_decodes` applies a whole run of them in one pass and reaches exactly the state that
`serve_jax.core.EngineCore.step` reaches one step at a time (the simulator's
``SimConfig.decode_runs`` switch turns it off; the tests compare both ways):

* the executor times each step as `SimulatedExecutor.execute` does (same float operations, in
  order), and the run ends before a step that would start at or after the next arrival;
* block allocations (schedule) and prefix-cache registrations (update) happen in the order the
  step-by-step path makes them: by step, then allocation before registration, then running
  order, so the free queue, evictions and cache maps end up identical;
* tokens, token times, computed counts, step counters and the policy hooks advance as they
  would: ``admission_limit`` is asked once per step (nothing is queued, so only its per-step
  state moves, e.g. SGLang's ratio decay; with requests queued, ``admission_limit_ahead``
  was asked instead, once per step) and ``on_tokens`` once per request with the number of new
  tokens;
* a run ends with the first step in which a request finishes; that step's tokens and finishes
  are applied request by request, in running order, as `Scheduler.update_from_output` applies
  them (a finish moves the predictor that the next request's ``on_tokens`` may consult);
* the metrics observer gets each step's duration (`SimMetrics.add_decode_run`), the arrival
  feeder the finished requests.

Steps that are not quiet (an arrival, a prefill, a preemption, a copy) run through
`EngineCore.step` as before.
"""

from __future__ import annotations

from serve_jax.core import EngineCore
from serve_jax.interface import VictimPolicy
from serve_jax.sim_executor import TOKEN, SimulatedExecutor
from serve_jax.sim_metrics import SimMetrics

__all__ = ["quiet_run_length", "run_quiet_decodes"]

MIN_RUN = 2
"""Shorter runs go through `EngineCore.step` (nothing to gain)."""


def quiet_run_length(
    core: EngineCore, executor: SimulatedExecutor, max_steps: int
) -> tuple[int, int]:
    """(steps, finish step): how many of the next steps are quiet, ignoring arrivals and
    whether the gate stays closed after the first step, the last of them possibly the first
    step in which a request finishes (its index is the second number); (0, 0) if the next step
    is not quiet."""
    sched = core.scheduler
    running = sched.running
    if not running or sched.offloaded:
        return 0, 0
    if len(running) > sched.max_num_batched_tokens:
        return 0, 0
    blocks = sched.blocks
    if blocks.has_copies_in_flight() or executor.has_copies_pending():
        return 0, 0
    if sched.waiting and (
        blocks.host_caching
        # (the host tier's decisions at each plan's end may read the queue)
        or type(sched.policy).admission_limit_ahead is VictimPolicy.admission_limit_ahead
        # (the policy cannot tell whether a step admits: its answer would be None below)
    ):
        return 0, 0
    finish = max_steps
    before_stop = executor.steps_before_stop
    for req in running:
        n_out = len(req.output_token_ids)
        if not n_out or req.num_computed_tokens != len(req.prompt_token_ids) + n_out - 1:
            return 0, 0  # still prefilling (or a one-token prefill left)
        # The step where it samples its stop token or reaches max_tokens ends the run.
        left = req.max_tokens - n_out - 1
        if left < finish:
            finish = left
        left = before_stop(req)
        if left < finish:
            finish = left
        if finish + 1 < MIN_RUN:
            return 0, 0
    horizon = min(finish + 1, max_steps)
    # Memory: the run's block allocations, in step order, must come from the free blocks
    # (at most one every ``bs`` steps of each request).
    free = blocks.device.num_free
    bs = sched.block_size
    if len(running) * -(-horizon // bs) > free:
        tables = blocks.device_tables
        steps = []
        for req in running:
            j = len(tables.get(req.request_id, ())) * bs - req.num_computed_tokens
            while j < horizon:
                steps.append(j)
                j += bs
        if len(steps) > free:
            steps.sort()
            horizon = steps[free]  # that step would be short of blocks
    if horizon < MIN_RUN:
        return 0, 0
    if sched.waiting:
        # Asked as `Scheduler.schedule` will ask `admission_limit` at this step.
        if sched.policy.admission_limit_ahead(sched, 0, free) != 0:
            return 0, 0  # the step may admit (or the policy cannot tell: None)
    return horizon, finish


def run_quiet_decodes(
    core: EngineCore,
    executor: SimulatedExecutor,
    tally: SimMetrics,
    until: float | None,
    max_steps: int,
) -> tuple[int, list[str]]:
    """Applies the run of quiet steps that starts now (ending before ``until``, the next
    arrival, and after at most ``max_steps``).

    Returns:
      How many steps it applied, and the requests that finished in its last step (the
      caller hands them to the arrival feeder, as the step's events would).
    """
    k, finish = quiet_run_length(core, executor, max_steps)
    if not k:
        return 0, []
    sched = core.scheduler
    running = sched.running
    computed = [req.num_computed_tokens for req in running]
    ends = executor.decode_run_ends(len(running), sum(computed), k, until)
    if sched.waiting:
        ends = ends[: _closed_steps(sched, computed, len(ends))]
    k = len(ends)
    if k < MIN_RUN:
        return 0, []
    start = executor.now
    finished = _apply(sched, executor, computed, ends, k == finish + 1)
    executor.advance(ends)
    tally.add_decode_run([start, *ends])
    core.num_steps += k
    return k, finished


def _closed_steps(sched, computed: list[int], k: int) -> int:
    """How many of the next ``k`` quiet steps the policy's gate keeps closed: it is asked at
    each step after the first (which `quiet_run_length` asked), with the blocks free then,
    up to and including the first that admits (which then runs through `EngineCore.step`, whose
    `Scheduler.schedule` asks it again at the same state, to the same effect)."""
    tables = sched.blocks.device_tables
    bs = sched.block_size
    allocated = [0] * k  # blocks allocated at each step (before the gate of the next one)
    for i, req in enumerate(sched.running):
        for j in range(len(tables.get(req.request_id, ())) * bs - computed[i], k - 1, bs):
            allocated[j] += 1
    free = sched.blocks.device.num_free
    ahead = sched.policy.admission_limit_ahead
    for j in range(1, k):
        free -= allocated[j - 1]
        if ahead(sched, j, free):
            return j
    return k


def _apply(
    sched, executor: SimulatedExecutor, computed: list[int], ends: list[float], last_finishes: bool
) -> list[str]:
    """Advances every running request by ``len(ends)`` decode steps ending at ``ends``; with
    ``last_finishes``, the last step is the one where some of them finish, applied request by
    request as `Scheduler.update_from_output` does. Returns the finished request ids."""
    k = len(ends)
    bulk = k - 1 if last_finishes else k  # steps whose tokens are applied at once
    running = sched.running
    blocks = sched.blocks
    tables = blocks.device_tables
    bs = sched.block_size
    policy = sched.policy
    if not sched.waiting:  # (else `admission_limit_ahead` was asked for every step)
        for _ in range(k):
            policy.admission_limit(sched)  # asked at the start of every step
    # (step, running index) of each block allocation (in schedule) and prefix-cache
    # registration (in update). The allocations take the free queue's blocks in step order,
    # then running order, all at once: a registration neither frees nor allocates a block, and
    # the evictions of an allocation leave a registration's cache entries as they would be
    # (registered blocks are held, evicted ones free). A finish frees blocks and moves the
    # predictor but touches neither the allocations of its step (made before it) nor another
    # request's registration.
    allocations = []
    registrations = []
    caching = blocks.enable_prefix_caching
    tokens = [TOKEN] * bulk
    for i, req in enumerate(running):
        c = computed[i]
        for j in range(len(tables.get(req.request_id, ())) * bs - c, k, bs):
            allocations.append((j, i))
        if caching:
            # after step j the request's computed tokens fill a block
            for j in range((-(c + 1)) % bs, k, bs):
                registrations.append((j, i))
        req.output_token_ids.extend(tokens)  # the hashes of full blocks read them
    if allocations:
        allocations.sort()
        new = blocks.device.allocate("a run of decode steps", len(allocations))
        for (_, i), block in zip(allocations, new):
            tables.setdefault(running[i].request_id, []).append(block)
    if registrations:
        registrations.sort()
        blocks.cache_computed_upto([(running[i], computed[i] + j + 1) for j, i in registrations])
    on_tokens = sched.tokens_hook()
    every = policy.on_tokens_every
    now = ends[bulk - 1]
    bulk_ends = ends[:bulk]
    for i, req in enumerate(running):
        req.num_computed_tokens = computed[i] + k
        req.token_times.extend(bulk_ends)
        if on_tokens is not None:
            n = len(req.output_token_ids)
            if n // every > (n - bulk) // every:
                on_tokens(req, now, bulk)
    sched.step_count += k
    finished: list[str] = []
    if last_finishes:
        now = ends[-1]
        append_token = sched.append_token
        for req in list(running):
            if append_token(req, executor.sampled_token(req), now, on_tokens, every):
                finished.append(req.request_id)
    return finished
