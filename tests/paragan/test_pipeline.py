"""Congestion-aware input pipeline: sharding, exactly-once delivery, controller, memory cap."""

import time

import numpy as np
import pytest

from paragan_jax.pipeline import InputPipeline, epoch_indices, epoch_order
from paragan_jax.pipeline_control import AimdController, Observation, PipelineConfig
from paragan_jax.storage import (
    CongestionEpisodes,
    EmulatedRemoteStorage,
    InMemoryStorage,
    LocalArrayStorage,
    write_local_dataset,
)


def _dataset(n=103, hw=4):
    images = np.random.default_rng(0).integers(0, 255, (n, hw, hw, 3), dtype=np.uint8)
    return {"image": images, "label": np.arange(n, dtype=np.int32)}


def _labels(batches):
    return [int(x) for b in batches for x in b["label"]]


@pytest.mark.parametrize("count", [1, 3, 4])
def test_epoch_shards_are_disjoint_and_cover(count):
    shares = [
        epoch_indices(103, epoch=2, seed=5, process_index=i, process_count=count)
        for i in range(count)
    ]
    union = np.concatenate(shares)
    assert sorted(union.tolist()) == list(range(103))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    other_epoch = epoch_indices(103, epoch=3, seed=5)
    assert other_epoch.tolist() != epoch_indices(103, epoch=2, seed=5).tolist()
    order = epoch_order(103, 5, 2)  # drawn once an epoch, shared read-only
    assert order is epoch_order(103, 5, 2) and not order.flags.writeable
    assert order.tolist() == np.random.default_rng([5, 2]).permutation(103).tolist()


def test_no_example_lost_or_repeated_with_emulated_store_and_three_hosts():
    data = _dataset()
    store = EmulatedRemoteStorage(
        InMemoryStorage(data), seed=1, base_latency_s=0.0005, spike_prob=0.1, spike_latency_s=0.003
    )
    store.congestion.set_congestion(True)
    cfg = PipelineConfig(batch_size=8, num_workers=3, prefetch_depth=2, control_interval=1)
    seen = []
    for host in range(3):
        pipe = InputPipeline(store, cfg, process_index=host, process_count=3)
        batches = list(pipe.epoch(0))
        labels = _labels(batches)
        assert len(labels) == len(set(labels)) == len(pipe.indices(0))
        assert labels == pipe.indices(0).tolist()  # in order, despite out-of-order fetches
        for b in batches:  # payload matches the label
            np.testing.assert_array_equal(b["image"], data["image"][b["label"]])
        seen += labels
    assert sorted(seen) == list(range(103))


def test_drop_remainder_and_resume():
    store = InMemoryStorage(_dataset(n=20))
    cfg = PipelineConfig(batch_size=6, drop_remainder=True, shuffle=False)
    pipe = InputPipeline(store, cfg, 0, 1)
    it = pipe.epoch(0)
    first = next(it)
    assert it.position == (0, 1)
    it.close()
    rest = list(pipe.epoch(0, start_batch=1))
    assert _labels([first, *rest]) == list(range(18))
    full = list(InputPipeline(store, PipelineConfig(batch_size=6, shuffle=False), 0, 1).epoch(0))
    assert [len(b["label"]) for b in full] == [6, 6, 6, 2]


def test_stream_crosses_epochs_each_exactly_once():
    store = InMemoryStorage(_dataset(n=21))
    pipe = InputPipeline(store, PipelineConfig(batch_size=4, num_workers=3), 0, 1)
    stream = pipe.batches(start_epoch=1)
    batches = [next(stream) for _ in range(3 * 6)]  # 6 batches per epoch (the last holds 1)
    assert stream.position == (4, 0)
    stream.close()
    for e in range(3):
        labels = _labels(batches[6 * e : 6 * (e + 1)])
        assert labels == pipe.indices(1 + e).tolist()
        assert sorted(labels) == list(range(21))


