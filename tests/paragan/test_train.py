"""Sync and async steps: sharded equals unsharded, async k=0 equals sync, resume, checkpoints,
the one step loop."""

import ast
import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import RING
from tb_events import read_events

import paragan_jax
from paragan_jax.__main__ import main
from paragan_jax.async_scheme import AsyncRunner
from paragan_jax.config import load_train_config
from paragan_jax.data import PrefetchLoader, batch_at, load_dataset
from paragan_jax.loop import grouped, run_steps
from paragan_jax.step_bench import step_bench
from paragan_jax.steps import SyncRunner
from paragan_jax.train import Trainer
from tapas_jax.config import ConfigError
from tapas_jax.mesh import make_mesh


def _max_diff(a, b):
    diffs = jax.tree.map(
        lambda x, y: float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))),
        a,
        b,
    )
    return max(jax.tree.leaves(diffs))


def _run(runner, ds, cfg, steps):
    b, n = cfg.data.batch_size, cfg.n_disc
    metrics = None
    for t in range(steps):
        metrics = runner.run_step([batch_at(ds, b, cfg.data.seed, n * t + i) for i in range(n)])
    return jax.device_get(metrics)


# Adam's first update is about lr * sign(grad): a gradient entry that is ~0 flips sign under a
# different reduction order and moves a param by up to 2 * lr. A larger Adam epsilon makes the
# update proportional to the gradient, so params compare at the precision of the sharded math.
SMOOTH_ADAM = ["optim_g.eps=1e-3", "optim_d.eps=1e-3"]


def test_sharded_sync_step_equals_one_device():
    cfg = load_train_config("tiny", SMOOTH_ADAM)
    ds = load_dataset(cfg)
    one = SyncRunner(cfg, make_mesh("data=1", jax.devices()[:1]), ds.images.shape[1:])
    eight = SyncRunner(cfg, make_mesh("data=8"), ds.images.shape[1:])
    m1, m8 = _run(one, ds, cfg, 2), _run(eight, ds, cfg, 2)
    for k in m1:
        np.testing.assert_allclose(m1[k], m8[k], atol=1e-5, rtol=1e-5)
    # Batch norm statistics are global over the sharded batch, so G's BN state matches too.
    assert _max_diff(one.state.g_stats, eight.state.g_stats) < 1e-5
    assert _max_diff(one.state.g_params, eight.state.g_params) < 1e-5
    assert _max_diff(one.state.d_params, eight.state.d_params) < 1e-5
    assert _max_diff(one.state.ema_params, eight.state.ema_params) < 1e-5
    assert eight.state.g_params["linear"]["kernel"].sharding.mesh.size == 8


@pytest.mark.slow
def test_fsdp_places_params_over_data_axis():
    cfg = load_train_config("tiny", [*RING, "sharding.params=fsdp", "model.g_width=64"])
    ds = load_dataset(cfg)
    runner = SyncRunner(cfg, make_mesh("data=8"), ds.images.shape[1:])
    kernel = runner.state.g_params["layers"][1]["kernel"]  # 64x64
    assert "data" in tuple(kernel.sharding.spec)
    assert kernel.addressable_shards[0].data.size == kernel.size // 8
    assert np.isfinite(_run(runner, ds, cfg, 1)["g_loss"])


@pytest.mark.slow
def test_async_k0_equals_sync():
    over = [*RING, *SMOOTH_ADAM, "n_disc=2"]
    cfg = load_train_config("tiny", over)
    cfg_a = load_train_config("tiny", [*over, "scheme=async", "async_.staleness=0"])
    ds = load_dataset(cfg)
    mesh = make_mesh("data=2", jax.devices()[:2])
    sync = SyncRunner(cfg, mesh, ds.images.shape[1:])
    asyn = AsyncRunner(cfg_a, mesh, ds.images.shape[1:])
    ms, ma = _run(sync, ds, cfg, 2), _run(asyn, ds, cfg_a, 2)
    for k in ms:
        np.testing.assert_allclose(ms[k], ma[k], atol=1e-5, rtol=1e-5)
    assert _max_diff(sync.state.g_params, asyn.g_state["g_params"]) < 1e-5
    assert _max_diff(sync.state.d_params, asyn.d_state["d_params"]) < 1e-5
    assert _max_diff(sync.state.d_stats, asyn.d_state["d_stats"]) < 1e-5
    assert asyn.g.mesh.devices.size == 1 and asyn.d.mesh.devices.size == 1
    assert set(asyn.g.mesh.devices.flat).isdisjoint(asyn.d.mesh.devices.flat)


