"""Latency metrics with numbers worked out by hand, the trace reader, and the replay command."""

from __future__ import annotations

import json

import pytest

from serve_jax.metrics import RequestRecord, Slo, format_table, summarize
from serve_jax.traces import (
    load_trace,
    sample_trace_path,
    scale_lengths,
    with_arrivals,
)


def test_summary_by_hand():
    a = RequestRecord(0.0, 0.5, (0.5, 0.6, 0.8), 0.8, 10, 3, num_preemptions=1)
    b = RequestRecord(1.0, 1.1, (1.1,), 1.1, 4, 1)
    failed = RequestRecord(0.2, None, (), None, 7, 0, success=False)
    s = summarize([a, b, failed], duration=2.0, slo=Slo(ttft_ms=200, tpot_ms=1000))
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["ttft_ms"]["mean"] == pytest.approx(300.0)  # 500 and 100
    assert s["ttft_ms"]["median"] == pytest.approx(300.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(150.0)  # (0.8 - 0.5) / 2; b has one token
    assert sorted([s["itl_ms"]["mean"]]) == [pytest.approx(150.0)]  # 100 and 200
    assert s["e2el_ms"]["mean"] == pytest.approx(450.0)  # 800 and 100
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.0)
    assert s["total_token_throughput"] == pytest.approx(9.0)
    assert s["goodput"] == pytest.approx(0.5)  # only b meets TTFT <= 200 ms
    assert s["preemptions"] == 1
    table = format_table(s)
    assert "Mean TTFT (ms):" in table and "P99 ITL (ms):" in table


def test_trace_reader_and_transforms(tmp_path):
    rows = load_trace(sample_trace_path("conv"), limit=20)
    assert len(rows) == 20 and rows[0].arrival_s == 0.0
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))
    assert rows[0].prompt_tokens == 374 and rows[0].output_tokens == 44
    scaled = scale_lengths(rows, 0.1, max_prompt=20, max_output=5)
    assert max(r.prompt_tokens for r in scaled) <= 20 and max(r.output_tokens for r in scaled) <= 5
    poisson = with_arrivals(rows, rate=10.0, seed=1)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(poisson, poisson[1:])]
    assert all(g >= 0 for g in gaps) and 0.01 < sum(gaps) / len(gaps) < 1.0
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,two,3\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        load_trace(bad)


def test_replay_command_on_tiny_config(tmp_path, capsys, monkeypatch):
    from serve_jax.cli import main

    monkeypatch.setenv("SERVE_JAX_CACHE_DIR", "")  # no persistent XLA cache from a test

    out = tmp_path / "replay.json"
    rc = main(
        [
            "replay",
            "--config",
            "tiny_cpu",
            "--num-requests",
            "6",
            "--rate",
            "50",
            "--token-scale",
            "0.05",
            "--max-output-len",
            "6",
            "--json",
            str(out),
            "cache.num_device_blocks=16",
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Offline replay result" in printed and "Mean TPOT (ms):" in printed
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["engine"]["free_device_blocks"] == 16
    assert main(["replay", "--config", "tiny_cpu", "no_such_key=1"]) == 2
