"""The `simulate` command: table, JSON rows with the issue's keys, PNG next to the JSON."""

from __future__ import annotations

import json

import pytest

from serve_jax.simulate_cli import main


def test_simulate_writes_rows_and_png(tmp_path, capsys):
    csv = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(12):
        rows.append(f"2023-11-16 18:15:{10 + i:02d}.0000000,{30 + 7 * i},{40 + 11 * i}")
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    rc = main(
        ["simulate", "--workload", str(csv), "--policies", "fcfs_last,predictive",
         "--kv-memory-gb", "0.1", "--rate-scale", "20", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data] == ["fcfs_last", "predictive"]
    for r in data:
        for key in ("policy", "preemptions", "cascades", "p99_tpot_ms", "p99_ttft_ms",
                    "throughput_tok_s", "completed", "submitted"):  # fmt: skip
            assert key in r
        assert r["tpot_ms"]["p99"] == r["p99_tpot_ms"] > 0  # serve_jax.metrics, in ms
        assert r["completed"] == r["submitted"] == 12
    assert "vs_fcfs_last" in data[1]
    assert (tmp_path / "out.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "fcfs_last" in printed and "predictive vs fcfs_last" in printed


def test_unknown_policy_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown policy"):
        main(["simulate", "--workload", "reasoning", "--duration-s", "30", "--policies", "lifo"])
