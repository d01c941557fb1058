"""Scaling model: its terms, the predicted trends, the command, and the measured CPU check.

The collective pieces it uses (torus all-reduce, hops, alpha-beta fit) are tested with
`tapas_jax.collectives` in tests/tapas/test_collectives.py."""

import json
import math

import pytest

from paragan_jax import scaling as S, scaling_check as C
from paragan_jax.scale_cli import main as scale_main
from tapas_jax.collectives import compiled_collective_terms, torus_allreduce_seconds
from tapas_jax.config import ConfigError


def _costs(**kw):
    base = dict(
        model="synthetic",
        per_chip_batch=8,
        n_disc=2,
        staleness=2,
        d_update_flops=1e12,
        d_update_bytes=1e10,
        g_update_flops=1.3e12,
        g_update_bytes=1e10,
        fakes_flops=3e11,
        fakes_bytes=1e9,
        g_param_bytes=3e8,
        d_param_bytes=3.5e8,
        image_bytes=98304.0,
    )
    base.update(kw)
    return S.StepCosts(**base)


def test_order_statistics():
    assert S.expected_max_normal(1) == 0.0
    assert S.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.05)
    assert S.expected_max_normal(1024) == pytest.approx(3.2, abs=0.1)


def test_predictions_trend_and_respond_to_jitter():
    c = _costs()
    one = S.predict(c, 1, "sync", "tpu-v3")
    assert one["efficiency"] == 1.0 and one["allreduce_s"] == 0.0
    sync = [S.predict(c, n, "sync", "tpu-v3")["efficiency"] for n in (8, 64, 256, 1024)]
    asyn = [S.predict(c, n, "async", "tpu-v3")["efficiency"] for n in (8, 64, 256, 1024)]
    assert all(a >= b for a, b in zip(sync, sync[1:]))  # never better with more chips
    assert all(0 < e < 1 for e in sync + asyn)
    assert all(a > s for a, s in zip(asyn, sync))  # smaller groups, no global barrier
    calm = S.predict(c, 1024, "sync", "tpu-v3", S.ScalingParams(jitter=0.0))
    noisy = S.predict(c, 1024, "sync", "tpu-v3", S.ScalingParams(jitter=0.1))
    assert noisy["step_seconds"] - calm["step_seconds"] == pytest.approx(
        0.1 * S.expected_max_normal(1024) * calm["compute_s"]
    )
    small = S.predict(c, 1024, "sync", "tpu-v3", S.ScalingParams(small_collectives=50))
    base = S.predict(c, 1024, "sync", "tpu-v3")
    assert small["step_seconds"] - base["step_seconds"] == pytest.approx(
        50 * torus_allreduce_seconds(4.0, 1024, "tpu-v3")
    )
    row = S.predict(c, 64, "async", "tpu-v3")
    assert row["g_chips"] + row["d_chips"] == 64
    with pytest.raises(ValueError, match="scheme"):
        S.predict(c, 8, "pipelined", "tpu-v3")
    with pytest.raises(ValueError, match="jitter"):
        S.ScalingParams(jitter=-1)


