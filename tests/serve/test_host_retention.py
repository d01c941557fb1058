"""What the host cache level keeps (serve_jax.host_retention and its use in kv_blocks)."""

from __future__ import annotations

import dataclasses

import pytest

from serve_jax.host_retention import ReuseEstimator
from serve_jax.kv_blocks import KVBlockManager
from serve_jax.scheduler import Request
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import agentic_workload, load_trace


def test_estimator_learns_that_unreused_keys_are_not_worth_demoting():
    est = ReuseEstimator(horizon=4, threshold=0.2, decay=1.0)
    assert est.estimate("fresh") == 0.0 and not est.worth_demoting("fresh")  # no evidence yet
    est.freed(["a", "b"], "fresh")
    est.looked_up(["a", "b", "c"], on_device=0)
    assert est.reused["fresh"] == 2 and est.estimate("fresh") == pytest.approx(2 / 3)
    assert est.worth_demoting("fresh")
    est.freed(range(12), "fresh")  # 8 keys pushed out unused
    assert est.expired["fresh"] == 8 and est.estimate("fresh") == pytest.approx(2 / 11)
    assert not est.worth_demoting("fresh")
    # Another class is measured on its own.
    assert est.estimate("continued") == 0.0
    # With nobody waiting for device memory a demotion delays nobody: every class goes.
    assert est.worth_demoting("continued", contended=False)


def test_estimator_counts_only_an_unbroken_run_past_the_device_prefix():
    est = ReuseEstimator(horizon=100, decay=1.0)
    est.freed(["k0", "k1", "k2", "k4"], "fresh")
    # k0 on the device (no verdict, leaves the shadow), k1-k2 needed from the host, k3 missing
    # breaks the run: k4 could not have been promoted.
    est.looked_up(["k0", "k1", "k2", "k3", "k4"], on_device=1)
    assert est.reused["fresh"] == 2 and est.expired["fresh"] == 0
    assert est.estimate("fresh") == pytest.approx(2 / 3)
    est.looked_up(["k0"], on_device=0)  # gone from the shadow: no second verdict
    assert est.reused["fresh"] == 2


def test_estimator_rejects_bad_settings():
    with pytest.raises(ValueError, match="threshold"):
        ReuseEstimator(10, threshold=1.5)
    with pytest.raises(ValueError, match="decay"):
        ReuseEstimator(10, decay=0.0)
    with pytest.raises(ValueError, match="reuse class"):
        ReuseEstimator(10).freed(["k"], "other")
    with pytest.raises(ValueError, match="host_retention"):
        KVBlockManager(4, 4, 2, host_caching=True, host_retention="lru")


