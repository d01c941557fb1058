"""vLLM's sampler on device: penalties against a NumPy reference, top-k / min-p / logprobs,
``min_tokens`` and ``stop_token_ids``, and ``n`` samples sharing the prompt's KV pages.

Engine tests use the ``tiny_cpu`` preset and compare against a dense (unpaged) forward of the
whole sequence, recomputed for every token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.kv_cache import DenseKVView, dense_step
from serve_jax.model import init_model
from serve_jax.model_config import get_model_config
from serve_jax.sampling import (
    MAX_LOGPROBS,
    SamplingParams,
    SequenceSampling,
    apply_penalties,
    full_sampler_arrays,
    sample_full,
    sample_tokens,
)

MAX_LEN = 128


def numpy_penalties(logits, prompt, output, presence, frequency, repetition):
    """vLLM's apply_penalties, one row, written with loops."""
    out = np.array(logits, np.float64)
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / repetition if out[tok] > 0 else out[tok] * repetition
    for tok in set(output):
        out[tok] -= frequency * output.count(tok) + presence
    return out


def test_penalties_match_numpy_reference():
    rng = np.random.default_rng(0)
    b, v = 4, 50
    logits = rng.normal(size=(b, v)).astype(np.float32) * 3
    prompts = [list(rng.integers(0, v, size=rng.integers(1, 9))) for _ in range(b)]
    outputs = [list(rng.integers(0, v, size=rng.integers(0, 12))) for _ in range(b)]
    presence = np.array([0.0, 0.5, -1.0, 2.0], np.float32)
    frequency = np.array([0.0, 1.5, 0.3, -2.0], np.float32)
    repetition = np.array([1.0, 1.3, 0.7, 2.0], np.float32)
    width = 32
    history = np.full((b, width), v, np.int32)
    for i in range(b):
        seq = prompts[i] + outputs[i]
        history[i, : len(seq)] = seq
    num_prompt = np.array([len(p) for p in prompts], np.int32)
    got = apply_penalties(jnp.asarray(logits), history, num_prompt, presence, frequency, repetition)
    for i in range(b):
        want = numpy_penalties(
            logits[i], prompts[i], outputs[i], presence[i], frequency[i], repetition[i]
        )
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-5, atol=1e-5)


def _extras(rows, b, v):
    return {k: jnp.asarray(x) for k, x in full_sampler_arrays(rows, b, v).items()}


def test_full_sampler_logprobs_top_k_min_p_and_same_draw_as_plain_path():
    rng = np.random.default_rng(1)
    b, v = 4, 64
    logits = jnp.asarray(rng.normal(size=(b, v)).astype(np.float32) * 2)
    temp = jnp.ones(b, jnp.float32)
    top_p = jnp.full(b, 0.9, jnp.float32)
    counters = jnp.zeros(b, jnp.int32)
    plain_params = SamplingParams(temperature=1.0, top_p=0.9)
    full, plain = jax.jit(sample_full), jax.jit(sample_tokens)
    for seed in range(8):
        seeds = jnp.full(b, seed, jnp.int32)
        seq = SequenceSampling(plain_params, [1], [])
        extras = _extras([(seq, 0)] * b, b, v)
        toks, (lp, top_ids, top_lp) = full(logits, temp, top_p, seeds, counters, extras)
        # Nothing beyond temperature/top-p: the same tokens as the plain sampler.
        assert np.array_equal(toks, plain(logits, temp, top_p, seeds, counters))
        raw = jax.nn.log_softmax(logits, axis=-1)
        np.testing.assert_allclose(lp, np.take_along_axis(raw, toks[:, None], 1)[:, 0], 1e-6)
        assert top_ids.shape == (b, MAX_LOGPROBS)
        np.testing.assert_allclose(top_lp[:, 0], raw.max(axis=-1), 1e-6)
        assert np.array_equal(top_ids[:, 0], np.argmax(logits, axis=-1))
        # top_k=2 keeps the two most likely tokens; min_p=0.5 those at least half the best.
        k2 = SequenceSampling(SamplingParams(temperature=1.0, top_k=2), [1], [])
        mp = SequenceSampling(SamplingParams(temperature=1.0, min_p=0.5), [1], [])
        extras = _extras([(k2, 0), (k2, 0), (mp, 0), (mp, 0)], b, v)
        toks, _ = full(logits, temp, jnp.ones(b), seeds + 7, counters, extras)
        order = np.argsort(-np.asarray(logits), axis=-1)
        assert all(int(toks[i]) in order[i, :2] for i in (0, 1))
        probs = np.asarray(jax.nn.softmax(logits, axis=-1))
        assert all(probs[i, int(toks[i])] >= 0.5 * probs[i].max() for i in (2, 3))


