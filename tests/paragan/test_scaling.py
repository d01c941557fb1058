"""Scaling model: its terms, the predicted trends, the command, and the measured CPU check."""

import json
import math

import pytest

from paragan_jax import scaling as S
from paragan_jax.scale_cli import main as scale_main
from tapas_jax.collectives import collective_seconds


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


def test_torus_and_order_statistics():
    assert S.torus_shape(1024) == (32, 32)
    assert S.torus_shape(512) == (16, 32)
    assert S.torus_shape(8) == (2, 4)
    assert S.expected_max_normal(1) == 0.0
    assert S.expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=0.05)
    assert S.expected_max_normal(1024) == pytest.approx(3.2, abs=0.1)


def test_torus_allreduce_is_cheaper_than_one_ring_and_uses_the_collective_model():
    v = 3e8
    ring = collective_seconds("all-reduce", v, 1024, "tpu-v3")
    torus = S.allreduce_seconds(v, 1024, "tpu-v3")
    assert torus < ring
    expect = (
        collective_seconds("reduce-scatter", v, 32, "tpu-v3")
        + collective_seconds("all-reduce", v / 32, 32, "tpu-v3")
        + collective_seconds("all-gather", v, 32, "tpu-v3")
    )
    assert torus == pytest.approx(expect)
    assert S.allreduce_seconds(v, 1, "tpu-v3") == 0.0


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
        50 * S.allreduce_seconds(4.0, 1024, "tpu-v3")
    )
    row = S.predict(c, 64, "async", "tpu-v3")
    assert row["g_chips"] + row["d_chips"] == 64
    with pytest.raises(ValueError, match="scheme"):
        S.predict(c, 8, "pipelined", "tpu-v3")
    with pytest.raises(ValueError, match="jitter"):
        S.ScalingParams(jitter=-1)


def test_alpha_beta_fit_recovers_a_known_link():
    alpha, w = 2e-4, 5e8
    times = {v: 2 * alpha + v / w for v in (4096, 1 << 20, 4 << 20)}  # p = 2
    fa, fw = S.fit_alpha_beta(times, 2)
    assert fa == pytest.approx(alpha, rel=1e-6) and fw == pytest.approx(w, rel=1e-6)


def test_hlo_collectives_are_priced_like_the_collective_model():
    from tapas_jax.hardware import get_profile

    hw = get_profile("tpu-v3")

    def seconds(count, p):
        hops, sent = S.hlo_collective_terms({"all-reduce": count}, {"all-reduce": 1e6}, 2, p)
        return hops * hw.collective_latency + sent / hw.axis_bandwidth

    # 1e6 bytes moved at p=2 is a 1e6-byte payload (2 (p-1)/p = 1).
    assert seconds(1, 8) == pytest.approx(collective_seconds("all-reduce", 1e6, 8, hw))
    assert seconds(10, 8) > seconds(1, 8)  # nine more latency terms
    assert seconds(3, 1) == 0.0


def test_collective_hops_follow_the_ring_algorithms():
    counts = {"all-reduce": 2, "all-gather": 1, "all-to-all": 1, "collective-permute": 3}
    moved = {"all-reduce": 2e6, "all-gather": 0.0, "all-to-all": 0.0, "collective-permute": 30.0}
    hops, sent = S.hlo_collective_terms(counts, moved, 2, 4)
    # all-reduce 2(p-1) each, gather and all-to-all p-1, a permute one hop to its neighbour.
    assert hops == 2 * 6 + 3 + 3 + 3
    # 2e6 bytes moved by two all-reduces at p=2 are 2e6 of payload; at p=4 each device sends 1.5x.
    assert sent == pytest.approx(1.5 * 2e6 + 30.0)
    assert S.hlo_collective_terms(counts, moved, 2, 1) == (0, 0.0)
    with pytest.raises(ValueError, match="send-recv"):
        S.hlo_collective_terms({"send-recv": 1}, {}, 2, 2)


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
        hops, sent = S.hlo_collective_terms(counts[n], moved[n], n, n)
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

    monkeypatch.setattr(S, "_run_processes", fake_run)
    check = S.check_cpu((1, 2, 4), cores=cores)
    assert check["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert check["alpha_lone_allreduce_s"] == pytest.approx(1e-4, rel=1e-3)
    roles = {r["processes"]: r["role"] for r in check["rows"]}
    assert roles == {1: "calibrates t1", 2: "calibrates alpha", 4: "prediction"}
    for r in check["rows"]:
        assert r["error"] == pytest.approx(0.0, abs=1e-9), r
    with pytest.raises(ValueError, match="calibration"):
        S.check_cpu((1, 4))


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
    with pytest.raises(SystemExit):
        scale_main(["scaling", "--chips", "8,x"])


@pytest.mark.slow
def test_model_reproduces_measured_cpu_processes_within_25_percent():
    import os

    cores = os.cpu_count() or 1
    if os.getloadavg()[0] > cores:
        pytest.skip(
            f"load average {os.getloadavg()[0]:.1f} exceeds {cores} cores: other jobs would "
            "time-slice the processes at every collective, which the model does not describe"
        )
    check = S.check_cpu((1, 2, 4), steps=5, rounds=4)
    predictions = [r for r in check["rows"] if r["role"] == "prediction"]
    assert predictions
    for row in predictions:
        assert abs(row["error"]) <= 0.25, row