def test_async_snapshot_staleness_bound():
    cfg = load_train_config("tiny", [*RING, "scheme=async", "async_.staleness=2"])
    ds = load_dataset(cfg)
    r = AsyncRunner(cfg, make_mesh("data=2", jax.devices()[:2]), ds.images.shape[1:])
    history = [jax.device_get(r.d_state["d_params"])]
    for t in range(4):
        _run_one = [batch_at(ds, cfg.data.batch_size, 0, t)]
        snap_before = jax.device_get(r.g_state["d_snap_params"])
        r.run_step(_run_one)
        history.append(jax.device_get(r.d_state["d_params"]))
        snap_used = jax.device_get(r.g_state["d_snap_params"])
        # Iteration t refreshes the snapshot to D before its update when t % k == 0.
        expect = history[t] if t % 2 == 0 else snap_before
        assert _max_diff(snap_used, expect) == 0.0
        assert _max_diff(snap_used, history[t + 1]) > 0.0  # never the D of this iteration
    assert r.step == 4
    assert len(r.buffer) <= cfg.async_.buffer_size


def test_batch_not_dividing_data_axis_is_an_error(tmp_path):
    cfg = load_train_config("tiny", ["data.batch_size=12", "sharding.num_devices=8"])
    with pytest.raises(ConfigError, match="batch_size=12 does not divide"):
        Trainer(cfg, str(tmp_path))
    cfg = load_train_config("tiny", ["scheme=async", "sharding.num_devices=1"])
    with pytest.raises(ConfigError, match="at least 2 devices"):
        Trainer(cfg, str(tmp_path))


def test_trainer_resume_matches_uninterrupted(tmp_path):
    cfg = load_train_config("tiny", [*RING, "steps=4", "checkpoint.every=2"])
    full = Trainer(cfg, str(tmp_path / "full"), progress=False)
    full.train()
    part = Trainer(cfg, str(tmp_path / "part"), progress=False)
    part.train(steps=2)
    resumed = Trainer(cfg, str(tmp_path / "part"), progress=False)
    summary = resumed.train()
    assert summary["resumed_from"] == 2 and summary["step"] == 4
    a, b = full.runner.state, resumed.runner.state
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _rewrite_meta(step_dir: Path, **changes) -> None:
    """Changes the meta of a saved step (None drops a key) and its SHA-256 in the manifest."""
    meta_file = step_dir / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    for k, v in changes.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    meta_file.write_text(json.dumps(meta))
    manifest = step_dir / "sha256.json"
    digests = json.loads(manifest.read_text())
    digests["meta/metadata"] = hashlib.sha256(meta_file.read_bytes()).hexdigest()
    manifest.write_text(json.dumps(digests))