def test_local_files_roundtrip_and_measured_latency(tmp_path):
    data = _dataset(n=12)
    store = LocalArrayStorage(write_local_dataset(tmp_path / "ds", data))
    assert len(store) == 12
    ex = store.fetch(7)
    np.testing.assert_array_equal(ex["image"], data["image"][7])
    assert store.stats.count == 1 and store.stats.total_bytes == store.example_nbytes()
    with pytest.raises(IndexError, match="out of range"):
        store.fetch(12)
    with pytest.raises(FileNotFoundError, match="no .npy files"):
        LocalArrayStorage(tmp_path / "empty")


def test_emulated_store_is_seeded_and_congestion_slows_fetches():
    store = EmulatedRemoteStorage(InMemoryStorage(_dataset(n=4)), seed=3, congestion_factor=4.0)
    again = EmulatedRemoteStorage(InMemoryStorage(_dataset(n=4)), seed=3, congestion_factor=4.0)
    d = store.emulated_delay(2, 0, 100, congested=False, in_flight=1)
    assert d == again.emulated_delay(2, 0, 100, congested=False, in_flight=1)
    assert store.emulated_delay(2, 0, 100, True, 1) == pytest.approx(4 * d)
    assert store.emulated_delay(2, 0, 100, False, 128) == pytest.approx(2 * d)  # knee = 64
    ep = CongestionEpisodes.seeded(seed=9, horizon_s=100, mean_clean_s=2, mean_congested_s=3)
    assert ep == CongestionEpisodes.seeded(
        seed=9, horizon_s=100, mean_clean_s=2, mean_congested_s=3
    )
    assert 0.3 < ep.congested_fraction(100) < 0.9
    lo, hi = ep.intervals[0]
    assert ep.congested_at((lo + hi) / 2) and not ep.congested_at(lo / 2)
    with pytest.raises(ValueError, match="congestion_factor"):
        EmulatedRemoteStorage(InMemoryStorage(_dataset(n=4)), congestion_factor=0)


def _obs(wait_frac, latency=0.01, full=0.0):
    return Observation(
        wall_s=1.0,
        wait_s=wait_frac,
        steps=10,
        examples=160,
        fetch_latency_s=latency,
        full_fraction=full,
    )


def test_controller_raises_when_starving_lowers_when_comfortable_and_respects_cap():
    cfg = PipelineConfig(
        batch_size=16, num_workers=2, prefetch_depth=2, memory_cap_bytes=16 * 1000 * 5
    )
    ctl = AimdController(cfg, batch_bytes=16 * 1000)
    assert ctl.max_depth == 5
    w, d = ctl.update(_obs(0.5, latency=0.05))
    # Little's law: 160 examples / 0.5 s busy x 50 ms = 16 in flight, x1.5 headroom.
    assert w == 24 and d == 3
    for _ in range(10):
        w, d = ctl.update(_obs(0.5, latency=0.2))
        assert d <= 5
    assert d == 5
    high = w
    w, d = ctl.update(_obs(0.0, latency=0.01, full=1.0))
    assert w == int(high * 0.75) and d == 4
    for _ in range(20):
        w, d = ctl.update(_obs(0.0, latency=0.01, full=1.0))
    # Floored at the Little's-law need (160/s x 10 ms x 1.5 headroom = 3 in flight) and a
    # window holding those fetches plus one ready batch.
    assert (w, d) == (3, 2)
    assert ctl.update(_obs(0.01, full=0.0)) == (3, 2)  # between the thresholds: hold
    with pytest.raises(ValueError, match="smaller than one batch"):
        AimdController(cfg, batch_bytes=10**9)


def test_controller_window_covers_the_tail_latency():
    cfg = PipelineConfig(batch_size=16, num_workers=8, prefetch_depth=2, max_depth=32)
    comfortable = dict(wall_s=1.0, wait_s=0.0, steps=10, examples=160, full_fraction=1.0)
    even = AimdController(cfg, batch_bytes=1000)
    for _ in range(20):
        even.update(Observation(fetch_latency_s=0.05, fetch_latency_p95_s=0.06, **comfortable))
    tailed = AimdController(cfg, batch_bytes=1000)
    for _ in range(20):
        tailed.update(Observation(fetch_latency_s=0.05, fetch_latency_p95_s=0.4, **comfortable))
    # Mean need: 160/s x 50 ms x 1.5 = 12 in flight; the p95 tail 160/s x 0.4 s x 1.5 = 96
    # examples = 6 batches ahead, + 1: the window, not the workers, grows for the tail.
    assert even.depth == 2 and tailed.depth == 7
    assert even.workers == tailed.workers == 12


