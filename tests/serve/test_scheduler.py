"""Scheduler contract: chunked prefill, preemption by recompute and offload, block invariants.

The executor here is a pure-Python page store: it writes each token id into the slot its block
table names and derives the next token from the token ids it reads back through the table. A
wrong table, a lost or early-reused page, or a bad offload/restore changes the output, so
comparing with a straight (unpaged) generation checks the scheduler's bookkeeping end to end.
Offload copies are performed at the end of the *next* step (as an asynchronous copy would land)
and the source page is poisoned afterwards, unless the prefix cache keeps it (a cached page must
keep its content until it is evicted; a hit on a page that lost it reads the poison).
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings, strategies as st

from serve_jax.kv_blocks import BlockAccountingError, BlockPool, KVBlockManager
from serve_jax.scheduler import (
    ExecutorOutput,
    FcfsLastPolicy,
    PreemptMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerOutput,
    VictimPolicy,
)

VOCAB = 101
POISON = -7


def next_token(context: list[int]) -> int:
    acc = len(context)
    for i, t in enumerate(context):
        acc = (acc * 31 + (i + 3) * t) % 1_000_003
    return acc % VOCAB


def reference(prompt: list[int], max_tokens: int, stop: frozenset[int] = frozenset()) -> list[int]:
    ctx = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(ctx)
        out.append(t)
        ctx.append(t)
        if t in stop:
            break
    return out


class PageStoreExecutor:
    def __init__(self, num_device: int, num_host: int, block_size: int, cached=lambda d: False):
        self.bs = block_size
        self.cached = cached
        self.dev = [[POISON] * block_size for _ in range(num_device)]
        self.host = [[POISON] * block_size for _ in range(max(num_host, 0))]
        self.in_flight: list[tuple[int, int]] = []
        self.steps = 0

    def execute(self, so: SchedulerOutput) -> ExecutorOutput:
        self.steps += 1
        for h, d in so.restores:
            self.dev[d] = list(self.host[h])
            self.host[h] = [POISON] * self.bs
        sampled = {}
        for c in so.chunks:
            table = so.block_tables[c.request_id]
            assert len(c.token_ids) == c.num_tokens
            for i, tok in enumerate(c.token_ids):
                pos = c.start + i
                self.dev[table[pos // self.bs]][pos % self.bs] = tok
            if c.sample:
                n = c.start + c.num_tokens
                ctx = [self.dev[table[p // self.bs]][p % self.bs] for p in range(n)]
                assert POISON not in ctx, f"{c.request_id} read a poisoned page"
                sampled[c.request_id] = next_token(ctx)
        # Copies issued last step land now, after this step's compute.
        done = self.in_flight
        for d, h in done:
            self.host[h] = list(self.dev[d])
            if not self.cached(d):
                self.dev[d] = [POISON] * self.bs
        self.in_flight = list(so.offloads)
        return ExecutorOutput(
            sampled=sampled, completed_offloads=done, completed_restores=list(so.restores)
        )


class RandomPolicy(VictimPolicy):
    """Any policy must be safe: random victims, random modes."""

    name = "random"

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.admitted = 0
        self.finished = 0

    def select_victims(self, view):
        k = self.rng.randint(1, min(2, len(view.running)))
        victims = self.rng.sample(list(view.running), k)
        return [(v, self.rng.choice(list(PreemptMode))) for v in victims]

    def on_admitted(self, req, now):
        self.admitted += 1

    def on_finished(self, req, now):
        self.finished += 1


def drive(sched, ex, arrivals, abort_at=(), max_steps=5000):
    """Runs to completion; arrivals: {step: [Request]}; returns finished requests by id."""
    finished = {}
    by_id = {}
    step = 0
    while step < max_steps:
        now = float(step)
        for req in arrivals.get(step, []):
            sched.add_request(req)
            by_id[req.request_id] = req
        for rid in [a for (s, a) in abort_at if s == step]:
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED, now)
        if not sched.has_work() and step > max(arrivals, default=0):
            break
        so = sched.schedule(now)
        assert so.num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len({c.request_id for c in so.chunks}) == len(so.chunks)
        sched.check_invariants()
        res = ex.execute(so)
        for ev in sched.update_from_output(so, res, now + 0.5):
            if ev.finished:
                finished[ev.request_id] = by_id[ev.request_id]
        sched.check_invariants()
        step += 1
    assert step < max_steps, "scheduler made no progress"
    return finished, by_id


def make_requests(rng, n, max_prompt, max_out, stop_prob=0.0):
    arrivals = {}
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, max_prompt))]
        stop = frozenset({rng.randrange(VOCAB)}) if rng.random() < stop_prob else frozenset()
        req = Request(f"r{i}", prompt, rng.randint(1, max_out), 0.0, stop_token_ids=stop)
        arrivals.setdefault(rng.randint(0, 2 * n), []).append(req)
    return arrivals


def test_no_preemption_matches_reference():
    sched = Scheduler(64, 0, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    ex = PageStoreExecutor(64, 0, 4)
    rng = random.Random(0)
    arrivals = make_requests(rng, 6, 20, 10)
    finished, by_id = drive(sched, ex, arrivals)
    assert set(finished) == set(by_id)
    for req in by_id.values():
        assert req.output_token_ids == reference(req.prompt_token_ids, req.max_tokens)
        assert req.status == RequestStatus.FINISHED_LENGTH
        assert req.num_preemptions == 0
    sched.blocks.assert_all_free()
    assert sched.num_preemptions == 0


def test_chunked_prefill_respects_budget_and_time_is_passed_in():
    sched = Scheduler(32, 0, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    req = Request("long", list(range(1, 30)), 3, arrival_time=10.0)
    sched.add_request(req)
    ex = PageStoreExecutor(32, 0, 4)
    sizes = []
    t = 100.0
    while sched.has_work():
        so = sched.schedule(t)
        sizes.append([c.num_tokens for c in so.chunks])
        sched.update_from_output(so, ex.execute(so), t + 1)
        t += 10
    assert sizes[:4] == [[8], [8], [8], [5]]  # 29 prompt tokens in chunks of 8
    assert req.output_token_ids == reference(req.prompt_token_ids, 3)
    assert req.first_scheduled_time == 100.0
    assert req.first_token_time == 131.0
    assert req.token_times == [131.0, 141.0, 151.0]


@pytest.mark.parametrize("mode", [PreemptMode.RECOMPUTE, PreemptMode.OFFLOAD])
def test_fcfs_last_preempts_most_recent_and_outputs_survive(mode):
    bs = 2
    sched = Scheduler(
        8, 16, block_size=bs, max_num_seqs=4, max_num_batched_tokens=16, policy=FcfsLastPolicy(mode)
    )
    ex = PageStoreExecutor(8, 16, bs, cached=sched.blocks.device.is_cached)
    a = Request("a", [1, 2, 3], 8, 0.0)
    b = Request("b", [4, 5, 6], 8, 0.0)
    finished, _ = drive(sched, ex, {0: [a], 1: [b]})
    assert set(finished) == {"a", "b"}
    assert a.output_token_ids == reference(a.prompt_token_ids, 8)
    assert b.output_token_ids == reference(b.prompt_token_ids, 8)
    # 3+8 tokens each need 6 blocks of 2; 8 blocks hold only one: b (admitted last) is the victim.
    assert a.num_preemptions == 0 and b.num_preemptions >= 1
    assert sched.num_offload_preemptions == (b.num_preemptions if mode.value == "offload" else 0)
    assert len(b.resume_times) == b.num_preemptions
    sched.blocks.assert_all_free()


def test_recompute_victim_goes_to_front_of_waiting():
    sched = Scheduler(6, 0, block_size=2, max_num_seqs=4, max_num_batched_tokens=16)
    a = Request("a", [1, 2, 3, 4], 6, 0.0)
    b = Request("b", [5, 6], 6, 0.0)
    c = Request("c", [7] * 10, 1, 0.0)  # too big to admit while a and b run
    for r in (a, b, c):
        sched.add_request(r)
    ex = PageStoreExecutor(6, 0, 2)
    for step in range(20):
        so = sched.schedule(float(step))
        if so.preemptions:
            assert so.preemptions == [("b", PreemptMode.RECOMPUTE)]
            assert list(sched.waiting)[:2] == [b, c]
            assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
            break
        sched.update_from_output(so, ex.execute(so), float(step))
    else:
        pytest.fail("no preemption happened")


def test_offload_falls_back_to_recompute_without_host_blocks():
    sched = Scheduler(
        8, 0, block_size=2, max_num_seqs=4, policy=FcfsLastPolicy(PreemptMode.OFFLOAD)
    )
    ex = PageStoreExecutor(8, 0, 2)
    a = Request("a", [1, 2, 3], 8, 0.0)
    b = Request("b", [4, 5, 6], 8, 0.0)
    drive(sched, ex, {0: [a], 1: [b]})
    assert sched.num_preemptions >= 1 and sched.num_offload_preemptions == 0
    assert b.output_token_ids == reference(b.prompt_token_ids, 8)


@pytest.mark.parametrize("seed", range(12))
def test_randomized_invariants_and_outputs(seed):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_dev = rng.randint(12, 24) // bs * 1 + 6
    num_host = rng.choice([0, 4, 40])
    policy = rng.choice([FcfsLastPolicy(), FcfsLastPolicy(PreemptMode.OFFLOAD), RandomPolicy(seed)])
    sched = Scheduler(
        num_dev,
        num_host,
        block_size=bs,
        max_num_seqs=rng.randint(1, 6),
        max_num_batched_tokens=rng.randint(4, 24),
        policy=policy,
    )
    cap = num_dev * bs
    arrivals = make_requests(rng, 10, max(1, cap // 3), max(1, cap // 3), stop_prob=0.3)
    aborts = []
    ids = [r.request_id for rs in arrivals.values() for r in rs]
    for rid in rng.sample(ids, 2):
        aborts.append((rng.randint(0, 30), rid))
    ex = PageStoreExecutor(num_dev, num_host, bs, cached=sched.blocks.device.is_cached)
    finished, by_id = drive(sched, ex, arrivals, abort_at=aborts)
    aborted = {rid for _, rid in aborts}
    for rid, req in by_id.items():
        if rid in finished:
            want = reference(req.prompt_token_ids, req.max_tokens, req.stop_token_ids)
            assert req.output_token_ids == want, (rid, req.num_preemptions)
        else:
            assert rid in aborted and req.status == RequestStatus.FINISHED_ABORTED
    sched.blocks.assert_all_free()
    assert not sched.has_work()
    if isinstance(policy, RandomPolicy):
        assert policy.finished == len(by_id)


def test_policy_choosing_non_running_request_is_an_error():
    class Bad(VictimPolicy):
        name = "bad"

        def select_victims(self, view):
            return [(view.waiting[0] if view.waiting else view.running[0], PreemptMode.RECOMPUTE)]

    sched = Scheduler(4, 0, block_size=2, max_num_seqs=4, policy=Bad())
    ex = PageStoreExecutor(4, 0, 2)
    sched.add_request(Request("a", [1, 2, 3], 5, 0.0))
    sched.add_request(Request("b", [1], 5, 0.0))
    sched.add_request(Request("c", [1, 2, 3, 4, 5, 6, 7], 1, 0.0))
    with pytest.raises(ValueError, match="not running"):
        for step in range(20):
            so = sched.schedule(float(step))
            sched.update_from_output(so, ex.execute(so), float(step))


def test_bad_requests_are_rejected_with_reasons():
    sched = Scheduler(4, 0, block_size=2)
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(Request("x", [1] * 6, 3, 0.0))
    with pytest.raises(ValueError, match="empty prompt"):
        Request("y", [], 3, 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("z", [1], 0, 0.0)
    sched.add_request(Request("ok", [1], 1, 0.0))
    with pytest.raises(ValueError, match="duplicate"):
        sched.add_request(Request("ok", [1], 1, 0.0))


def test_block_pool_rejects_double_free_and_overallocation():
    pool = BlockPool(4, "device")
    blocks = pool.allocate("a", 3)
    with pytest.raises(BlockAccountingError, match="only 1 free"):
        pool.allocate("b", 2)
    pool.free("a", blocks)
    with pytest.raises(BlockAccountingError, match="nobody holds"):
        pool.free("a", blocks[:1])


def test_block_pool_copies_of_one_prefix_stay_findable_in_registration_order():
    # One block per prefix is the usual case; a recomputed or restored copy duplicates one.
    # The first registered copy is found until it is evicted, then the next; a bulk
    # registration (a prompt's blocks) and one by one agree.
    pool = BlockPool(12, "device")
    blocks = pool.allocate("a", 6)
    pool.register_many(blocks, ["p0", "p1", "p2", "p3", "p4", "p5"])  # bulk path
    again = pool.allocate("b", 3)
    pool.register(again[0], "p1")
    pool.register_many(again[1:], ["p2", "p9"])  # one copy more of p2, a new p9
    pool.register(blocks[0], "other")  # a block keeps its first key
    pool.check({"a": blocks, "b": again})
    assert [pool.cached_block(h) for h in ("p0", "p1", "p2", "p9")] == [
        blocks[0],
        blocks[1],
        blocks[2],
        again[2],
    ]
    pool.free("a", blocks)
    pool.allocate("c", 3 + 3)  # the 3 never-used blocks, then a's first three (evicted)
    assert pool.cached_block("p0") is None
    assert (pool.cached_block("p1"), pool.cached_block("p2")) == (again[0], again[1])
    assert pool.cached_block("p3") == blocks[3] and pool.num_cached == 3 + 3
    other = BlockPool(5, "device")
    held = other.allocate("d", 5)
    other.free("d", held[4:])
    with pytest.raises(BlockAccountingError, match="unowned"):
        other.register_many(held, ["r0", "r1", "r2", "r3", "r4"])  # the last one is free


def test_in_flight_blocks_are_not_reused_until_copy_completes():
    mgr = KVBlockManager(4, 4, block_size=2)
    mgr.grow("a", 8)
    pairs = mgr.begin_offload("a")
    assert mgr.device.num_free == 0 and mgr.device.num_in_flight == 4
    with pytest.raises(BlockAccountingError):
        mgr.grow("b", 2)
    mgr.check_invariants()
    mgr.complete_offload(pairs)
    assert mgr.device.num_free == 4
    back = mgr.begin_restore("a")
    assert [(h, d) for h, d in back] and mgr.host.num_in_flight == 4
    mgr.complete_restore(back)
    mgr.free("a")
    mgr.assert_all_free()


def test_chunk_token_slices():
    """Chunks slice ``prompt + output`` without building it; decodes carry the last token."""
    sched = Scheduler(num_device_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=3)
    sched.add_request(Request("r", [5, 6, 7, 8], max_tokens=3, arrival_time=0.0))
    seen = []
    while sched.has_unfinished():
        so = sched.schedule(0.0)
        seen += [(c.start, c.token_ids, c.sample, c.num_output_tokens) for c in so.chunks]
        sched.update_from_output(so, ExecutorOutput(sampled={"r": 9}), 0.0)
    # prefill in chunks of 3 + 1 (the budget), then two decodes of the sampled 9s.
    assert seen == [(0, (5, 6, 7), False, 0), (3, (8,), True, 0), (4, (9,), True, 1),
                    (5, (9,), True, 2)]  # fmt: skip
    # A chunk that spans the end of the prompt and the outputs (after a recompute preemption).
    req = Request("s", [1, 2, 3], max_tokens=4, arrival_time=0.0, output_token_ids=[4, 5])
    req.num_computed_tokens = 1
    assert sched._chunk(req, 4).token_ids == (2, 3, 4, 5)
    assert sched._chunk(req, 2).token_ids == (2, 3)
    req.num_computed_tokens = 3
    assert sched._chunk(req, 2).token_ids == (4, 5)


# ---- prefix caching ------------------------------------------------------------------------


def shared_prefix_requests(rng, n, cap, vocab=VOCAB):
    """Requests drawn from a few shared system prompts, some re-sending an earlier request's
    whole context (prompt + its reference output) plus new tokens, as a next turn does."""
    systems = [[rng.randrange(vocab) for _ in range(rng.randint(1, cap // 3))] for _ in range(2)]
    made: list[Request] = []
    arrivals: dict[int, list[Request]] = {}
    for i in range(n):
        if made and rng.random() < 0.4:
            prev = rng.choice(made)
            context = prev.prompt_token_ids + reference(prev.prompt_token_ids, prev.max_tokens)
        else:
            context = list(rng.choice(systems))
        prompt = context + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
        prompt = prompt[: max(1, cap // 2)]
        max_tokens = rng.randint(1, max(1, min(cap // 3, cap - len(prompt))))
        req = Request(f"r{i}", prompt, max_tokens, 0.0)
        made.append(req)
        arrivals.setdefault(rng.randint(0, 3 * n), []).append(req)
    return arrivals


def run_shared(seed: int, prefix_caching: bool, mode: PreemptMode, policy_kind: str):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    num_dev = rng.randint(16, 40) // bs + 6
    num_host = 64 if mode == PreemptMode.OFFLOAD else 0
    policy = RandomPolicy(seed) if policy_kind == "random" else FcfsLastPolicy(mode)
    sched = Scheduler(
        num_dev,
        num_host,
        block_size=bs,
        max_num_seqs=rng.randint(2, 6),
        max_num_batched_tokens=rng.randint(4, 24),
        policy=policy,
        enable_prefix_caching=prefix_caching,
    )
    arrivals = shared_prefix_requests(rng, 10, num_dev * bs)
    ex = PageStoreExecutor(num_dev, num_host, bs, cached=sched.blocks.device.is_cached)
    finished, by_id = drive(sched, ex, arrivals)
    assert set(finished) == set(by_id)
    sched.blocks.assert_all_free()  # every page back (cached ones sit in the free queue)
    return {rid: r.output_token_ids for rid, r in by_id.items()}, sched, by_id


@given(
    seed=st.integers(0, 10_000),
    mode=st.sampled_from(list(PreemptMode)),
    policy_kind=st.sampled_from(["fcfs_last", "random"]),
)
@settings(max_examples=60, deadline=None, derandomize=True)
def test_property_prefix_caching_is_exact_under_preemption(seed, mode, policy_kind):
    """Shared and re-sent prefixes, recompute and offload preemption, random victims: outputs
    with caching on equal the unpaged reference and the outputs with caching off; the block
    invariants hold after every step and nothing leaks."""
    on, sched, by_id = run_shared(seed, True, mode, policy_kind)
    off, _, _ = run_shared(seed, False, mode, policy_kind)
    assert on == off
    for rid, req in by_id.items():
        assert req.output_token_ids == reference(req.prompt_token_ids, req.max_tokens), rid


def test_prefix_hits_skip_prefill():
    bs = 4
    sched = Scheduler(16, 0, block_size=bs, max_num_seqs=4, max_num_batched_tokens=64)
    ex = PageStoreExecutor(16, 0, bs, cached=sched.blocks.device.is_cached)
    system = list(range(1, 13))  # 3 full blocks
    a = Request("a", system + [50, 51], 3, 0.0)
    drive(sched, ex, {0: [a]})
    assert sched.blocks.prefix_hits == 0 and sched.blocks.prefix_queries == 14
    # b shares a's 3 full system blocks: only its last 2 tokens are prefilled.
    b = Request("b", system + [60, 61], 3, 0.0)
    sched.add_request(b)
    so = sched.schedule(10.0)
    (chunk,) = so.prefills
    assert (chunk.start, chunk.num_tokens) == (12, 2)
    sched.update_from_output(so, ex.execute(so), 10.5)
    assert sched.blocks.prefix_hits == 12 and sched.stats()["prefix_cache_hits"] == 12
    while sched.has_work():
        so = sched.schedule(11.0)
        sched.update_from_output(so, ex.execute(so), 11.5)
    assert b.output_token_ids == reference(b.prompt_token_ids, 3)
    sched.blocks.assert_all_free()


def test_recompute_victims_find_their_blocks_again():
    """Over random runs, some recompute victim resumes past its first token (its cached blocks
    were still there), and the hit rate is positive."""
    resumed_from_cache = 0
    for seed in range(8):
        _, sched, by_id = run_shared(seed, True, PreemptMode.RECOMPUTE, "fcfs_last")
        assert sched.blocks.prefix_hit_rate > 0
        for req in by_id.values():
            if req.num_preemptions:
                resumed_from_cache += 1
    assert resumed_from_cache > 0


def test_free_queue_evicts_least_recently_freed_and_tail_blocks_first():
    mgr = KVBlockManager(6, 0, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], 1, 0.0)  # 3 full blocks + 1 partial
    mgr.grow("a", 7)
    a.num_computed_tokens = 7
    mgr.cache_computed(a)
    assert mgr.device.num_cached == 3
    table = mgr.device_table("a")
    mgr.free("a")
    # The 2 never-used blocks leave first, then a's blocks, last block first.
    order = mgr.device.allocate("x", 6)
    assert order[:2] == [4, 5] and order[2:] == list(reversed(table))
    assert mgr.device.num_cached == 0  # all evicted on reuse
    mgr.device.free("x", order)
    mgr.assert_all_free()


def test_shared_blocks_are_reference_counted():
    mgr = KVBlockManager(8, 0, block_size=2)
    a = Request("a", [1, 2, 3, 4, 9], 1, 0.0)
    b = Request("b", [1, 2, 3, 4, 8], 1, 0.0)
    mgr.take_prefix(a, mgr.lookup_prefix(a))
    mgr.grow("a", 5)
    a.num_computed_tokens = 5
    mgr.cache_computed(a)
    hits = mgr.lookup_prefix(b)
    assert hits == mgr.device_table("a")[:2] and mgr.device.num_free_among(hits) == 0
    mgr.take_prefix(b, hits)
    mgr.grow("b", 5)
    assert [mgr.device.ref_count(x) for x in hits] == [2, 2]
    mgr.check_invariants()
    mgr.free("a")
    assert [mgr.device.ref_count(x) for x in hits] == [1, 1]
    mgr.free("b")
    mgr.assert_all_free()
    with pytest.raises(BlockAccountingError, match="nobody holds"):
        mgr.device.free("b", hits[:1])
    # Freed but cached: found again, and a hit on a free block uses up a free slot.
    assert mgr.lookup_prefix(b) == hits and mgr.device.num_free_among(hits) == 2
    assert mgr.prefix_hit_rate == 4 / 10


def test_caching_off_never_hits():
    mgr = KVBlockManager(8, 0, block_size=2, enable_prefix_caching=False)
    a = Request("a", [1, 2, 3, 4, 9], 1, 0.0)
    mgr.grow("a", 5)
    a.num_computed_tokens = 5
    mgr.cache_computed(a)
    assert mgr.device.num_cached == 0 and mgr.lookup_prefix(a) == []


def test_salt_separates_equal_tokens():
    mgr = KVBlockManager(8, 0, block_size=2)
    a = Request("a", [1] * 5, 1, 0.0, cache_salt="s1")
    mgr.grow("a", 5)
    a.num_computed_tokens = 5
    mgr.cache_computed(a)
    assert mgr.lookup_prefix(Request("b", [1] * 5, 1, 0.0, cache_salt="s2")) == []
    assert len(mgr.lookup_prefix(Request("c", [1] * 5, 1, 0.0, cache_salt="s1"))) == 2


def test_restore_shares_blocks_still_cached_on_the_device():
    mgr = KVBlockManager(6, 6, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5], 1, 0.0)
    mgr.grow("a", 5)
    a.num_computed_tokens = 5
    mgr.cache_computed(a)
    table = list(mgr.device_table("a"))
    pairs = mgr.begin_offload("a")
    mgr.complete_offload(pairs)
    hits = mgr.lookup_prefix(a, a.num_computed_tokens)
    assert hits == table[:2]  # the two full blocks; the partial third is copied back
    back = mgr.begin_restore("a", hits)
    assert len(back) == 1 and mgr.device_table("a")[:2] == hits
    assert mgr.restore_hit_blocks == 2 and mgr.host.num_in_flight == 1
    mgr.check_invariants()
    mgr.complete_restore(back)
    mgr.free("a")
    mgr.assert_all_free()
