"""``/metrics`` of the live server under vLLM's names (serve_jax.prom_metrics), parsed with
prometheus_client's own parser: names, types, labels, buckets and the values a known load gives."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.prom_metrics import build_1_2_5_buckets

# vLLM's vllm/v1/metrics/loggers.py (PrometheusStatLogger), 0.11+.
VLLM_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5]
TTFT_BUCKETS += [5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0]
ITL_BUCKETS += [7.5, 10.0, 20.0, 40.0, 80.0]

N_REQUESTS, PROMPT_LEN, MAX_TOKENS = 4, 40, 60  # 4 x 25 pages of 4 tokens > 64: preemptions


@pytest.fixture(scope="module")
def server(running_server):
    # Offload preemptions so the host-tier metrics move too.
    cfg = load_engine_config("tiny_cpu", ["scheduler.preempt_mode=offload"])
    engine = Engine(cfg)
    with running_server(engine, cfg) as url:
        yield url, engine, cfg


def scrape(url: str) -> dict:
    """{family name: family} of the server's /metrics, through prometheus_client's parser."""
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, name: str, sample: str | None = None, **labels) -> float:
    fam = families[name]
    want = sample or name
    for s in fam.samples:
        if s.name == want and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError((want, labels))


async def _load(url: str, model: str) -> None:
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int, stream: bool) -> None:
            body = {
                "model": model,
                "prompt": [3 + (i * 7 + j) % 250 for j in range(PROMPT_LEN)],
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": stream,
            }
            r = await client.post(f"{url}/v1/completions", json=body)
            assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i, i % 2 == 0) for i in range(N_REQUESTS)))


def test_bucket_helper_is_vllms():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(128) == [1, 2, 5, 10, 20, 50, 100]


def test_live_metrics_have_vllms_names_labels_buckets_and_values(server):
    url, engine, cfg = server
    model = cfg.model.name
    before = scrape(url)
    for name, kind in VLLM_TYPES.items():
        assert before[name].type == kind, name
        for s in before[name].samples:
            assert s.labels["model_name"] == model and s.labels["engine"] == "0", s
    for name in ("serve_jax:num_requests_offloaded", "serve_jax:kv_offload_bytes"):
        assert name in before
    assert value(before, "vllm:generation_tokens", "vllm:generation_tokens_total") == 0

    asyncio.run(_load(url, model))
    want_tokens = N_REQUESTS * MAX_TOKENS
    deadline = time.time() + 20
    while True:  # the engine thread records a step's outputs just after sending them
        after = scrape(url)
        got = value(
            after, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count"
        )
        if got == N_REQUESTS and not engine.has_work():
            break
        assert time.time() < deadline, got
        time.sleep(0.05)

    def v(name, sample=None, **labels):
        return value(after, name, sample, model_name=model, **labels)

    assert v("vllm:generation_tokens", "vllm:generation_tokens_total") == want_tokens
    assert v("vllm:prompt_tokens", "vllm:prompt_tokens_total") == N_REQUESTS * PROMPT_LEN
    assert v("vllm:request_success", "vllm:request_success_total", finished_reason="length") == 4
    assert v("vllm:request_success", "vllm:request_success_total", finished_reason="stop") == 0
    stats = engine.stats()
    assert stats["preemptions"] > 0
    assert v("vllm:num_preemptions", "vllm:num_preemptions_total") == stats["preemptions"]
    assert v("vllm:num_requests_running") == 0 and v("vllm:num_requests_waiting") == 0
    assert v("vllm:kv_cache_usage_perc") == pytest.approx(
        1 - stats["free_device_blocks"] / cfg.cache.num_device_blocks
    )
    ttft = "vllm:time_to_first_token_seconds"
    assert v(ttft, f"{ttft}_count") == N_REQUESTS
    itl = "vllm:inter_token_latency_seconds"
    assert v(itl, f"{itl}_count") == N_REQUESTS * (MAX_TOKENS - 1)
    for name, buckets in ((ttft, TTFT_BUCKETS), (itl, ITL_BUCKETS)):
        les = [float(s.labels["le"]) for s in after[name].samples if s.name == f"{name}_bucket"]
        assert les == [*buckets, float("inf")], name
    lens = "vllm:request_generation_tokens"
    assert v(lens, f"{lens}_sum") == want_tokens
    assert v(lens, f"{lens}_bucket", le="50.0") == 0 and v(lens, f"{lens}_bucket", le="100.0") == 4
    # Per request: queue + prefill + decode = e2e (the engine's own timestamps).
    parts = sum(
        v(f"vllm:request_{p}_time_seconds", f"vllm:request_{p}_time_seconds_sum")
        for p in ("queue", "prefill", "decode")
    )
    e2e = v("vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_sum")
    assert parts == pytest.approx(e2e, rel=1e-6, abs=1e-6)
    # Offload preemptions copied whole pages to the host and back.
    assert stats["offload_preemptions"] > 0
    block_bytes = cfg.cache.block_size * engine.model_config.kv_bytes_per_token()
    offloaded = value(after, "serve_jax:kv_offload_bytes", "serve_jax:kv_offload_bytes_total")
    restored = value(after, "serve_jax:kv_restore_bytes", "serve_jax:kv_restore_bytes_total")
    assert offloaded > 0 and offloaded % block_bytes == 0
    assert 0 < restored <= offloaded and restored % block_bytes == 0
    # The same metric objects are updated, not rebuilt per scrape: counters only grow.
    again = scrape(url)
    assert value(again, "vllm:generation_tokens", "vllm:generation_tokens_total") == want_tokens
