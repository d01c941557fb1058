"""The HTTP server end to end: a real uvicorn server on 127.0.0.1 in a thread, httpx clients.

Checks the OpenAI-style endpoints, streaming, errors naming the field, 503 when full, that a
client disconnecting mid-stream frees its pages, and that after a fuzzed stream of bad
requests and disconnects a normal request still returns the dense reference's tokens.
"""

from __future__ import annotations

import json
import logging
import random
import time

import httpx
import pytest

from serve_jax.config import ServerSection, load_engine_config
from serve_jax.engine import Engine
from serve_jax.kv_cache import dense_greedy_generate
from serve_jax.openai_protocol import IGNORED_FIELDS, ChatRequest, CompletionRequest, parse_body

MAX_QUEUE = 3
BODY_LIMIT = 256 * 1024  # the default is 32 MiB (ServerSection.max_body_bytes)


@pytest.fixture(scope="module")
def server(running_server):
    over = [f"server.max_queue={MAX_QUEUE}", f"server.max_body_bytes={BODY_LIMIT}"]
    cfg = load_engine_config("tiny_cpu", over)
    engine = Engine(cfg)
    engine.warmup()
    with running_server(engine, cfg) as url:
        yield url, engine, cfg


def wait_idle(engine, timeout=20.0):
    deadline = time.time() + timeout
    while engine.has_work():
        assert time.time() < deadline, f"engine still busy: {engine.stats()}"
        time.sleep(0.05)


def assert_all_pages_free(engine, cfg):
    wait_idle(engine)
    stats = engine.stats()
    assert stats["free_device_blocks"] == cfg.cache.num_device_blocks
    assert stats["free_host_blocks"] == cfg.cache.num_host_blocks
    engine.scheduler.check_invariants()


def sse_events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def test_models_health_and_metrics(server):
    url, engine, cfg = server
    r = httpx.get(f"{url}/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == cfg.model.name
    assert httpx.get(f"{url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{url}/metrics").text
    for name in (  # vLLM's names (serve_jax.prom_metrics); tests/serve/test_prom_metrics.py
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "serve_jax:num_requests_offloaded",
        "serve_jax:host_kv_pages_used",
        "serve_jax:generation_tokens_per_second",
    ):
        assert name in text, name


def test_completion_matches_dense_reference_streaming_and_not(server):
    url, engine, cfg = server
    prompt = [1, 72, 101, 108, 108, 111]
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    want = dense_greedy_generate(engine.model, prompt, 8)
    assert out["choices"][0]["token_ids"] == want
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 8
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    streamed = [t for e in events[:-1] for t in e["choices"][0]["token_ids"]]
    assert streamed == want
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == out["choices"][0]["text"]


def test_chat_completion(server):
    url, engine, cfg = server
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    assert msg["role"] == "assistant" and isinstance(msg["content"], str)
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}) as s:
        events = sse_events(s)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert r.json()["choices"][0]["token_ids"] == [
        t for e in events[1:-1] for t in e["choices"][0]["token_ids"]
    ]


BAD_REQUESTS = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", {"prompt": "x", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "n": 65}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt.1"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 3}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop": "a" * 1025}, "stop"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": list(range(65))}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"bogus": True}}, "stream_options.bogus"),
    (
        "/v1/completions",
        {"prompt": "x", "stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000, None),  # nested too deeply
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),  # not UTF-8
    ("/v1/completions", {"prompt": "x", "seed": -3}, "seed"),
    ("/v1/completions", {"prompt": "x" * 500}, "prompt"),
    ("/v1/completions", {"prompt": "", "max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 200}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop": [""]}, "stop"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages.0.content.0.type",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
        "logprobs",
    ),
]


def assert_openai_error(r, status, param=None, kind="invalid_request_error"):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["type"] == kind and err["code"] == status and err["message"], err
    assert err["param"] == param, err


def assert_healthy(url, engine, cfg):
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}
    assert_all_pages_free(engine, cfg)


@pytest.mark.parametrize("path,body,param", BAD_REQUESTS)
def test_bad_requests_get_400_naming_the_field(server, path, body, param):
    url, engine, cfg = server
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{url}{path}", headers={"content-type": "application/json"}, **kwargs)
    assert_openai_error(r, 400, param)
    assert_healthy(url, engine, cfg)