@pytest.fixture(scope="module")
def model():
    return init_model(get_model_config("tiny", max_seq_len=MAX_LEN), seed=0)


def make_engine(model, *over):
    return Engine(load_engine_config("tiny_cpu", list(over)), model=model)


def dense_logits(model, seq):
    """Logits after the last token of ``seq`` from an unpaged forward of the whole sequence."""
    graphdef, params = nnx.split(model)
    k, v = DenseKVView.zeros(model.cfg, 1, MAX_LEN)
    tokens = np.zeros((1, MAX_LEN), np.int32)
    tokens[0, : len(seq)] = seq
    valid = np.arange(MAX_LEN)[None] < len(seq)
    logits, _, _ = dense_step(graphdef, params, k, v, tokens, np.arange(MAX_LEN)[None], valid)
    return np.asarray(logits[0, len(seq) - 1], np.float64)


def test_greedy_with_penalties_matches_the_numpy_reference(model):
    engine = make_engine(model)
    prompt = [1, 40, 41, 40, 42, 43, 40, 44]
    params = SamplingParams(
        max_tokens=8,
        ignore_eos=True,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        repetition_penalty=1.4,
        logprobs=2,
    )
    out = engine.generate([prompt], params)[0]
    plain = engine.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))[0]
    want = []
    for _ in range(8):
        raw = dense_logits(model, prompt + want)
        pen = numpy_penalties(raw, prompt, want, 0.6, 0.9, 1.4)
        want.append(int(np.argmax(pen)))
    assert list(out.token_ids) == want
    assert list(out.token_ids) != list(plain.token_ids)  # the penalties changed the output
    # Logprobs are of the raw logits (vLLM's default), for every output token.
    assert len(out.logprobs) == 8
    for i, lp in enumerate(out.logprobs):
        raw = dense_logits(model, prompt + want[:i])
        ref = raw - np.log(np.exp(raw - raw.max()).sum()) - raw.max()
        assert lp.logprob == pytest.approx(ref[want[i]], abs=1e-4)
        assert list(lp.top_ids) == list(np.argsort(-ref)[:2])
        np.testing.assert_allclose(lp.top_logprobs, np.sort(ref)[::-1][:2], atol=1e-4)
    engine.scheduler.blocks.assert_all_free()


def test_min_tokens_bans_stop_ids_and_stop_token_ids_end_the_output(model):
    engine = make_engine(model)
    prompt = [1, 50, 51, 52]
    first = engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    stop = first.token_ids[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=6, stop_token_ids=(stop,)))[0]
    assert out.token_ids == (stop,) and out.finish_reason == "stop" and out.text == ""
    params = SamplingParams(max_tokens=6, stop_token_ids=(stop,), min_tokens=3)
    out = engine.generate([prompt], params)[0]
    assert stop not in out.token_ids[:3] and len(out.token_ids) >= 3
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.add_request(prompt, SamplingParams(stop_token_ids=(10**6,)))


def test_n_samples_share_the_prompts_pages(model):
    """Samples 1..n-1 join once sample 0's prompt is computed: they hold its full prompt pages
    (reference count n) and compute only the last, partial page; each sample draws with
    ``seed + index``, so it equals a lone request with that seed."""
    engine = make_engine(model)
    blocks = engine.scheduler.blocks
    prompt = [1, *range(60, 72)]  # 13 tokens, block size 4: 3 full pages shared
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=3, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    hits_before = blocks.prefix_hits
    shared_seen = False
    final = {}
    while engine.has_work():
        for out in engine.step():
            assert out.request_id == rid
            if out.finished:
                final[out.index] = out
        tables = [blocks.device_table(f"{i}_{rid}") for i in range(3)]
        if all(tables):
            assert tables[0][:3] == tables[1][:3] == tables[2][:3]
            assert all(blocks.device.ref_count(b) == 3 for b in tables[0][:3])
            assert len({t[3] for t in tables}) == 3  # the partial page is each sample's own
            shared_seen = True
    assert shared_seen
    assert blocks.prefix_hits - hits_before == 2 * 3 * 4  # two samples x three pages
    assert sorted(final) == [0, 1, 2] and final[2].request_finished
    blocks.assert_all_free()
    for i in range(3):
        lone = SamplingParams(max_tokens=12, temperature=1.0, seed=5 + i, ignore_eos=True)
        assert final[i].token_ids == engine.generate([prompt], lone)[0].token_ids
    assert len({final[i].token_ids for i in range(3)}) > 1


def test_abort_of_an_n_request_frees_every_sample(model):
    engine = make_engine(model)
    rid = engine.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=30, n=2))
    engine.step()
    assert engine.abort(rid)
    while engine.has_work():
        assert engine.step() == []
    engine.scheduler.blocks.assert_all_free()
    assert not engine.abort(rid)
