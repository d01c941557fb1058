"""The host pool as a second prefix-cache level (serve_jax.kv_blocks host_caching)."""

from __future__ import annotations

import random

import pytest

from serve_jax.interface import ExecutorOutput
from serve_jax.kv_blocks import KVBlockManager
from serve_jax.scheduler import Request, Scheduler
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import agentic_workload


def _computed(mgr: KVBlockManager, req: Request) -> None:
    """Grows ``req`` to hold its tokens and marks them computed (as a prefill would)."""
    mgr.grow(req.request_id, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_computed(req)


def _land(mgr: KVBlockManager, offloads=(), restores=()) -> None:
    mgr.complete_offload(offloads)
    mgr.complete_restore(restores)


def test_freed_blocks_are_demoted_and_promoted_back():
    mgr = KVBlockManager(4, 8, block_size=2, host_caching=True, host_retention="all")
    a = Request("a", [1, 2, 3, 4, 5], 1, 0.0)
    _computed(mgr, a)  # 3 blocks, 2 full (cached)
    mgr.free("a")
    demotions = mgr.take_demotions()
    assert len(demotions) == 2 and mgr.demoted_blocks == 2
    assert mgr.device.num_in_flight == 2  # copied out before they can be reused
    mgr.check_invariants()
    _land(mgr, offloads=demotions)
    # Another request evicts every device block; the prefix survives on the host.
    filler = Request("f", [9] * 8, 1, 0.0)
    _computed(mgr, filler)
    mgr.free("f")
    _land(mgr, offloads=mgr.take_demotions())
    b = Request("b", [1, 2, 3, 4, 5, 6], 1, 0.0)
    hits, host = mgr.lookup(b)
    assert hits == [] and len(host) == 2
    restores = mgr.take_prefix(b, hits, host)
    assert [h for h, _ in restores] == host
    assert mgr.host_hits == 4 and mgr.prefix_hits == 4
    mgr.check_invariants()
    _land(mgr, restores=restores)
    # The promoted blocks are cached on the device again, and the host copies stay cached.
    c = Request("c", [1, 2, 3, 4, 7], 1, 0.0)
    assert len(mgr.lookup_prefix(c)) == 2
    mgr.free("b")
    _land(mgr, offloads=mgr.take_demotions())  # (b's blocks are on the host already)
    mgr.assert_all_free()


def test_second_offload_shares_the_host_copies_of_the_first():
    mgr = KVBlockManager(8, 8, block_size=2, host_caching=True)
    a = Request("a", [1, 2, 3, 4, 5], 1, 0.0)
    _computed(mgr, a)  # 3 blocks, 2 full
    first = mgr.begin_offload("a")
    assert len(first) == 3 and mgr.offload_hit_blocks == 0
    _land(mgr, offloads=first)
    _land(mgr, restores=mgr.begin_restore("a"))
    a.output_token_ids.extend([6, 7])
    _computed(mgr, a)  # 4 blocks, 3 full
    second = mgr.begin_offload("a")
    # The first two blocks are on the host already: only the third and the partial one move,
    # and the shared blocks' device copies are free at once.
    host_table = list(mgr.host_tables["a"])
    assert len(host_table) == 4 and [h for _, h in second] == host_table[2:]
    assert host_table[:2] == [h for _, h in first[:2]]
    assert mgr.offload_hit_blocks == 2 and mgr.device.num_in_flight == 2
    mgr.check_invariants()
    _land(mgr, offloads=second)
    back = mgr.begin_restore("a")
    assert [h for h, _ in back] == host_table  # every page comes back
    _land(mgr, restores=back)
    mgr.free("a")
    _land(mgr, offloads=mgr.take_demotions())
    mgr.assert_all_free()


def test_host_cache_evicts_least_recently_used_and_never_pinned_blocks():
    mgr = KVBlockManager(8, 2, block_size=2, host_caching=True, host_retention="all")
    for i, rid in enumerate("xyz"):
        r = Request(rid, [10 + i, 20 + i, 1], 1, 0.0)
        _computed(mgr, r)
        mgr.free(rid)
        _land(mgr, offloads=mgr.take_demotions())

    # Two host blocks: x's block was evicted for z's; y and z are cached.
    def on_host(i):
        r = Request(f"q{i}", [10 + i, 20 + i, 5], 1, 0.0)
        return mgr.host.cached_block(mgr.block_hashes(r, 1)[0]) is not None

    assert not on_host(0) and on_host(1) and on_host(2)
    mgr.assert_all_free()


@pytest.mark.parametrize("retention", ["all", "predicted"])
def test_randomized_scheduler_with_host_cache_keeps_invariants(retention):
    rng = random.Random(0)
    sched = Scheduler(12, 6, block_size=2, max_num_seqs=4, max_num_batched_tokens=8,
                      host_prefix_caching=True, host_retention=retention)  # fmt: skip
    prefixes = [[rng.randrange(3, 50) for _ in range(6)] for _ in range(10)]
    n = 0
    finished = 0
    for step in range(400):
        if n < 60 and rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(3, 50) for _ in range(rng.randint(0, 3))]
            sched.add_request(Request(f"r{n}", prompt, rng.randint(1, 6), float(step)))
            n += 1
        out = sched.schedule(float(step))
        res = ExecutorOutput(
            sampled={c.request_id: rng.randrange(3, 50) for c in out.chunks if c.sample},
            completed_offloads=list(out.offloads),
            completed_restores=list(out.restores),
        )
        finished += sum(e.finished for e in sched.update_from_output(out, res, float(step)))
        sched.check_invariants()
    assert finished == n
    assert sched.blocks.demoted_blocks > 0 and sched.blocks.host_hits > 0  # the level is used
    if retention == "predicted":  # and the estimate saw both verdicts
        est = sched.blocks.retention
        assert sum(est.reused.values()) > 0 and sum(est.expired.values()) > 0
    sched.blocks.assert_all_free()


def test_simulator_host_level_saves_recompute_on_agentic():
    wl = agentic_workload(session_rate=0.3, duration_s=40.0, max_context=2000, seed=4)
    base = SimConfig(kv_memory_gb=1.0, host_memory_gb=1.0, max_num_batched_tokens=1024)
    off = simulate(wl, "fcfs_last", base)
    # (every freed block demoted: on this small host pool few of them come back, and predicted
    # retention, the default, rightly demotes almost none; see test_host_retention.py)
    on = simulate(
        wl,
        "fcfs_last",
        SimConfig(**{**base.__dict__, "host_prefix_caching": True, "host_retention": "all"}),
    )
    assert on.completed == off.completed == on.submitted
    assert off.row()["prefix_hit_rate_host"] == 0.0 and off.demoted_blocks == 0
    assert on.host_hit_rate > 0 and on.demoted_blocks > 0
    assert on.prefix_hit_rate > off.prefix_hit_rate


def test_a_lookup_takes_no_more_blocks_than_its_tokens_allow():
    mgr = KVBlockManager(8, 0, block_size=2)
    a = Request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1, 0.0)
    mgr.grow("a", 8)
    a.num_computed_tokens = 8
    mgr.cache_computed(a)  # 4 full blocks cached
    b = Request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], 1, 0.0)
    assert len(mgr.lookup_prefix(b)) == 4  # (its keys are now memoized for 4 blocks)
    assert len(mgr.lookup_prefix(b, 3)) == 1  # 3 tokens: one full block, not the memo's 4
    assert len(mgr.block_hashes(b, 2)) == 2
    mgr.free("a")
    mgr.assert_all_free()