def test_unknown_route_and_method_are_openai_errors(server):
    url, engine, cfg = server
    assert_openai_error(httpx.get(f"{url}/v1/nothing"), 404, kind="not_found_error")
    r = httpx.get(f"{url}/v1/completions")
    assert_openai_error(r, 405)
    assert "POST" in r.headers["allow"]
    assert_healthy(url, engine, cfg)


def test_body_over_the_limit_is_413_before_it_is_read(server):
    url, engine, cfg = server
    limit = cfg.server.max_body_bytes
    big = b'{"prompt": "' + b"x" * limit + b'"}'
    r = httpx.post(f"{url}/v1/completions", content=big, timeout=60)
    assert_openai_error(r, 413)

    def chunks():  # chunked transfer: no Content-Length, counted while read
        yield b'{"prompt": "'
        for _ in range(limit // 4096 + 1):
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(f"{url}/v1/completions", content=chunks(), timeout=60)
    assert_openai_error(r, 413)
    # Just under the limit is parsed (and refused for its own reason: too long a prompt).
    ok = b'{"prompt": "' + b"x" * (limit - 20) + b'"}'
    assert_openai_error(httpx.post(f"{url}/v1/completions", content=ok, timeout=60), 400, "prompt")
    assert_healthy(url, engine, cfg)


def test_unknown_model_is_404(server):
    url, *_ = server
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert_openai_error(r, 404, "model", "not_found_error")


def test_disconnect_mid_stream_aborts_and_frees_pages(server):
    url, engine, cfg = server
    body = {"prompt": "abc", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        seen = 0
        for line in resp.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    # Leaving the block closed the connection with the request still generating.
    assert_all_pages_free(engine, cfg)


def test_full_queue_is_503_with_retry_after_and_accepted_requests_complete(server):
    url, engine, cfg = server
    body = {"prompt": [1, 2, 3], "max_tokens": 100, "stream": True, "ignore_eos": True}
    clients = [httpx.Client(timeout=60) for _ in range(MAX_QUEUE)]
    streams = [c.stream("POST", f"{url}/v1/completions", json=body) for c in clients]
    responses = [s.__enter__() for s in streams]
    try:
        for resp in responses:
            assert resp.status_code == 200
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
        assert r.status_code == 503
        assert r.headers["retry-after"] == str(cfg.server.retry_after_s)
        for resp in responses:
            events = sse_events(resp)
            assert events[-1] == "[DONE]"
            assert events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 100
    finally:
        for s in streams:
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    assert_all_pages_free(engine, cfg)


def test_fuzz_then_normal_request(server):
    url, engine, cfg = server
    rng = random.Random(0)
    keys = ["prompt", "max_tokens", "temperature", "top_p", "stream", "stop", "seed", "junk"]
    values = [None, -1, 0, 1, 2.5, "x", "", [], [1, 2], {"a": 1}, True, "\u00ff" * 3, 10**9]
    for _ in range(40):
        kind = rng.random()
        if kind < 0.2:
            raw = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
            r = httpx.post(
                f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400
        elif kind < 0.8:
            body = {k: rng.choice(values) for k in rng.sample(keys, rng.randint(0, 5))}
            if rng.random() < 0.5:
                body["max_tokens"] = rng.randint(1, 4)
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code in (200, 400, 503), (body, r.status_code, r.text)
            if r.status_code != 200:
                assert "error" in r.json()
            elif not body.get("stream"):
                assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
        else:  # open a stream and drop it after a few bytes
            body = {"prompt": "fuzz", "max_tokens": 50, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
                for _ in resp.iter_bytes():
                    break
    assert_all_pages_free(engine, cfg)
    prompt = [1, 80, 81, 82]
    r = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == dense_greedy_generate(engine.model, prompt, 6)
    assert_all_pages_free(engine, cfg)


def test_unimplemented_fields_are_ignored_with_a_warning(caplog):
    body = {"prompt": "x", "echo": False, "best_of": 2, "logit_bias": {"1": 5}, "tools": []}
    with caplog.at_level(logging.WARNING, logger="serve_jax.server"):
        parsed = parse_body(json.dumps(body).encode(), CompletionRequest)
    assert parsed.prompt == "x"
    assert "['best_of', 'echo', 'logit_bias', 'tools']" in caplog.text
    assert IGNORED_FIELDS.isdisjoint(CompletionRequest.model_fields)
    assert IGNORED_FIELDS.isdisjoint(ChatRequest.model_fields)
    assert ServerSection().max_body_bytes == 32 * 1024 * 1024
