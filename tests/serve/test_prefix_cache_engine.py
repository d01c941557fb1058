"""Prefix caching on the JAX engine: exact greedy outputs with caching on and off.

The tiny engine (``tiny_cpu`` preset) serves requests that share system prompts and re-send a
previous request's whole context plus new tokens (a next turn), under preemption by recompute
and by offload. With caching on, admissions skip the prefill of their cached blocks (the KV is
read from the shared pages); the greedy outputs must equal the dense reference and the outputs
with caching off, and every page must come back.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.kv_cache import dense_greedy_generate
from serve_jax.model import init_model
from serve_jax.model_config import get_model_config
from serve_jax.sampling import SamplingParams
from serve_jax.scheduler import FcfsLastPolicy, PreemptMode

MAX_LEN = 128


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("tiny", max_seq_len=MAX_LEN), seed=0)


_REF: dict[tuple, list[int]] = {}


def reference(model, prompt, max_tokens):
    key = (tuple(prompt), max_tokens)
    if key not in _REF:
        _REF[key] = dense_greedy_generate(
            model, list(prompt), max_tokens, max_len=MAX_LEN, min_prefill=32
        )
    return _REF[key]


def run(
    model, prompts, lens, caching: bool, num_blocks: int, mode: PreemptMode, host: bool = False
):
    cfg = load_engine_config(
        "tiny_cpu",
        [
            f"cache.num_device_blocks={num_blocks}",
            f"cache.enable_prefix_caching={caching}",
            f"cache.host_prefix_caching={host}",  # the host pool as a second cache level
        ],
    )
    eng = Engine(cfg, model=model)
    eng.scheduler.policy = FcfsLastPolicy(mode)
    ids = [
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lens)
    ]
    done = {}
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.token_ids)
        eng.scheduler.check_invariants()
    eng.scheduler.blocks.assert_all_free()
    return [done[i] for i in ids], eng.scheduler


def shared_prompts(model, rng, n):
    systems = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 24))] for _ in range(2)]
    prompts, lens = [], []
    for _ in range(n):
        if prompts and rng.random() < 0.4:
            k = rng.randrange(len(prompts))
            context = prompts[k] + reference(model, prompts[k], lens[k])
        else:
            context = list(rng.choice(systems))
        prompts.append((context + [rng.randrange(3, 259) for _ in range(rng.randint(1, 6))])[:60])
        lens.append(rng.randint(1, 12))
    return prompts, lens


@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(14, 28),
    mode=st.sampled_from(list(PreemptMode)),
)
def test_property_caching_on_and_off_give_the_reference(model, seed, num_blocks, mode):
    rng = random.Random(seed)
    prompts, lens = shared_prompts(model, rng, rng.randint(3, 7))
    on, sched_on = run(model, prompts, lens, True, num_blocks, mode)
    off, sched_off = run(model, prompts, lens, False, num_blocks, mode)
    host, sched_host = run(model, prompts, lens, True, num_blocks, mode, host=True)
    assert sched_off.blocks.prefix_hits == 0
    assert on == off == host
    for p, n, out in zip(prompts, lens, on):
        assert out == reference(model, p, n)


def test_host_cache_level_promotes_evicted_prefixes_exactly(model):
    """Turns whose parents' pages were evicted from the device (demoted to the host cache) are
    served from host copies, promoted back: the same greedy outputs as without the host level,
    with host hits and fewer prefilled tokens."""
    rng = random.Random(11)
    firsts = [[rng.randrange(3, 259) for _ in range(rng.randint(20, 36))] for _ in range(5)]
    outs = [reference(model, p, 10) for p in firsts]
    turns = [p + o + [7, 8, 9] for p, o in zip(firsts, outs)]
    prompts = firsts + turns  # every first turn runs (and is evicted) before the next turns
    lens = [10] * 5 + [6] * 5
    results = {}
    for host in (False, True):
        cfg = load_engine_config(
            "tiny_cpu",
            [
                "cache.num_device_blocks=16",
                f"cache.host_prefix_caching={host}",
                "cache.host_retention=all",  # (every page demoted: no reuse evidence needed)
            ],
        )
        eng = Engine(cfg, model=model)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        got = [list(o.token_ids) for o in eng.generate(firsts, params)]
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        for p in turns:
            (o,) = eng.generate([p], params)
            got.append(list(o.token_ids))
            eng.scheduler.check_invariants()
        eng.scheduler.blocks.assert_all_free()
        results[host] = (got, eng.scheduler.blocks)
    for p, n, out in zip(prompts, lens, results[True][0]):
        assert out == reference(model, p, n)
    assert results[True][0] == results[False][0]
    blocks_host, blocks_plain = results[True][1], results[False][1]
    assert blocks_host.demoted_blocks > 0 and blocks_host.host_hits > 0
    assert blocks_host.prefix_hits > blocks_plain.prefix_hits


@pytest.mark.parametrize("mode", list(PreemptMode))
def test_next_turn_reuses_the_cached_context_under_preemption(model, mode):
    """Six requests on 12 pages of 4 tokens (preemptions forced), then a next turn of each:
    turns hit their parents' pages still cached and still match the reference."""
    rng = random.Random(5)
    firsts = [[rng.randrange(3, 259) for _ in range(rng.randint(8, 20))] for _ in range(6)]
    cfg = load_engine_config("tiny_cpu", ["cache.num_device_blocks=12"])
    eng = Engine(cfg, model=model)
    eng.scheduler.policy = FcfsLastPolicy(mode)
    outs = eng.generate(firsts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(firsts, outs):
        assert list(o.token_ids) == reference(model, p, 12)
    assert eng.scheduler.num_preemptions > 0
    turns = [p + list(o.token_ids) + [7, 8] for p, o in zip(firsts, outs)]
    hits_before = eng.scheduler.blocks.prefix_hits
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    for p in reversed(turns):  # the latest finished first: their pages were freed last
        (o,) = eng.generate([p], params)
        assert list(o.token_ids) == reference(model, p, 6)
    assert eng.scheduler.blocks.prefix_hits > hits_before
    eng.scheduler.blocks.assert_all_free()


def test_repeated_offloads_share_host_pages_exactly(model):
    """With the host cache level, a request offloaded again keeps the host pages of its earlier
    offload (shared, not copied twice): the greedy outputs still match the reference."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(4, 8))] for _ in range(5)]
    cfg = load_engine_config(
        "tiny_cpu", ["cache.num_device_blocks=12", "cache.host_prefix_caching=true"]
    )
    eng = Engine(cfg, model=model)
    eng.scheduler.policy = FcfsLastPolicy(PreemptMode.OFFLOAD)
    outs = eng.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference(model, p, 24)
    assert eng.scheduler.num_offload_preemptions > len(prompts)
    assert eng.scheduler.blocks.offload_hit_blocks > 0
    eng.scheduler.blocks.assert_all_free()
