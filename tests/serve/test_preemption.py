"""Victim policies on hand-built scheduler states: exact victims and modes; admission gating."""

from __future__ import annotations

import pytest

from serve_jax.predictor import RemainingLengthPredictor
from serve_jax.preemption import (
    FcfsLastPolicy,
    FewestOutputPolicy,
    LeastComputedPolicy,
    PredictivePolicy,
    get_policy,
    predicted_peak_tokens,
)
from serve_jax.scheduler import (
    ExecutorOutput,
    LinearCostHints,
    PreemptMode,
    Request,
    RequestStatus,
    Scheduler,
    SchedulerView,
)

BS = 16
R, OFF = PreemptMode.RECOMPUTE, PreemptMode.OFFLOAD


def running(rid: str, prompt: int, out: int, seq: int) -> Request:
    r = Request(rid, [1] * prompt, max_tokens=4000, arrival_time=0.0)
    r.output_token_ids = [1] * out
    r.num_computed_tokens = prompt + out - 1  # the last sampled token is not in the cache yet
    r.status = RequestStatus.RUNNING
    r.admission_seq = seq
    return r


@pytest.fixture
def reqs():
    # A: 150 tokens (10 blocks), B: 25 (2), C: 305 (20), D: 210 (14); admitted A, B, C, D.
    return [
        running("A", 100, 50, 0),
        running("B", 20, 5, 1),
        running("C", 300, 5, 2),
        running("D", 10, 200, 3),
    ]