def test_adaptive_pipeline_tracks_congestion_within_memory_cap():
    data = _dataset(n=4000, hw=8)
    store = EmulatedRemoteStorage(
        InMemoryStorage(data),
        seed=0,
        base_latency_s=0.002,
        latency_sigma=0.1,
        spike_prob=0.0,
        congestion_factor=6.0,
    )
    batch_bytes = 16 * store.example_nbytes()
    cap = 8 * batch_bytes
    cfg = PipelineConfig(
        batch_size=16, num_workers=4, prefetch_depth=2, control_interval=3, memory_cap_bytes=cap
    )
    pipe = InputPipeline(store, cfg, 0, 1)
    it = pipe.batches()

    def run(steps):
        for _ in range(steps):
            next(it)
            time.sleep(0.01)  # the training step

    store.congestion.set_congestion(True)
    run(45)
    congested_depth, congested_workers = pipe.controller.depth, pipe.controller.workers
    assert congested_depth > cfg.prefetch_depth and congested_workers > cfg.num_workers
    store.congestion.set_congestion(False)
    run(90)
    assert pipe.controller.depth < congested_depth
    assert pipe.controller.workers < congested_workers
    it.close()
    assert pipe.peak_buffer_bytes <= cap
    assert max(t["depth"] for t in pipe.trace) <= 8


def test_fetch_error_is_raised_to_the_consumer():
    class Broken(InMemoryStorage):
        def fetch(self, index):
            if index == 5:
                raise OSError("disk gone")
            return super().fetch(index)

    pipe = InputPipeline(Broken(_dataset(n=16)), PipelineConfig(batch_size=4, shuffle=False), 0, 1)
    with pytest.raises(RuntimeError, match="disk gone"):
        list(pipe.epoch(0))


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_workers"):
        PipelineConfig(num_workers=0)
    with pytest.raises(ValueError, match="process_index"):
        epoch_indices(10, 0, process_index=2, process_count=2)


def test_trainer_factory_serves_the_trainers_exact_batches_and_resumes():
    from paragan_jax.config import load_train_config
    from paragan_jax.data import batch_at, load_dataset
    from paragan_jax.pipeline import trainer_batch_iterator_factory

    ds = load_dataset(load_train_config("tiny"))
    factory = trainer_batch_iterator_factory(
        PipelineConfig(num_workers=2),
        wrap_storage=lambda s: EmulatedRemoteStorage(s, seed=0, base_latency_s=1e-4),
    )
    per_epoch = len(ds) // 16
    for start in (0, per_epoch - 2):  # the second crosses an epoch boundary
        it = factory(ds, 16, 3, start)
        for i in range(4):
            got, want = next(it), batch_at(ds, 16, 3, start + i)
            np.testing.assert_array_equal(got["image"], want["image"])
            np.testing.assert_array_equal(got["label"], want["label"])
        it.close()


