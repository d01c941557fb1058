"""The official ``openai`` client against the live server (tiny model, byte tokenizer).

Completions and chat, streamed and not, with usage (``stream_options.include_usage``),
logprobs in both APIs' shapes, ``n=2`` sharing the prompt's pages, penalties and vLLM's extra
fields through ``extra_body``, and errors raised as the client's own exception classes with the
offending field in ``param``. Every test ends with all pages free.
"""

from __future__ import annotations

import math
import time

import httpx
import openai
import pytest

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.kv_cache import dense_greedy_generate

PROMPT = [1, 72, 101, 108, 108, 111]  # BOS "Hello" in the byte tokenizer
BODY_LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def server(running_server):
    cfg = load_engine_config("tiny_cpu", [f"server.max_body_bytes={BODY_LIMIT}"])
    engine = Engine(cfg)
    with running_server(engine, cfg) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        yield client, engine, cfg
        client.close()


@pytest.fixture(autouse=True)
def pages_free_after(server):
    yield
    _, engine, cfg = server
    deadline = time.time() + 20
    while engine.has_work():
        assert time.time() < deadline, engine.stats()
        time.sleep(0.05)
    engine.scheduler.blocks.assert_all_free()


def test_completion_streamed_and_not_with_usage(server):
    client, engine, cfg = server
    kw = dict(model=cfg.model.name, prompt=PROMPT, max_tokens=8, temperature=0)
    out = client.completions.create(**kw, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.model_extra["token_ids"] == dense_greedy_generate(engine.model, PROMPT, 8)
    assert choice.finish_reason == "length" and out.object == "text_completion"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (6, 8)
    assert out.usage.total_tokens == 14
    chunks = list(
        client.completions.create(
            **kw,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text
    assert chunks[-2].choices[0].finish_reason == "length"


def test_chat_with_list_of_parts_streamed_and_not(server):
    client, engine, cfg = server
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    kw = dict(model=cfg.model.name, max_completion_tokens=6, temperature=0)
    out = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}], **kw, extra_body={"ignore_eos": True}
    )
    joined = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi\nthere"}], **kw, extra_body={"ignore_eos": True}
    )
    assert out.choices[0].message.content == joined.choices[0].message.content
    assert out.choices[0].message.role == "assistant" and out.usage.completion_tokens == 6
    stream = client.chat.completions.create(
        messages=[{"role": "user", "content": parts}],
        **kw,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == out.choices[0].message.content
    assert chunks[-1].usage.total_tokens == out.usage.total_tokens
    # Without max_tokens a chat reply may fill the context (completions default to 16).
    full = client.chat.completions.create(
        model=cfg.model.name,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"ignore_eos": True},
    )
    assert full.usage.total_tokens == engine.max_model_len
    assert full.choices[0].finish_reason == "length"
    short = client.completions.create(
        model=cfg.model.name, prompt="hi", extra_body={"ignore_eos": True}
    )
    assert short.usage.completion_tokens == 16


def test_logprobs_in_both_shapes(server):
    client, engine, cfg = server
    out = client.completions.create(
        model=cfg.model.name,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert x <= 0 and 1 <= len(top) <= 3
        assert x == pytest.approx(max(top.values()))  # greedy: the sampled token is the top one
    chat = client.chat.completions.create(
        model=cfg.model.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob == entry.top_logprobs[0].logprob
        assert bytes(entry.bytes).decode() == entry.token
    stream = client.chat.completions.create(
        model=cfg.model.name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.logprob for e in streamed] == [e.logprob for e in content]
    assert all(e.top_logprobs == [] for e in streamed)  # logprobs without top_logprobs


def test_n2_samples_share_the_prompt_pages(server):
    client, engine, cfg = server
    prompt = [1, *range(100, 112)]  # 13 tokens: 3 full pages of 4
    hits = engine.scheduler.blocks.prefix_hits
    kw = dict(model=cfg.model.name, prompt=prompt, max_tokens=10, temperature=1.0, seed=11)
    out = client.completions.create(**kw, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 20 and out.usage.prompt_tokens == 13
    # Sample 1 found sample 0's three full prompt pages in the cache.
    assert engine.scheduler.blocks.prefix_hits - hits >= 3 * 4
    again = client.completions.create(**kw, n=2, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices]  # seeded
    ids = [c.model_extra["token_ids"] for c in out.choices]
    assert ids[0] != ids[1]
    # Sample i draws with seed + i: sample 1 is a lone request with seed 12.
    lone = client.completions.create(**{**kw, "seed": 12}, extra_body={"ignore_eos": True})
    assert lone.choices[0].model_extra["token_ids"] == ids[1]
    stream = client.completions.create(**kw, n=2, stream=True, extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    for chunk in stream:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert [texts[0], texts[1]] == [c.text for c in out.choices]


def test_penalties_and_vllm_extras(server):
    client, engine, cfg = server
    kw = dict(model=cfg.model.name, prompt=PROMPT, max_tokens=12, temperature=0)
    plain = client.completions.create(**kw, extra_body={"ignore_eos": True})
    penalized = client.completions.create(
        **kw,
        presence_penalty=1.0,
        frequency_penalty=1.5,
        extra_body={"ignore_eos": True, "repetition_penalty": 1.5},
    )
    ids = penalized.choices[0].model_extra["token_ids"]
    assert ids != plain.choices[0].model_extra["token_ids"]
    assert len(set(ids)) >= len(set(plain.choices[0].model_extra["token_ids"]))
    first = plain.choices[0].model_extra["token_ids"][0]
    stopped = client.completions.create(**kw, extra_body={"stop_token_ids": [first]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["token_ids"] == [first]
    held = client.completions.create(
        **kw, extra_body={"stop_token_ids": [first], "min_tokens": 4, "top_k": 5, "min_p": 0.01}
    )
    assert len(held.choices[0].model_extra["token_ids"]) >= 4
    sampled = client.completions.create(
        **{**kw, "temperature": 1.0}, seed=3, extra_body={"top_k": 1, "ignore_eos": True}
    )
    assert sampled.choices[0].text == plain.choices[0].text  # top_k=1 is greedy
    ignored = client.completions.create(
        **kw, extra_body={"ignore_eos": True, "echo": False, "best_of": 1, "logit_bias": {}}
    )
    assert ignored.choices[0].text == plain.choices[0].text


def test_errors_are_openai_exceptions(server):
    client, engine, cfg = server
    name = cfg.model.name
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", max_tokens=True)
    assert e.value.param == "max_tokens" and e.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", extra_body={"max_tokens": "4"})
    assert e.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt=5)
    assert e.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=name, messages=[{"role": "robot", "content": "x"}])
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=name, prompt="x", stop=["s"] * 100)
    assert e.value.param == "stop"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x")
    assert e.value.param == "model"
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=name, prompt="x" * (BODY_LIMIT + 1))
    assert e.value.status_code == 413 and e.value.type == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.get("/nothing", cast_to=httpx.Response)
    assert not math.isnan(client.completions.create(model=name, prompt="ok", max_tokens=1).created)
