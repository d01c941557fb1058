"""Runs around the step loop: SIGTERM saves and exits 0 (one process, and two joined by
jax.distributed), the workdir lock, checkpoint checksums, exact async resume (fake buffer in the
checkpoint) and params_sha256."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import orbax.checkpoint as ocp
import pytest
from conftest import RING
from tb_events import read_events

from paragan_jax import cli
from paragan_jax.__main__ import main
from paragan_jax.checkpoint import CheckpointStore, as_path, tree_sha256
from paragan_jax.config import load_train_config
from paragan_jax.data import PrefetchLoader
from paragan_jax.train import Trainer
from paragan_jax.workdir import LOCK_NAME

ONE = [*RING, "sharding.num_devices=1"]
ASYNC = [*RING, "scheme=async", "sharding.num_devices=2", "async_.staleness=2"]
ASYNC += ["async_.buffer_size=3"]


def _sigterm_at(batch_index: int):
    """A batch iterator factory that sends this process a real SIGTERM at one batch."""

    def factory(dataset, batch_size, seed, start):
        loader = PrefetchLoader(dataset, batch_size, seed, start, 2)
        for i, batch in enumerate(loader):
            if start + i == batch_index:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    return factory


def test_sigterm_saves_at_the_step_and_the_rerun_resumes_there(tmp_path):
    cfg = load_train_config("tiny", [*ONE, "steps=20", "checkpoint.every=100"])
    work = tmp_path / "stopped"
    t = Trainer(cfg, str(work), batch_iterator_factory=_sigterm_at(6), progress=False)
    summary = t.train()
    stop = summary["preempted_at"]
    assert stop is not None and 6 <= stop < 20 and summary["step"] == stop
    assert CheckpointStore(work / "checkpoints").steps() == [stop]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    resumed = Trainer(cfg, str(work), progress=False)
    summary = resumed.train()
    assert summary["resumed_from"] == stop and summary["step"] == 20
    assert summary["preempted_at"] is None and not (work / LOCK_NAME).exists()
    straight = Trainer(cfg, str(tmp_path / "straight"), progress=False)
    straight.train()
    assert resumed.state_sha256() == straight.state_sha256()


def test_a_second_run_on_a_workdir_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": os.getpid(), "host": os.uname()[1]}))
    args = ["train", "--config", "tiny", "--workdir", str(tmp_path), "--no-progress", *ONE]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "in use by another run" in err and str(os.getpid()) in err
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that is no longer running
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": gone.pid, "host": os.uname()[1]}))
    assert cli.main(args + ["--steps", "2"]) == 0
    assert not (tmp_path / LOCK_NAME).exists()


def test_a_bit_flipped_newest_checkpoint_is_detected_and_skipped(tmp_path):
    cfg = load_train_config("tiny", [*ONE, "steps=4", "checkpoint.every=2"])
    Trainer(cfg, str(tmp_path), progress=False).train()
    ckpt = tmp_path / "checkpoints"
    manifest = json.loads((ckpt / "4" / "sha256.json").read_text())
    assert any(name.startswith("state/") for name in manifest)
    files = [ckpt / "4" / name for name in manifest if name.startswith("state/")]
    biggest = max(files, key=lambda f: f.stat().st_size)
    data = bytearray(biggest.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])  # same size
    biggest.write_bytes(bytes(data))
    t = Trainer(cfg, str(tmp_path), progress=False)
    with pytest.warns(RuntimeWarning, match="step 4 .*ChecksumError"):
        assert t.restore() == 2
    assert (ckpt / "corrupt-4").is_dir() and CheckpointStore(ckpt).steps() == [2]


def test_async_resume_with_a_deep_buffer_is_exact(tmp_path):
    cfg = load_train_config("tiny", [*ASYNC, "steps=6", "checkpoint.every=3"])
    full = Trainer(cfg, str(tmp_path / "full"), progress=False)
    full.train()
    Trainer(cfg, str(tmp_path / "part"), progress=False).train(steps=3)
    resumed = Trainer(cfg, str(tmp_path / "part"), progress=False)
    assert resumed.train()["resumed_from"] == 3
    assert len(resumed.runner.checkpoint_tree()["buffer"]) == 3
    assert resumed.state_sha256() == full.state_sha256()
    # A checkpoint from before the buffer was saved restores, with a warning.
    old = CheckpointStore(tmp_path / "old" / "checkpoints")
    tree = dict(full.runner.checkpoint_tree())
    del tree["buffer"]
    old._manager.save(  # what an older version wrote: no buffer, no state_keys
        6, args=_composite(tree, {"step": 6, "data_position": 6, "scheme": "async"})
    )
    old.close()
    legacy = Trainer(cfg, str(tmp_path / "old"), progress=False)
    with pytest.warns(RuntimeWarning, match=r"predates \['buffer'\]"):
        assert legacy.restore() == 6
    assert tree_sha256(legacy.runner.g_state) == tree_sha256(full.runner.g_state)
    assert len(legacy.runner.buffer) == 0  # refilled from the restored G on the next step


def _composite(state, meta):
    return ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _train_cmd(workdir: Path, steps: int, overrides: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        *("-m", "paragan_jax", "train", "--config", "tiny", "--workdir", str(workdir)),
        *("--steps", str(steps), "--no-progress", *extra, *overrides),
    ]


def _wait_for_checkpoint(proc: subprocess.Popen, ckpt: Path, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not (ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())):
        assert proc.poll() is None, f"training exited early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"no checkpoint within {timeout:.0f} s"
        time.sleep(0.05)


@pytest.mark.slow
def test_two_processes_sigterm_saves_exits_0_and_the_rerun_resumes(tmp_path):
    work, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    over = [*RING, "sharding.num_devices=0", "checkpoint.every=10", "checkpoint.keep=5"]
    over += ["eval.every=5", "eval.sample_every=5"]
    cmd = _train_cmd(work, 10**6, over, "--num-processes", "2")
    proc = subprocess.Popen(
        cmd, env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        _wait_for_checkpoint(proc, ckpt)
        proc.send_signal(signal.SIGTERM)  # the launcher passes it on to both processes
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    assert out.count("SIGTERM: stopped at step") == 1  # printed by process 0 only
    stop = int(out.split("SIGTERM: stopped at step ")[1].split()[0])
    assert stop in CheckpointStore(ckpt).steps() and stop % 10  # saved at the stop step itself
    (events,) = read_events(work / "tb").values()  # one TensorBoard writer: process 0
    for tag in ("eval/fd", "eval/modes_covered", "samples"):  # periodic eval, both processes
        assert [step for step, _ in events[tag]][:2] == [5, 10], tag
    rerun = subprocess.run(
        _train_cmd(work, stop + 3, over, "--num-processes", "2"),
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert f"resumed from step {stop}" in rerun.stdout and f"to step {stop + 3}" in rerun.stdout
    assert len(list((work / "tb").iterdir())) == 2 and not (work / LOCK_NAME).exists()


@pytest.mark.slow
def test_async_sigkill_resume_gives_the_params_sha256_of_an_uninterrupted_run(tmp_path):
    over = [*ASYNC, "checkpoint.every=5", "checkpoint.keep=2"]
    work, ckpt = tmp_path / "run", tmp_path / "run" / "checkpoints"
    proc = subprocess.Popen(
        _train_cmd(work, 10**6, over),
        env=_env(2),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _wait_for_checkpoint(proc, ckpt)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL
    latest = CheckpointStore(ckpt).steps()[-1]
    target = latest + 7  # past the next save, not on it: the final save is at exit
    digests = []
    for run in (work, tmp_path / "straight"):
        for cmd in (
            _train_cmd(run, target, over),
            [
                sys.executable,
                "-m",
                "paragan_jax",
                "eval",
                "--workdir",
                str(run),
                "--json",
                str(run / "eval.json"),
                "eval.num_samples=64",
            ],
        ):
            done = subprocess.run(
                cmd,
                env=_env(2),
                capture_output=True,
                text=True,
                timeout=300,
            )
            assert done.returncode == 0, done.stderr[-3000:]
        digests.append(json.loads((run / "eval.json").read_text())["params_sha256"])
    assert digests[0] == digests[1]


def test_gs_workdirs_stay_remote_paths(tmp_path, capsys):
    assert str(as_path("gs://bucket/run") / "checkpoints") == "gs://bucket/run/checkpoints"
    assert str(as_path("rel/run")) == str(Path("rel/run").resolve())
    if importlib.util.find_spec("gcsfs") is None:  # without the tpu extra's gs backend
        args = ["train", "--config", "tiny", "--workdir", "gs://no-bucket/run", *ONE]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "gs://no-bucket/run" in err and "gcsfs" in err


def test_a_process_other_than_0_writes_only_its_checkpoint_shares(tmp_path, capsys, monkeypatch):
    """What process 1 of a multi-host run leaves in the workdir: nothing but its part of the
    Orbax saves (every process takes part in them). No TensorBoard events, config, sample PNGs,
    lock or summary, although periodic eval and sample grids are on. (The two-process run in
    `test_two_processes_sigterm_saves_exits_0_and_the_rerun_resumes` shares one directory,
    so only its single events file can tell the processes apart there.)"""
    from paragan_jax import train, workdir

    work = tmp_path / "run"
    flags = ["--steps", "4", "--workdir", str(work), "--no-progress", *ONE]
    flags += ["eval.every=2", "eval.sample_every=2", "checkpoint.every=2"]
    assert cli.main(["train", "--config", "tiny", *flags]) == 0  # process 0: the full set
    written = {p.relative_to(work).parts[0] for p in work.iterdir()}
    assert {"tb", "config.yaml", "checkpoints"} <= written and any(work.glob("*.png"))
    capsys.readouterr()

    other = tmp_path / "other"
    other.mkdir()  # process 0 creates the workdir; the others find it
    for module in (cli, train, workdir):
        monkeypatch.setattr(module, "is_primary", lambda: False)
    flags[flags.index(str(work))] = str(other)
    assert cli.main(["train", "--config", "tiny", *flags]) == 0
    assert [p.name for p in other.iterdir()] == ["checkpoints"]
    assert CheckpointStore(other / "checkpoints").steps()[-1] == 4
    assert capsys.readouterr().out == ""