def test_cpu_check_calibrates_on_two_processes_and_predicts_the_rest(monkeypatch):
    """The composition, on synthetic measurements made by the model's own law."""
    t1, util, cores, alpha, bw = 0.02, 1.0, 2, 3e-3, 1e9
    counts = {
        2: {"all-reduce": 11, "all-to-all": 3, "collective-permute": 4},
        4: {"all-reduce": 11, "all-to-all": 3, "collective-permute": 10},
    }
    moved = {n: {"all-reduce": 8e5 * (2 * (n - 1) / n)} for n in counts}

    def law(n):
        if n == 1:
            return t1
        hops, sent = compiled_collective_terms(counts[n], moved[n], n, n)
        return t1 * max(1, n * util / cores) + hops * alpha + sent / bw

    def fake_run(processes, steps, rounds, batch):
        return {
            "step_times": {str(n): [law(n)] * 4 for n in processes},
            "cpu_times": {str(n): [util * law(n)] * 4 for n in processes},
            "collectives": {
                str(n): {"count": counts[n], "moved_bytes": moved[n]} for n in processes if n > 1
            },
            "allreduce_s": {str(v): 2 * 1e-4 + v / bw for v in (4096, 1 << 20, 4 << 20)},
        }

    monkeypatch.setattr(C, "_run_processes", fake_run)
    check = C.check_cpu((1, 2, 4), cores=cores)
    assert check["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert check["alpha_lone_allreduce_s"] == pytest.approx(1e-4, rel=1e-3)
    roles = {r["processes"]: r["role"] for r in check["rows"]}
    assert roles == {1: "calibrates t1", 2: "calibrates alpha", 4: "prediction"}
    for r in check["rows"]:
        assert r["error"] == pytest.approx(0.0, abs=1e-9), r
    with pytest.raises(ValueError, match="calibration"):
        C.check_cpu((1, 4))


def test_step_costs_come_from_the_trainers_lowered_programs():
    cfg = S.load_model_config("tiny", 4)
    c = S.measure_step_costs(cfg, "tiny")
    assert c.d_update_flops > 0 and c.g_update_flops > 0 and c.fakes_flops > 0
    assert c.g_update_flops > c.fakes_flops  # G's update runs G forward, backward and D
    # The batch-proportional part doubles with the batch (the rest is per-parameter work).
    d = {b: S.measure_step_costs(S.load_model_config("tiny", b)).d_update_flops for b in (8, 16)}
    assert d[16] - d[8] == pytest.approx(2 * (d[8] - c.d_update_flops), rel=0.05)


def test_scaling_command_writes_rows(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    rc = scale_main(
        [
            "scaling",
            "--model",
            "tiny",
            "--chips",
            "8,64",
            "--hardware",
            "tpu-v3",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [(r["chips"], r["scheme"]) for r in data["rows"]] == [
        (8, "sync"),
        (8, "async"),
        (64, "sync"),
        (64, "async"),
    ]
    assert all({"step_seconds", "efficiency"} <= set(r) for r in data["rows"])
    assert data["paper"]["published_efficiency"] == 0.91
    assert (tmp_path / "scaling.png").stat().st_size > 0  # the efficiency plot beside the JSON
    assert "efficiency" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="chips"):
        scale_main(["scaling", "--chips", "8,x"])
    with pytest.raises(ValueError, match="calibration"):
        scale_main(["scaling", "--check-cpu", "1,4"])


def test_scaling_settings_come_from_a_preset_flags_and_overrides(tmp_path):
    from paragan_jax.command_config import command_config_parser, load_command_config
    from paragan_jax.scale_cli import ScalingCommand

    preset = tmp_path / "mine.yaml"
    preset.write_text("model: biggan256\nchips: [8, 16]\njitter: 0.05\n")
    parser = command_config_parser("scaling", ScalingCommand, "test")
    args = parser.parse_intermixed_args(
        ["--config", str(preset), "--chips", "4,32", "overlap=0.25", "--count-collectives"]
    )
    cfg = load_command_config(ScalingCommand, args)
    assert (cfg.model, cfg.chips, cfg.jitter) == ("biggan256", [4, 32], 0.05)  # flag over preset
    assert cfg.overlap == 0.25 and cfg.count_collectives is True
    args = parser.parse_intermixed_args(["--jitter", "0.1", "jitter=0.2"])
    assert load_command_config(ScalingCommand, args).jitter == 0.2  # overrides come last
    help_text = parser.format_help()
    assert "per_chip_batch (int = 8)" in help_text and "--per-chip-batch" in help_text
    with pytest.raises(ConfigError, match="not a field of ScalingCommand"):
        load_command_config(ScalingCommand, parser.parse_intermixed_args(["bogus=1"]))


@pytest.mark.slow
def test_model_reproduces_measured_cpu_processes_within_25_percent():
    import os

    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        pytest.skip(
            f"load average {os.getloadavg()[0]:.1f} exceeds {cores} cores: other jobs would "
            "time-slice the processes at every collective, which the model does not describe"
        )
    check = C.check_cpu((1, 2, 4), steps=5, rounds=4)
    predictions = [r for r in check["rows"] if r["role"] == "prediction"]
    assert predictions
    for row in predictions:
        assert abs(row["error"]) <= 0.25, row


def test_scaling_preset_is_the_benchmarks_run():
    from paragan_jax.command_config import command_config_parser, load_command_config
    from paragan_jax.scale_cli import ScalingCommand

    parser = command_config_parser("scaling", ScalingCommand, "test")
    args = parser.parse_intermixed_args(["--config", "scaling_check_cpu"])
    cfg = load_command_config(ScalingCommand, args)
    assert (cfg.model, cfg.hardware, cfg.chips) == ("biggan128", "tpu-v3", [8, 64, 256, 1024])
    assert cfg.check_cpu == [1, 2, 4]
    with pytest.raises(ConfigError, match="not a field of ScalingCommand"):
        load_command_config(ScalingCommand, parser.parse_intermixed_args(["--config", "tiny"]))
