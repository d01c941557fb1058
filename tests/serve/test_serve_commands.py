"""One CLI convention for serve, replay, bench and simulate: --config + key=value overrides listed
by --help, and the same workload and SLO flags wherever a command takes requests."""

from __future__ import annotations

import pytest

from serve_jax.cli import main as cli_main
from serve_jax.simulate_cli import build_parser as simulate_parser, main as simulate_main

WORKLOAD_FLAGS = {
    "--workload", "--trace", "--num-requests", "--skip", "--duration-s", "--rate", "--burstiness",
    "--rate-scale", "--token-scale", "--max-input-len", "--max-output-len", "--seed",
    "--slo-ttft-ms", "--slo-tpot-ms",
}  # fmt: skip


def _help(run, command: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        run([command, "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("command", ["serve", "replay", "bench"])
def test_engine_commands_list_their_overrides(command, capsys):
    text = _help(cli_main, command, capsys)
    assert "--config PRESET" in text and "tiny_cpu" in text
    assert "key=value overrides (EngineConfig)" in text
    assert "cache.num_device_blocks (int = 256)" in text and "scheduler.policy" in text
    flags = {"replay": WORKLOAD_FLAGS, "bench": WORKLOAD_FLAGS, "serve": set()}[command]
    for flag in flags:
        assert f"{flag} " in text or f"{flag}," in text, flag


def test_simulate_lists_its_overrides_and_the_same_workload_flags(capsys):
    text = _help(simulate_main, "simulate", capsys)
    assert "key=value overrides (SimConfig)" in text
    assert "kv_memory_gb (float | None = 8.0)" in text and "slo_tpot_ms" in text
    for flag in WORKLOAD_FLAGS:
        assert f"{flag} " in text or f"{flag}," in text, flag
    for gone in ("--engine-override", "--slo-ttft-s", "--max-requests", "--time-scale"):
        assert gone not in text


def test_one_meaning_per_flag():
    """--trace is the replay spelling of --workload; --burstiness is the gamma shape anywhere."""
    args = simulate_parser().parse_args(["--trace", "conv", "--burstiness", "0.25"])
    assert args.workload == "conv" and args.burstiness == 0.25
