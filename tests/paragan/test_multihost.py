"""Runs around the step loop: SIGTERM saves and exits 0 (one process, and two joined by
jax.distributed), the workdir lock, checkpoint checksums, exact async resume (fake buffer in the
checkpoint) and params_sha256."""

import json
import os
import signal
import subprocess

import orbax.checkpoint as ocp
import pytest
from conftest import RING

from paragan_jax import cli
from paragan_jax.__main__ import main
from paragan_jax.checkpoint import CheckpointStore, tree_sha256
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
