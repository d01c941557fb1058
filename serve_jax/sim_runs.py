"""Runs of quiet decode steps, applied at once: the simulator's fast path (pure Python).

Most steps of a long trace are *quiet*: nothing is queued or offloaded, no copy is in flight,
every running request decodes one token, no request arrives and the free device blocks cover
every block boundary the run crosses. Such a step's plan is known in advance, so
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
  state moves, e.g. SGLang's ratio decay) and ``on_tokens`` once per request with the number of
  new tokens;
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
from serve_jax.sim_executor import TOKEN, SimulatedExecutor
from serve_jax.sim_metrics import SimMetrics

__all__ = ["quiet_run_length", "run_quiet_decodes"]

MIN_RUN = 2
"""Shorter runs go through `EngineCore.step` (nothing to gain)."""


def quiet_run_length(
    core: EngineCore, executor: SimulatedExecutor, max_steps: int
) -> tuple[int, int]:
    """(steps, finish step): how many of the next steps are quiet, ignoring arrivals, the
    last of them possibly the first step in which a request finishes (its index is the
    second number); (0, 0) if the next step is not quiet."""
    sched = core.scheduler
    running = sched.running
    if not running or sched.waiting or sched.offloaded:
        return 0, 0
    if len(running) > sched.max_num_batched_tokens:
        return 0, 0
    blocks = sched.blocks
    if blocks.has_copies_in_flight() or executor.has_copies_pending():
        return 0, 0
    finish = max_steps
    before_stop = executor.steps_before_stop
    for req in running:
        n_out = len(req.output_token_ids)
        if not n_out or req.num_computed_tokens != len(req.prompt_token_ids) + n_out - 1:
            return 0, 0  # still prefilling (or a one-token prefill left)
        # The step where it samples its stop token or reaches max_tokens ends the run.
        finish = min(finish, req.max_tokens - n_out - 1, before_stop(req))
        if finish + 1 < MIN_RUN:
            return 0, 0
    horizon = min(finish + 1, max_steps)
    # Memory: the run's block allocations, in step order, must come from the free blocks.
    free = blocks.device.num_free
    tables = blocks.device_tables
    bs = sched.block_size
    steps = []
    for req in running:
        j = len(tables.get(req.request_id, ())) * bs - req.num_computed_tokens
        while j < horizon:
            steps.append(j)
            j += bs
    if len(steps) > free:
        steps.sort()
        horizon = steps[free]  # that step would be short of blocks
    return (horizon, finish) if horizon >= MIN_RUN else (0, 0)


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
    k = len(ends)
    if k < MIN_RUN:
        return 0, []
    start = executor.now
    finished = _apply(sched, executor, computed, ends, k == finish + 1)
    executor.advance(ends)
    tally.add_decode_run([start, *ends])
    core.num_steps += k
    return k, finished


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
    for _ in range(k):
        policy.admission_limit(sched)  # asked at the start of every step
    # (step, 0 = allocate in schedule / 1 = register in update, running index); a finish
    # frees blocks and moves the predictor but touches neither the allocations of its step
    # (made before it) nor another request's registration.
    events = []
    caching = blocks.enable_prefix_caching
    for i, req in enumerate(running):
        c = computed[i]
        j = len(tables.get(req.request_id, ())) * bs - c
        while j < k:
            events.append((j, 0, i))
            j += bs
        if caching:
            j = (-(c + 1)) % bs  # after step j the request's computed tokens fill a block
            while j < k:
                events.append((j, 1, i))
                j += bs
    tokens = [TOKEN] * bulk
    for req in running:
        req.output_token_ids.extend(tokens)  # the hashes of full blocks read them
    if events:
        events.sort()
        allocate = blocks.device.allocate
        cache_computed = blocks.cache_computed
        for j, kind, i in events:
            req = running[i]
            if kind == 0:
                tables.setdefault(req.request_id, []).extend(allocate(req.request_id, 1))
            else:
                req.num_computed_tokens = computed[i] + j + 1
                cache_computed(req)
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
