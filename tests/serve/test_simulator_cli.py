"""The `simulate` command: table, JSON rows with the issue's keys, PNG next to the JSON."""

from __future__ import annotations

import json

import pytest

from serve_jax.simulate_cli import build_parser, load_sim_config, main, preemption_curve
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import RequestSpec, Workload


def test_simulate_writes_rows_and_png(tmp_path, capsys):
    csv = tmp_path / "trace.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for i in range(12):
        rows.append(f"2023-11-16 18:15:{10 + i:02d}.0000000,{30 + 7 * i},{40 + 11 * i}")
    csv.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out.json"
    rc = main(
        ["simulate", "--workload", str(csv), "--policies", "fcfs_last,fcfs_last_offload,predictive",
         "--kv-memory-gb", "0.1", "--rate-scale", "20", "--json", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["policy"] for r in data] == ["fcfs_last", "fcfs_last_offload", "predictive"]
    for r in data:
        for key in ("policy", "preemptions", "cascades", "p99_tpot_s", "p99_ttft_s",
                    "p99_tpot_ms", "p99_ttft_ms", "throughput_tok_s", "goodput_req_s",
                    "completed", "submitted", "rejected", "prefix_hit_rate"):  # fmt: skip
            assert key in r
        assert r["p99_tpot_s"] * 1e3 == pytest.approx(r["p99_tpot_ms"], rel=1e-12)
        assert r["p99_ttft_s"] * 1e3 == pytest.approx(r["p99_ttft_ms"], rel=1e-12)
        assert r["tpot_ms"]["p99"] == r["p99_tpot_ms"] > 0  # serve_jax.metrics, in ms
        assert r["completed"] == r["submitted"] == 12 and r["rejected"] == 0
        assert 0.0 <= r["prefix_hit_rate"] < 1.0
    assert "vs_fcfs_last" in data[2]
    vs_best = data[2]["vs_best_baseline"]
    best_tpot = min(data[:2], key=lambda r: r["p99_tpot_ms"])
    assert vs_best["p99_tpot_best"] == best_tpot["policy"]
    assert vs_best["p99_tpot_reduction_x"] == best_tpot["p99_tpot_ms"] / data[2]["p99_tpot_ms"]
    assert (tmp_path / "out.png").stat().st_size > 10_000
    printed = capsys.readouterr().out
    assert "fcfs_last" in printed and "predictive vs fcfs_last" in printed
    assert "predictive vs the best baseline" in printed


def test_unknown_policy_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="unknown policy"):
        main(["simulate", "--workload", "reasoning", "--duration-s", "30", "--policies", "lifo"])


def test_the_simulated_server_is_a_config_with_presets_and_overrides(tmp_path):
    """SimConfig loads like every config: a preset or .yaml path, then flags, then key=value."""
    parse = build_parser().parse_args
    assert load_sim_config(parse(["--config", "sim_llama7b_h100"])) == SimConfig()
    yaml = tmp_path / "sim.yaml"
    yaml.write_text("hardware: tpu-v5e\nkv_memory_gb: 16\n")
    cfg = load_sim_config(
        parse(["--config", str(yaml), "--kv-memory-gb", "4", "max_num_seqs=8", "--vllm-admission",
               "--slo-tpot-ms", "50"])
    )  # fmt: skip
    assert (cfg.hardware, cfg.kv_memory_gb, cfg.max_num_seqs) == ("tpu-v5e", 4.0, 8)
    assert cfg.no_admission_after_preemption and cfg.slo_tpot_ms == 50.0
    assert load_sim_config(parse(["--kv-memory-gb", "0"])).kv_memory_gb is None  # HBM left
    assert load_sim_config(parse(["kv_memory_gb=12", "--kv-memory-gb", "3"])).kv_memory_gb == 12


def test_simulated_server_prices_the_model_it_is_given():
    """One model registry: any ModelConfig preset (and its dtype) prices the simulated steps."""
    wl = Workload("w", tuple(RequestSpec(f"r{i}", 0.01 * i, 40, 30) for i in range(8)))
    tiny = simulate(wl, "fcfs_last", SimConfig(model="tiny", kv_memory_gb=0.01))
    big = simulate(wl, "fcfs_last", SimConfig(model="llama-7b", kv_memory_gb=0.1))
    assert tiny.completed == big.completed == 8
    assert tiny.makespan_s < big.makespan_s  # 100k parameters stream faster than 7B


def test_preemption_line_runs_to_the_end_of_a_run_that_starts_late():
    """``makespan_s`` counts from the first arrival, preemption times are absolute: a workload
    whose first request arrives at 50 s still gets a line to its last finish."""
    wl = Workload("late", tuple(RequestSpec(f"r{i}", 50.0 + 0.01 * i, 200, 300) for i in range(16)))
    r = simulate(wl, "fcfs_last", SimConfig(kv_memory_gb=0.5))
    assert r.completed == 16 and r.preemptions > 0
    assert r.start_s == 50.0
    times, counts = preemption_curve(r)
    assert times[-1] == pytest.approx(r.start_s + r.makespan_s)
    assert times[-1] > max(r.preemption_times) > 50.0 > r.makespan_s
    assert counts[-1] == r.preemptions