def _run_and_free(mgr: KVBlockManager, req: Request) -> int:
    """Admits ``req`` from the cache, computes it, finishes it; returns the blocks demoted."""
    hits, host = mgr.lookup(req)
    mgr.complete_restore(mgr.take_prefix(req, hits, host))
    mgr.grow(req.request_id, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_computed(req)
    mgr.free(req.request_id)
    demotions = mgr.take_demotions()
    mgr.complete_offload(demotions)
    return len(demotions)


@pytest.mark.parametrize("retention", ["predicted", "all"])
def test_single_turn_traffic_stops_being_demoted_and_sessions_keep_theirs(retention):
    mgr = KVBlockManager(12, 16, block_size=2, host_caching=True, host_retention=retention)
    # Distinct single-turn prompts (2 full blocks each): nothing is ever looked up again.
    demoted = [_run_and_free(mgr, Request(f"s{i}", [i + 3, 1, 2, 1, 5], 1, 0.0)) for i in range(40)]
    if retention == "all":
        assert demoted == [2] * 40
    else:  # no reuse is ever seen: nothing is demoted while memory is contended
        assert sum(demoted) == 0
        assert mgr.retention.expired["fresh"] > 0 and mgr.retention.reused["fresh"] == 0
        mgr.memory_contended = False  # (the scheduler's view: nobody waits for memory)
        assert _run_and_free(mgr, Request("idle", [2, 1, 2, 1, 5], 1, 0.0)) == 2
        mgr.memory_contended = True
    # A session whose turns re-send their context, the device forgetting it between turns:
    # its first turn is freed as the useless single-turn traffic was; the second turn is the
    # first "continued" one (no evidence for the class yet), its reuse by the third turn is,
    # and from then on the turns are demoted and promoted back.
    context = [7, 8, 9, 10]
    turn_demoted = []
    for turn in range(5):
        req = Request(f"t{turn}", context + [11 + turn], 1, 0.0)
        turn_demoted.append(_run_and_free(mgr, req))
        _run_and_free(mgr, Request(f"evict{turn}", [50 + turn] * 24, 1, 0.0))  # fills the device
        context = context + [11 + turn, 60 + turn]
    if retention == "predicted":
        assert turn_demoted[:2] == [0, 0] and all(turn_demoted[2:])
    else:
        assert all(turn_demoted)
    assert mgr.host_hits > 0
    mgr.assert_all_free()


def test_simulator_guided_host_tier_skips_single_turn_traffic():
    """On a single-turn trace nothing comes back: predicted retention demotes only while no
    request waits for memory (and the blocks of recompute victims once their reuse is seen)
    and costs nothing; demoting every freed block holds device blocks in flight for nothing
    and delays admissions."""
    wl = load_trace("azure-code", limit=300)
    base = SimConfig(kv_memory_gb=2.0, host_memory_gb=1.0)
    off = simulate(wl, "fcfs_last", base)
    host = dict(host_prefix_caching=True)
    guided = simulate(wl, "fcfs_last", dataclasses.replace(base, **host))
    every = simulate(wl, "fcfs_last", dataclasses.replace(base, **host, host_retention="all"))
    assert every.demoted_blocks > 3 * guided.demoted_blocks
    assert guided.host_hit_rate == every.host_hit_rate == 0.0
    assert guided.summary["ttft_ms"]["p99"] == pytest.approx(off.summary["ttft_ms"]["p99"])
    assert guided.goodput_req_s == pytest.approx(off.goodput_req_s)
    assert every.summary["ttft_ms"]["p99"] > 1.1 * off.summary["ttft_ms"]["p99"]


def test_simulator_guided_host_tier_keeps_agentic_prefixes():
    wl = agentic_workload(session_rate=0.3, duration_s=120.0, max_context=2000, seed=4)
    base = SimConfig(kv_memory_gb=1.0, host_memory_gb=4.0, max_num_batched_tokens=1024)
    off = simulate(wl, "fcfs_last", base)
    host = dict(host_prefix_caching=True)
    guided = simulate(wl, "fcfs_last", dataclasses.replace(base, **host))
    every = simulate(wl, "fcfs_last", dataclasses.replace(base, **host, host_retention="all"))
    assert guided.completed == every.completed == off.completed == guided.submitted
    # (most of the host hits on a short run that starts with no evidence: 0.055 against 0.086)
    assert guided.host_hit_rate > 0 and guided.host_hit_rate >= 0.5 * every.host_hit_rate
    assert guided.prefix_hit_rate > off.prefix_hit_rate
    assert guided.demoted_blocks < every.demoted_blocks


def _computed(mgr: KVBlockManager, req: Request) -> None:
    mgr.grow(req.request_id, req.num_tokens)
    req.num_computed_tokens = req.num_tokens
    mgr.cache_computed(req)


def test_recompute_victims_blocks_are_demoted_after_the_plan_from_spare_memory_only():
    mgr = KVBlockManager(8, 8, block_size=2, host_caching=True)
    # Recompute victims' blocks have come back before: they are worth demoting. (A victim
    # waits for memory itself, so the estimate decides even when nothing else waits.)
    mgr.memory_contended = False
    mgr.retention.freed(["k"], "preempted")
    mgr.retention.looked_up(["k"], on_device=0)
    assert mgr.retention.worth_demoting("preempted")
    _computed(mgr, Request("b", [9, 9, 9, 9], 1, 0.0))  # 2 blocks
    a = Request("a", [1, 2, 3, 4, 5, 6], 1, 0.0)
    _computed(mgr, a)  # 3 full blocks; 3 blocks free
    table = list(mgr.device_table("a"))
    mgr.free_device("a")  # a recompute preemption: nothing is held in flight yet
    assert mgr.device.num_in_flight == 0 and mgr.device.num_free == 6
    # The step's plan takes 4 blocks: the 3 free ones, then a's last block (evicting it).
    taken = mgr.grow("c", 8)
    assert table[2] in taken
    # Of a's 2 blocks still free and cached, one is demoted: the next step needs the other.
    demotions = mgr.take_demotions(keep_free=1)
    assert demotions and [d for d, _ in demotions] == [table[1]]
    assert mgr.device.num_in_flight == 1 and mgr.device.num_free == 1
    mgr.check_invariants()
    mgr.complete_offload(demotions)
    for rid in "abc":
        mgr.free(rid)
    mgr.complete_offload(mgr.take_demotions())
    mgr.assert_all_free()


def test_guided_host_cache_evicts_the_class_least_likely_reused_first():
    mgr = KVBlockManager(8, 2, block_size=2, host_caching=True)
    mgr.memory_contended = False
    # Recompute victims' blocks have been reused, fresh requests' never.
    mgr.retention.freed(["k"], "preempted")
    mgr.retention.looked_up(["k"], on_device=0)
    assert mgr.retention.estimate("preempted") > mgr.retention.estimate("fresh") == 0.0

    def demote(rid, prompt, finished):
        req = Request(rid, prompt, 1, 0.0)
        _computed(mgr, req)  # 1 full block
        mgr.free_device(rid, finished=finished)
        mgr.complete_offload(mgr.take_demotions())
        mgr.free(rid)
        return mgr.block_hashes(req, 1)[0]

    victim = demote("p", [1, 2, 9], finished=False)  # the host's least recently used block
    fresh = demote("f", [3, 4, 9], finished=True)
    demote("q", [5, 6, 9], finished=True)  # the host is full: one block must go
    assert mgr.host.cached_block(victim) is not None  # (least recently used, but valued)
    assert mgr.host.cached_block(fresh) is None
    mgr.assert_all_free()


def test_a_recompute_victim_is_demoted_only_when_its_class_is_worth_it():
    """A recompute victim waits for device memory itself: the last plan's quiet queue does not
    let its blocks past the estimate."""
    mgr = KVBlockManager(8, 8, block_size=2, host_caching=True)
    mgr.memory_contended = False  # nothing else waited at the last plan
    assert not mgr.retention.worth_demoting("preempted")  # (no reuse seen yet)
    assert mgr.retention.worth_demoting("preempted", contended=False)
    _computed(mgr, Request("a", [1, 2, 3, 4], 1, 0.0))
    mgr.free_device("a")  # a recompute preemption
    assert mgr.take_demotions() == [] and mgr.demoted_blocks == 0
    mgr.free("a")
    mgr.assert_all_free()
