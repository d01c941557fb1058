"""``bench`` writes the flat JSON of ``vllm bench serve --save-result --save-detailed``, with
vLLM's ``--max-concurrency``, ``--percentile-metrics`` and ``--metric-percentiles``."""

from __future__ import annotations

import json

import pytest

from serve_jax.cli import main
from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.metrics import ClientRecord, Slo, bench_result, format_bench_table

# Keys vllm bench serve --save-result --save-detailed writes for a generative run.
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
    "latencies", "start_times", "queue_times", "generated_texts", "errors",
    "max_output_tokens_per_s", "max_concurrent_requests",
}  # fmt: skip


def test_bench_result_by_hand():
    a = ClientRecord(10, True, 3, ttft=0.1, itl=[0.2, 0.4], latency=0.7, start_time=0.0)
    b = ClientRecord(20, True, 1, ttft=0.3, latency=0.3, start_time=0.5, generated_text="x")
    c = ClientRecord(5, False, error="HTTP 503")
    r = bench_result([a, b, c], 2.0, ("ttft", "tpot", "itl"), (50, 99.9), Slo(200, 1000))
    assert r["completed"] == 2 and r["failed"] == 1
    assert r["total_input_tokens"] == 30 and r["total_output_tokens"] == 4
    assert r["request_throughput"] == 1.0 and r["output_throughput"] == 2.0
    assert r["output_lens"] == [3, 1, 0] and r["input_lens"] == [10, 20, 5]
    assert r["itls"] == [[0.2, 0.4], [], []] and r["errors"] == ["", "", "HTTP 503"]
    assert r["ttfts"] == [0.1, 0.3, 0.0] and r["generated_texts"] == ["", "x", ""]
    assert r["mean_ttft_ms"] == pytest.approx(200.0) and r["std_ttft_ms"] == pytest.approx(100.0)
    assert r["median_itl_ms"] == pytest.approx(300.0)
    assert r["p99.9_itl_ms"] == pytest.approx(399.8) and r["p50_ttft_ms"] == pytest.approx(200.0)
    # TPOT = (latency - ttft) / (output tokens - 1), requests with more than one token only.
    assert r["mean_tpot_ms"] == pytest.approx(300.0)
    assert "mean_e2el_ms" not in r and "p99_ttft_ms" not in r
    # Goodput: a meets TTFT <= 200 ms and TPOT 300 <= 1000; b's TTFT 300 misses.
    assert r["request_goodput"] == 0.5
    assert r["max_concurrent_requests"] == 2
    assert bench_result([a], 1.0)["request_goodput"] is None
    with pytest.raises(ValueError, match="--percentile-metrics"):
        bench_result([a], 1.0, ("ttft", "goodput"))


def test_bench_against_the_live_server_writes_vllms_json(running_server, tmp_path):
    cfg = load_engine_config("tiny_cpu")
    out = tmp_path / "bench.json"
    with running_server(Engine(cfg), cfg) as url:
        rc = main(
            [
                "bench",
                "--url",
                url,
                "--num-requests",
                "6",
                "--rate",
                "200",
                "--token-scale",
                "0.05",
                "--max-output-len",
                "6",
                "--max-concurrency",
                "2",
                "--percentile-metrics",
                "ttft,itl,e2el",
                "--metric-percentiles",
                "50,99",
                "--disable-tqdm",
                "--json",
                str(out),
            ]
        )
    assert rc == 0
    r = json.loads(out.read_text())
    table = format_bench_table(r, ["ttft", "itl", "e2el"])  # what bench printed
    assert "Serving Benchmark Result" in table and "P50 TTFT (ms):" in table
    assert VLLM_KEYS <= set(r), VLLM_KEYS - set(r)
    assert r["completed"] == 6 and r["failed"] == 0 and r["num_prompts"] == 6
    assert r["max_concurrency"] == 2 and 1 <= r["max_concurrent_requests"] <= 2
    assert r["model_id"] == cfg.model.name
    for metric in ("ttft", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99"):
            assert isinstance(r[f"{stat}_{metric}_ms"], float), (stat, metric)
    assert not any(k.endswith("_tpot_ms") for k in r)  # not chosen
    for n_out, itl, ttft, lat in zip(r["output_lens"], r["itls"], r["ttfts"], r["latencies"]):
        assert 1 <= n_out <= 6 and len(itl) == n_out - 1  # one chunk per token
        assert 0 < ttft <= lat and lat == pytest.approx(ttft + sum(itl), abs=1e-6)
    assert r["total_output_tokens"] == sum(r["output_lens"])
    assert r["server_preemptions"] == 0.0
