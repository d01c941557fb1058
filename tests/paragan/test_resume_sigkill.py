"""Exact resume: a training process killed with SIGKILL and resumed ends bitwise equal to an
uninterrupted run (sync scheme, one device)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import RING

from paragan_jax.config import load_train_config
from paragan_jax.train import Trainer

OVERRIDES = [*RING, "checkpoint.every=5", "checkpoint.keep=2", "sharding.num_devices=1"]


def _train_cmd(workdir: Path, steps: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "paragan_jax",
        "train",
        "--config",
        "tiny",
        "--workdir",
        str(workdir),
        "--steps",
        str(steps),
        "--no-progress",
        *OVERRIDES,
    ]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _finished_steps(ckpt: Path) -> list[int]:
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_sigkill_then_resume_is_bitwise_exact(tmp_path):
    workdir = tmp_path / "run"
    ckpt = workdir / "checkpoints"
    proc = subprocess.Popen(
        _train_cmd(workdir, 10**6),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not _finished_steps(ckpt):
            assert proc.poll() is None, f"training exited early: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 240 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL

    latest = _finished_steps(ckpt)[-1]
    target = latest + 7  # not a multiple of the save interval: the final save is at exit
    resumed = subprocess.run(
        _train_cmd(workdir, target), env=_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"to step {target}" in resumed.stdout

    cfg = load_train_config("tiny", [*OVERRIDES, f"steps={target}"])
    uninterrupted = Trainer(cfg, str(tmp_path / "straight"), progress=False)
    uninterrupted.train()
    after_kill = Trainer(cfg, str(workdir), progress=False)
    assert after_kill.restore() == target
    a, b = uninterrupted.runner.state, after_kill.runner.state
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
