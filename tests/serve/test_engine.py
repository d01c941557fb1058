"""The JAX engine against a dense, unpaged reference: paged attention, batching, preemption.

All engines here use the ``tiny_cpu`` preset, whose fixed padded shapes keep the session to a
couple of compilations of the paged step.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings, strategies as st

from serve_jax.attention import context_attention, paged_attention
from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.kv_cache import dense_greedy_generate
from serve_jax.model import init_model, load_safetensors, save_safetensors
from serve_jax.model_config import get_model_config
from serve_jax.sampling import SamplingParams
from serve_jax.scheduler import FcfsLastPolicy, PreemptMode

MAX_LEN = 128
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("tiny", max_seq_len=MAX_LEN), seed=0)


def make_engine(model, **over):
    overrides = [f"{k}={v}" for k, v in over.items()]
    return Engine(load_engine_config("tiny_cpu", overrides), model=model)


_REF_CACHE: dict[tuple, list[int]] = {}


def reference(model, prompt, max_tokens):
    key = (tuple(prompt), max_tokens)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = dense_greedy_generate(
            model, list(prompt), max_tokens, max_len=MAX_LEN, min_prefill=32
        )
    return _REF_CACHE[key]


def random_prompts(rng, n, lo=2, hi=30):
    return [[rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.mark.parametrize("chunk_tokens", [4, 8, 128])
def test_paged_attention_matches_contiguous_context(chunk_tokens):
    rng = np.random.default_rng(0)
    b, t, h, kv, d, bs, nb, m = 3, 4, 4, 2, 8, 4, 32, 5
    k_pool = jnp.asarray(rng.normal(size=(nb, kv, bs, d)), jnp.float32)  # head-major pages
    v_pool = jnp.asarray(rng.normal(size=(nb, kv, bs, d)), jnp.float32)
    tables = jnp.asarray(rng.permutation(nb)[: b * m].reshape(b, m))
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    # Row 0 stops in the first page: later pages (garbage) must not leak in.
    pos = jnp.asarray([[0, 1, 2, 3], [5, 6, 7, 8], [8, 9, 10, 11]])
    got = paged_attention(q, k_pool, v_pool, tables, pos, chunk_tokens=chunk_tokens)
    # [B, m * bs, KV, D] context built page by page (independently of gather_pages).
    k_ctx = jnp.concatenate([k_pool[tables[:, j]].transpose(0, 2, 1, 3) for j in range(m)], axis=1)
    v_ctx = jnp.concatenate([v_pool[tables[:, j]].transpose(0, 2, 1, 3) for j in range(m)], axis=1)
    want = context_attention(q, k_ctx, v_ctx, pos)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    # Direct softmax for one query: position 5 of row 1 sees context 0..5.
    kk = np.asarray(k_ctx[1, :6, 0])
    s = np.asarray(q[1, 0, 0]) @ kk.T / np.sqrt(d)
    p = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    np.testing.assert_allclose(got[1, 0, 0], p @ np.asarray(v_ctx[1, :6, 0]), atol=1e-5)


def test_batched_greedy_matches_dense_reference(model):
    eng = make_engine(model)
    prompts = random_prompts(random.Random(1), 6)
    outs = eng.generate(prompts, GREEDY)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference(model, p, 10)
        assert o.finish_reason == "length" and o.metrics.num_preemptions == 0
    eng.scheduler.blocks.assert_all_free()


@pytest.mark.parametrize("mode", ["recompute", "offload"])
def test_forced_preemption_keeps_greedy_outputs(model, mode):
    # 12 pages of 4 tokens cannot hold six requests of up to 40 tokens: preemptions are forced.
    eng = make_engine(model, **{"cache.num_device_blocks": 12, "scheduler.preempt_mode": mode})
    prompts = random_prompts(random.Random(2), 6, 8, 24)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = eng.generate(prompts, params)
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference(model, p, 16)
    assert eng.scheduler.num_preemptions > 0
    if mode == "offload":
        assert eng.scheduler.num_offload_preemptions > 0
        assert eng.executor.host.memory_kind == "pinned_host"
    else:
        assert eng.scheduler.num_offload_preemptions == 0
    eng.scheduler.blocks.assert_all_free()


@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(10, 24),
    mode=st.sampled_from(list(PreemptMode)),
)
def test_property_random_mixes_match_reference(model, seed, num_blocks, mode):
    rng = random.Random(seed)
    eng = make_engine(model, **{"cache.num_device_blocks": num_blocks})
    eng.scheduler.policy = FcfsLastPolicy(mode)
    prompts = random_prompts(rng, rng.randint(2, 7), 1, 20)
    lens = [rng.randint(1, 16) for _ in prompts]
    ids = [
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, lens)
    ]
    done = {}
    while eng.has_work():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.scheduler.check_invariants()
    for rid, p, n in zip(ids, prompts, lens):
        assert list(done[rid].token_ids) == reference(model, p, n)
    eng.scheduler.blocks.assert_all_free()


def test_sampling_is_reproducible_and_independent_of_batch(model):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    alone = make_engine(model).generate([prompt], params)[0].token_ids
    eng = make_engine(model)
    others = random_prompts(random.Random(3), 3)
    outs = eng.generate([*others, prompt], params)
    assert outs[-1].token_ids == alone
    greedy = make_engine(model).generate([prompt], GREEDY)[0].token_ids
    assert alone != greedy[:8]  # temperature sampling actually samples
    # top_p that keeps only the most likely token is greedy.
    narrow = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=3, ignore_eos=True)
    assert make_engine(model).generate([prompt], narrow)[0].token_ids == greedy[:8]


def test_greedy_rows_beside_a_sampled_row_stay_greedy(model):
    """The all-greedy fast path and the sampling path give greedy rows the same tokens."""
    sampled = SamplingParams(max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = random_prompts(random.Random(5), 3)
    eng = make_engine(model)
    ids = [eng.add_request(p, sp) for p, sp in zip(prompts, (greedy, sampled, greedy))]
    done = {}
    while eng.has_work():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    all_greedy = make_engine(model).generate(prompts, greedy)
    assert done[ids[0]].token_ids == all_greedy[0].token_ids
    assert done[ids[2]].token_ids == all_greedy[2].token_ids
    alone = make_engine(model).generate([prompts[1]], sampled)[0].token_ids
    assert done[ids[1]].token_ids == alone


def test_generate_benchmark_times_the_engine_like_the_hf_baseline():
    from serve_jax.loadgen import generate_benchmark

    # Each run checks every request got exactly the tokens asked for (else RuntimeError).
    res = generate_benchmark("tiny_cpu", batch=2, context=8, new_tokens=8, rounds=1)
    assert res["batch"] == 2 and res["new_tokens"] == 8 and len(res["rounds"]) == 1
    assert res["rounds"][0]["first_token_s"] > 0
    with pytest.raises(ValueError, match="new_tokens"):
        generate_benchmark("tiny_cpu", new_tokens=0)


def test_step_benchmarks_run_the_executor_step():
    from serve_jax.loadgen import decode_step_benchmark, offload_overlap_benchmark

    dec = decode_step_benchmark("tiny", batch=2, context=8, block_size=4, steps=2)
    assert dec["paged_step_ms"] > 0 and dec["dense_step_ms"] > 0 and dec["params"] > 0
    off = offload_overlap_benchmark("tiny", batch=2, context=8, block_size=4, steps=2)
    first = off["fractions"][0]
    assert first["pages_offloaded_per_step"] >= 1 and first["offload_step_ms"] > 0


def test_stop_strings_abort_and_streaming_text(model):
    eng = make_engine(model)
    full = eng.generate(["hello"], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    text = full.text
    stop = next(
        (text[i : i + 2] for i in range(2, len(text) - 2) if "\ufffd" not in text[i : i + 2]), None
    )
    if stop is not None:
        out = eng.generate(["hello"], SamplingParams(max_tokens=12, stop=(stop,), ignore_eos=True))[
            0
        ]
        assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    rid = eng.add_request("abcdefgh", SamplingParams(max_tokens=50, ignore_eos=True))
    pieces = []
    for _ in range(3):
        pieces += [o.new_text for o in eng.step() if o.request_id == rid]
    assert eng.abort(rid) and not eng.abort(rid)
    while eng.has_work():
        eng.step()
    eng.scheduler.blocks.assert_all_free()


def test_bad_requests_raise_named_errors(model):
    eng = make_engine(model)
    with pytest.raises(ValueError, match="context length"):
        eng.add_request([5] * 120, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([5, 100000], GREEDY)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_safetensors_round_trip(model, tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_safetensors(model, path)
    other = nnx.clone(model)
    zeroed = jax.tree.map(jnp.zeros_like, nnx.state(other, nnx.Param))
    nnx.update(other, zeroed)
    load_safetensors(other, path)
    a = jax.tree.leaves(nnx.state(model, nnx.Param))
    b = jax.tree.leaves(nnx.state(other, nnx.Param))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    wrong = nnx.eval_shape(lambda: init_model(get_model_config("tiny", d_model=32, head_dim=8)))
    with pytest.raises(ValueError, match="shape"):
        load_safetensors(wrong, path)


@pytest.mark.slow
def test_tensor_parallel_weights_from_tapas_plan(model):
    # A tight per-device budget forces the planner to split weights over model=2.
    eng = make_engine(
        model,
        **{
            "cache.num_device_blocks": 12,
            "scheduler.preempt_mode": "offload",
            "executor.mesh": "data=1,model=2",
            "executor.plan_memory_limit_bytes": 950000,
        },
    )
    specs = eng.executor.plan.param_paths
    assert any("model" in (s or []) for s in specs.values()), specs
    assert eng.executor.k_pool[0].sharding.spec[1] == "model"
    prompts = random_prompts(random.Random(5), 5, 8, 24)
    outs = eng.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert list(o.token_ids) == reference(model, p, 12)
    assert eng.scheduler.num_offload_preemptions > 0
    eng.scheduler.blocks.assert_all_free()


def test_streamed_text_never_shows_a_stop_string_that_completes_later(model):
    """Text that may begin a stop string is held back until the next tokens decide it."""
    eng = make_engine(model)
    full = eng.generate(["hello"], SamplingParams(max_tokens=24, ignore_eos=True))[0].text
    stop = next(
        (full[i : i + 3] for i in range(1, len(full) - 3) if "\ufffd" not in full[i : i + 3]), None
    )
    assert stop is not None
    rid = eng.add_request("hello", SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True))
    pieces, final = [], None
    while eng.has_work():
        for out in eng.step():
            pieces.append(out.new_text)
            final = out if out.finished else final
    assert final.request_id == rid and final.finish_reason == "stop"
    assert "".join(pieces) == final.text == full[: full.find(stop)]
