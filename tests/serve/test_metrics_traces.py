"""Latency metrics with numbers worked out by hand, and the replay command."""

from __future__ import annotations

import json

import pytest

from serve_jax.__main__ import main as serve_jax_main
from serve_jax.cli import main
from serve_jax.metrics import RequestRecord, Slo, format_table, request_latencies, summarize


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


def test_per_request_latencies_are_what_the_summary_aggregates():
    a = RequestRecord(0.0, 0.5, (0.5, 0.6, 0.8), 0.8, 10, 3)
    b = RequestRecord(1.0, 1.1, (1.1,), 1.1, 4, 1)
    lat = request_latencies([a, b])
    assert lat["ttft"].tolist() == pytest.approx([500.0, 100.0])
    assert lat["tpot"].tolist() == pytest.approx([150.0])
    assert lat["itl"].tolist() == pytest.approx([100.0, 200.0])
    assert lat["e2el"].tolist() == pytest.approx([800.0, 100.0])
    s = summarize([a, b], duration=2.0, slo=Slo(ttft_ms=200, tpot_ms=1000))
    assert s["slo_met"] == 1 and s["tpot_ms"]["p99"] == pytest.approx(150.0)


def test_replay_command_on_tiny_config(tmp_path, capsys, monkeypatch):
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
    assert serve_jax_main(["replay", "--config", "tiny_cpu", "no_such_key=1"]) == 2
    assert "not a field of EngineConfig" in capsys.readouterr().err