def test_resume_warns_when_the_data_layout_changed(tmp_path):
    cfg = load_train_config("tiny", [*RING, "steps=2", "checkpoint.every=2"])
    Trainer(cfg, str(tmp_path / "a"), progress=False).train()
    meta = json.loads((tmp_path / "a" / "checkpoints" / "2" / "meta" / "metadata").read_text())
    assert (meta["process_count"], meta["local_data"]) == (1, False)
    _rewrite_meta(tmp_path / "a" / "checkpoints" / "2", process_count=2, local_data=True)
    with pytest.warns(
        RuntimeWarning,
        match=r"process_count=2, local_data=True; this run has process_count=1, local_data=False",
    ):
        summary = Trainer(cfg, str(tmp_path / "a"), progress=False).train(steps=3)
    assert summary["resumed_from"] == 2 and summary["step"] == 3  # a warning, not an error
    # A checkpoint from before these keys restores silently.
    Trainer(cfg, str(tmp_path / "b"), progress=False).train()
    _rewrite_meta(tmp_path / "b" / "checkpoints" / "2", process_count=None, local_data=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert Trainer(cfg, str(tmp_path / "b"), progress=False).train(steps=3)["step"] == 3


def test_corrupted_latest_checkpoint_falls_back(tmp_path):
    cfg = load_train_config("tiny", [*RING, "steps=4", "checkpoint.every=2"])
    Trainer(cfg, str(tmp_path), progress=False).train()
    ckpt = tmp_path / "checkpoints"
    assert (ckpt / "4").is_dir() and (ckpt / "2").is_dir()
    for f in (ckpt / "4" / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(b"garbage")
    t = Trainer(cfg, str(tmp_path), progress=False)
    with pytest.warns(RuntimeWarning, match="step 4 .* cannot be restored"):
        step = t.restore()
    assert step == 2
    assert (ckpt / "corrupt-4").is_dir()
    # Training continues from step 2 and can save step 4 again.
    assert t.train()["step"] == 4 and (ckpt / "4").is_dir()


@pytest.mark.slow
def test_plan_placement_on_a_model_axis():
    cfg = load_train_config("tiny", ["sharding.params=plan", "model.g_width=8"])
    ds = load_dataset(cfg)
    mesh = make_mesh("data=2,model=4")
    runner = SyncRunner(cfg, mesh, ds.images.shape[1:])
    for leaf in jax.tree.leaves(runner.state.g_opt) + jax.tree.leaves(runner.state.d_params):
        assert leaf.sharding.mesh.shape == mesh.shape
    assert np.isfinite(_run(runner, ds, cfg, 1)["d_loss"])


def test_run_steps_counts_times_and_stops(tmp_path):
    cfg = load_train_config("tiny", RING)
    ds = load_dataset(cfg)
    mesh = make_mesh("data=2", jax.devices()[:2])
    loop_runner = SyncRunner(cfg, mesh, ds.images.shape[1:])
    seen = []
    loader = PrefetchLoader(ds, cfg.data.batch_size, cfg.data.seed, 0, 2)
    stats = run_steps(
        loop_runner,
        grouped(loader, cfg.n_disc),
        3,
        on_step=lambda done, m: seen.append(done),
        block_each_step=True,
    )
    loader.close()
    assert stats.steps == 3 and seen == [1, 2, 3] and loop_runner.step == 3
    assert len(stats.step_times) == 3 and len(stats.cpu_times) == 3
    assert stats.timed_steps == 2 and stats.compile_s > 0 and stats.wall_s > 0
    assert np.isfinite(float(stats.metrics["g_loss"]))
    # The loop feeds the runner exactly the loader's batches in order: same state as by hand.
    by_hand = SyncRunner(cfg, mesh, ds.images.shape[1:])
    _run(by_hand, ds, cfg, 3)
    assert _max_diff(loop_runner.state, by_hand.state) == 0.0
    # A time budget stops after the first timed step; the compiling step never counts.
    same_batch = iter(lambda: [batch_at(ds, cfg.data.batch_size, 0, 0)], None)
    stats = run_steps(loop_runner, same_batch, 10, seconds=0.0)
    assert stats.steps == 2 and not stats.step_times
    assert run_steps(loop_runner, None, 0).steps == 0


def test_only_the_commands_import_the_trainer():
    """state/steps/loop and the schemes never import the Trainer (paragan_jax.train) back; only
    the commands and the package's lazy export do."""
    package = Path(paragan_jax.__file__).parent
    importers = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module == "train":
                importers.add(path.stem)
            if isinstance(node, ast.ImportFrom) and node.module == "paragan_jax.train":
                importers.add(path.stem)
    assert importers <= {"cli", "bench", "step_bench", "__init__"}, importers


def test_periodic_eval_and_sample_grids_go_to_tensorboard(tmp_path):
    over = [*RING, "sharding.num_devices=1", "steps=4", "checkpoint.enabled=false"]
    cfg = load_train_config("tiny", [*over, "eval.every=2", "eval.sample_every=3"])
    Trainer(cfg, str(tmp_path), progress=False).train()
    (events,) = read_events(tmp_path / "tb").values()  # one writer
    for name in ("fd", "kid", "classifier_score", "modes_covered"):
        assert [step for step, _ in events[f"eval/{name}"]] == [2, 4], name
    fd = [v for _, v in events["eval/fd"]]
    assert all(np.isfinite(fd)) and fd[0] != fd[1]  # the generator moved between evaluations
    assert [step for step, _ in events["train/d_loss"]] == [1, 2, 3, 4]
    images = events["samples"]
    assert [step for step, _ in images] == [3, 4]  # sample_every, then the run's final grid
    assert images[0][1].height > 100 and images[0][1].encoded_image_string[:4] == b"\x89PNG"
    assert sorted(p.name for p in tmp_path.glob("samples_step*.png")) == [
        "samples_step3.png",
        "samples_step4.png",
    ]
    # A run stopped by time before `steps`: the end does not repeat what the loop wrote.
    timed = Trainer(cfg, str(tmp_path / "timed"), progress=False)
    assert timed.train(seconds=0.0)["step"] == 2
    (events,) = read_events(tmp_path / "timed" / "tb").values()
    assert [step for step, _ in events["eval/fd"]] == [2]
    assert [step for step, _ in events["samples"]] == [2]


def test_bench_step_times_the_sync_step_and_counts_params(tmp_path, capsys):
    out = tmp_path / "step.json"
    args = ["--config", "tiny", *RING, "sharding.num_devices=1"]
    assert main(["bench-step", *args, "--steps", "3", "--warmup", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["steps"] == 3 and len(res["step_ms"]) == 3 and res["devices"] == 1
    assert res["step_ms_median"] == pytest.approx(sorted(res["step_ms"])[1])
    # The ring MLPs (z 8, 2 hidden layers of 16): G 8*16+16 + 16*16+16 + 16*2+2, D 2*16+16 +
    # 16*16+16 + 16+1: the trainable params alone (no EMA, Adam moments or SN vectors).
    assert (res["g_params"], res["d_params"]) == (450, 337)
    assert main(["bench-step", *args, "scheme=async"]) == 2
    assert "bench-step times the sync step" in capsys.readouterr().err
    cfg = load_train_config("tiny", [*RING, "sharding.num_devices=1"])
    with pytest.raises(ConfigError, match="eval.num_samples=0"):  # validated like a run
        step_bench(
            dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, num_samples=0)), 1, 0
        )
    with pytest.raises(ConfigError, match="num_devices=64 but only 8"):  # the run's devices
        step_bench(
            dataclasses.replace(cfg, sharding=dataclasses.replace(cfg.sharding, num_devices=64)),
            1,
            0,
        )