def test_bench_pipeline_command_writes_the_issue_keys(tmp_path):
    import json

    from paragan_jax.pipeline_bench import main

    out = tmp_path / "pipeline.json"
    argv = [
        "bench-pipeline",
        "--steps",
        "10",
        "--rounds",
        "1",
        "--warmup",
        "2",
        "--examples",
        "256",
        "--step-ms",
        "10",
        "--resolution",
        "8",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    for key in ("clean_fixed", "clean_adaptive", "congested_fixed", "congested_adaptive"):
        assert data[key] > 0
    assert 0 < data["peak_buffer_bytes"] <= data["memory_cap_bytes"]
    assert "EMULATED" in data["storage"]


def test_pipeline_settings_load_from_yaml_presets_and_overrides(tmp_path):
    from paragan_jax.command_config import command_config_parser, load_command_config
    from paragan_jax.pipeline_bench import BenchPipelineCommand
    from tapas_jax.config import ConfigError, load_config

    path = tmp_path / "pipe.yaml"
    path.write_text("num_workers: 6\nwait_high: 0.05\nadaptive: false\n")
    cfg = load_config(PipelineConfig, path, ["max_depth=8"])
    assert (cfg.num_workers, cfg.wait_high, cfg.adaptive, cfg.max_depth) == (6, 0.05, False, 8)
    with pytest.raises(ValueError, match="num_workers"):
        load_config(PipelineConfig, path, ["max_workers=4"])  # 6 workers over the bound

    parser = command_config_parser("bench-pipeline", BenchPipelineCommand, "test")
    args = parser.parse_intermixed_args(
        ["--config", "bench_pipeline_short", "pipeline.wait_high=0.1", "--step-ms", "20"]
    )
    bench = load_command_config(BenchPipelineCommand, args)
    assert (bench.steps, bench.rounds, bench.step_ms) == (60, 1, 20.0)
    assert bench.pipeline.memory_cap_bytes == 8 * 2**20 and bench.pipeline.wait_high == 0.1
    assert "pipeline.wait_high (float = 0.03)" in parser.format_help()
    with pytest.raises(ValueError, match="examples"):
        load_command_config(BenchPipelineCommand, parser.parse_intermixed_args(["--examples", "8"]))
    with pytest.raises(ConfigError, match="pipeline.bogus"):
        load_command_config(
            BenchPipelineCommand, parser.parse_intermixed_args(["pipeline.bogus=1"])
        )


def test_bench_pipeline_over_http_sweeps_fixed_settings(tmp_path):
    import json

    from paragan_jax.pipeline_bench import main

    out = tmp_path / "http.json"
    argv = ["bench-pipeline", "--store", "http", "--steps", "10", "--rounds", "1", "--warmup"]
    argv += ["2", "--examples", "256", "--step-ms", "10", "--resolution", "8"]
    argv += ["--sweep-workers", "2", "--json", str(out)]
    assert main(argv) == 0
    data = json.loads(out.read_text())
    for key in ("clean_fixed", "clean_adaptive", "congested_fixed", "congested_adaptive"):
        assert data[key] > 0
    assert data["store"].startswith("http")
    swept = [s["steps_per_s"] for s in data["fixed_sweep"]]
    assert len(swept) == 2 and data["best_fixed_congested"] == max(swept)
    assert 0 < data["peak_buffer_bytes"] <= data["memory_cap_bytes"]
    assert data["server"]["requests"] >= data["details"]["clean_fixed"]["steps"] * 32


def test_a_run_is_clean_through_its_warmup_then_follows_its_episodes_on_either_store(tmp_path):
    from paragan_jax.http_store import ObjectServer, ServerProcess
    from paragan_jax.pipeline_stores import RunCongestion

    now = [0.0]
    emulated = EmulatedRemoteStorage(InMemoryStorage(_dataset(10)), clock=lambda: now[0])
    with ObjectServer(tmp_path) as server, ServerProcess(tmp_path) as remote:
        for switch in (emulated.congestion, server.congestion, remote.congestion):
            run = RunCongestion(switch)
            run.prepare(CongestionEpisodes(((0.0, 3600.0),)))
            assert not switch.congested_now()  # the warmup
            run.start()
            assert switch.congested_now()
            run.prepare(None)
            run.start()
            assert not switch.congested_now()  # a clean run stays clean
    now[0] = 10.0
    emulated.congestion.set_congestion(None)  # back to the episodes
    emulated.congestion.restart(CongestionEpisodes(((5.0, 6.0),)))  # counted from the restart
    now[0] = 15.5
    assert emulated.congestion.congested_now()
    now[0] = 16.5
    assert not emulated.congestion.congested_now()