def view(reqs, needed, *, free=0, host=0, costs=None) -> SchedulerView:
    return SchedulerView(
        step=7,
        now=1.0,
        block_size=BS,
        free_device_blocks=free,
        free_host_blocks=host,
        blocks_needed=needed,
        running=tuple(reqs),
        waiting=(),
        offloaded=(),
        costs=costs or LinearCostHints(),
        device_blocks_held={r.request_id: -(-r.num_tokens // BS) for r in reqs},
    )


def ids(victims):
    return [(r.request_id, m) for r, m in victims]


def test_fcfs_last_takes_the_last_admitted(reqs):
    assert ids(FcfsLastPolicy().select_victims(view(reqs, 1))) == [("D", R)]
    assert ids(FcfsLastPolicy(PreemptMode.OFFLOAD).select_victims(view(reqs, 1))) == [("D", OFF)]


def test_fewest_output_is_sglang_retract(reqs):
    pol = FewestOutputPolicy()
    # B and C have the fewest outputs (5); the longer prompt (C) goes first. C frees 20 blocks:
    # 19 spare blocks = 304 tokens >= 3 requests * 20 steps, so retraction stops.
    assert ids(pol.select_victims(view(reqs, 1))) == [("C", R)]
    # 25 blocks short: C (20), B (2) are not enough; A (10) covers it with 7*16 >= 1*20 spare.
    assert ids(pol.select_victims(view(reqs, 25))) == [("C", R), ("B", R), ("A", R)]
    # Never retracts the last request.
    assert ids(pol.select_victims(view(reqs, 500))) == [("C", R), ("B", R), ("A", R)]
    # The 20-step buffer: 18 short, C leaves 2 spare blocks = 32 tokens < 3 * 20 -> B too.
    assert ids(pol.select_victims(view(reqs, 18))) == [("C", R), ("B", R)]


def test_least_computed_takes_the_cheapest_recompute(reqs):
    pol = LeastComputedPolicy()
    assert ids(pol.select_victims(view(reqs, 1))) == [("B", R)]
    assert ids(pol.select_victims(view(reqs, 5))) == [("B", R), ("A", R)]


def test_predicted_peak_by_hand():
    items = [(150, 950), (25, 995), (305, 995), (210, 800)]
    # Sorted by remaining: 25+995, 330+2*995, 480+3*950, 690+4*800 -> 3890.
    assert predicted_peak_tokens(items) == 3890
    assert predicted_peak_tokens([(100, 1)]) == 101
    assert predicted_peak_tokens([]) == 0


def trained_policy(length: int = 1000, **kw) -> PredictivePolicy:
    pred = RemainingLengthPredictor()
    for _ in range(4000):
        pred.observe(64, length)
    return PredictivePolicy(pred, **kw)


def test_predictive_frees_memory_that_lasts(reqs):
    # Remaining (1000 - output): A 950, B 995, C 995, D 800 (up to shrinkage, < 1 token).
    pol = trained_policy()
    # 200 free + 46 held blocks = 3936 tokens; the peak of all four is ~3890 so one victim (the
    # shortfall) is enough: the longest remaining, fewer computed tokens on ties -> B.
    assert ids(pol.select_victims(view(reqs, 1, free=200))) == [("B", R)]
    # With 100 free blocks (2336 tokens) the peak must drop below it too: without B the peak
    # is 3065; without B and C it is max(150 + 950, 360 + 2 * 800) = 1960, which fits.
    got = ids(pol.select_victims(view(reqs, 1, free=100)))
    rest = [r for r in reqs if r.request_id not in {g for g, _ in got}]
    items = [(r.num_tokens, 1000 - r.num_output_tokens) for r in rest]
    assert got == [("B", R), ("C", R)]
    assert predicted_peak_tokens(items) <= (100 + 46) * BS


def test_predictive_chooses_offload_or_recompute_per_victim(reqs):
    cheap_link = LinearCostHints(prefill_base=0, prefill_per_token=1e-4, transfer_base=0,
                                 transfer_per_block=2e-4)  # fmt: skip
    slow_link = LinearCostHints(prefill_base=0, prefill_per_token=1e-4, transfer_base=0,
                                transfer_per_block=1e-2)  # fmt: skip
    pol = trained_policy()
    assert ids(pol.select_victims(view(reqs, 1, free=200, host=100, costs=cheap_link))) == [
        ("B", OFF)
    ]
    assert ids(pol.select_victims(view(reqs, 1, free=200, host=100, costs=slow_link))) == [("B", R)]
    # No room on the host: recompute whatever the costs.
    assert ids(pol.select_victims(view(reqs, 1, free=200, host=1, costs=cheap_link))) == [("B", R)]
    assert ids(trained_policy(allow_offload=False).select_victims(
        view(reqs, 1, free=200, host=100, costs=cheap_link))) == [("B", R)]  # fmt: skip


def _step(sched, now):
    out = sched.schedule(now)
    res = ExecutorOutput(sampled={c.request_id: 1 for c in out.chunks if c.sample})
    sched.update_from_output(out, res, now)
    return out


def test_admission_hook_holds_back_what_would_not_last():
    # 20 blocks = 320 tokens; the predictor expects 200 output tokens per request, so two
    # requests of 32 tokens would peak at 64 + 2 * 200 = 464 tokens: only one is admitted.
    def make(cls, policy):
        s = cls(num_device_blocks=20, block_size=BS, max_num_batched_tokens=64, policy=policy)
        for i in range(2):
            s.add_request(Request(f"r{i}", [1] * 32, max_tokens=250, arrival_time=0.0))
        return s

    gated = make(Scheduler, trained_policy(200))
    out = _step(gated, 0.0)
    assert [c.request_id for c in out.prefills] == ["r0"]
    assert [r.request_id for r in gated.waiting] == ["r1"]
    ungated = make(Scheduler, trained_policy(200, gate=False))
    out = _step(ungated, 0.0)
    assert [c.request_id for c in out.prefills] == ["r0", "r1"]
    # A policy without an admission limit (the hook's default) admits what fits.
    fcfs = make(Scheduler, FcfsLastPolicy())
    assert [c.request_id for c in _step(fcfs, 0.0).prefills] == ["r0", "r1"]
    # r0 really runs 250 tokens, past every completed length (200): r1, admitted when r0 was
    # predicted to end, is preempted once (the longest predicted remaining) and then held back
    # until r0 is done instead of being re-admitted in the same step (no cascade).
    r0, r1 = gated.requests["r0"], gated.requests["r1"]
    t = 0.0
    while gated.has_unfinished():
        t += 0.01
        _step(gated, t)
        gated.check_invariants()
    assert gated.num_preemptions == 1 and r1.num_preemptions == 1
    assert r1.resume_times[0] > r0.finish_time
    assert r0.num_output_tokens == r1.num_output_tokens == 250
    gated.blocks.assert_all_free()


def test_no_admission_after_preemption_rule():
    # vLLM V1: a step that preempted admits nobody, so the victim cannot come straight back.
    s = Scheduler(num_device_blocks=4, block_size=BS, max_num_batched_tokens=64,
                       no_admission_after_preemption=True)  # fmt: skip
    for i in range(2):
        s.add_request(Request(f"r{i}", [1] * 24, max_tokens=30, arrival_time=0.0))
    t = 0.0
    while s.has_unfinished():
        t += 0.01
        out = _step(s, t)
        if out.preemptions:
            victims = {rid for rid, _ in out.preemptions}
            assert not victims & {c.request_id for c in out.prefills}
        s.check_invariants()
    assert s.num_preemptions >= 1
    s.blocks.assert_all_free()


def test_get_policy_names():
    for name in ("fcfs_last", "fewest_output", "least_computed", "predictive"):
        assert get_policy(name).name == name
    assert get_policy("predictive_nogate").name == "predictive_nogate"
    with pytest.raises(ValueError, match="unknown policy 'lifo'"):
        get_policy("lifo")


def test_cost_aware_gate_admits_when_recompute_is_cheap():
    # Same state as above (two 32-token requests, peak 464 > 320 tokens), but a recompute of the
    # newcomer's ~232 predicted tokens costs 0.232 ms against a 1 ms+ decode step: admitted.
    cheap = LinearCostHints(prefill_base=0.0, prefill_per_token=1e-6)
    dear = LinearCostHints(prefill_base=0.0, prefill_per_token=1e-3)
    for costs, admitted in ((cheap, ["r0", "r1"]), (dear, ["r0"])):
        s = Scheduler(num_device_blocks=20, block_size=BS, max_num_batched_tokens=64,
                           policy=trained_policy(200, cheap_preemption_steps=1.0),
                           costs=costs)  # fmt: skip
        for i in range(2):
            s.add_request(Request(f"r{i}", [1] * 32, max_tokens=250, arrival_time=0.0))
        assert [c.request_id for c in _step(s, 0.0).prefills] == admitted
    with pytest.raises(ValueError, match="cheap_preemption_steps"):
        PredictivePolicy(cheap_preemption_steps=-1)
