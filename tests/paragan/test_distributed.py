"""The async scheme across two processes (jax.distributed, gloo): G in one, D in the other."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import RING

from paragan_jax.checkpoint import CheckpointStore
from paragan_jax.distributed import free_port, run_two_process_async


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 2])
def test_two_process_async_trains(tmp_path, k):
    result = run_two_process_async(
        "tiny", [*RING, f"async_.staleness={k}"], str(tmp_path / "out"), steps=6, timeout_s=300
    )
    assert result["processes"] == 2 and result["staleness"] == k
    assert result["steps"] == 6
    samples = result["samples"]
    assert samples.shape == (256, 2) and np.isfinite(samples).all()


@pytest.mark.slow
def test_two_process_async_checkpoints_resume_bit_for_bit(tmp_path):
    over = [*RING, "async_.staleness=2", "checkpoint.every=3", "checkpoint.keep=2"]

    def run(out, steps):
        return run_two_process_async(
            "tiny", over, str(tmp_path / out), steps=steps, timeout_s=600, checkpoint=True
        )

    straight = run("straight", 7)
    assert straight["steps"] == 7 and straight["resumed_from"] is None
    assert run("split", 4)["steps"] == 4  # saves at 3 and at the end (4)
    ckpt = tmp_path / "split" / "checkpoints"
    assert sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == [3, 4]
    # The newest checkpoint is damaged: both processes fall back to iteration 3.
    (ckpt / "4" / "sha256.json").write_text('{"meta/metadata": "0"}')
    resumed = run("split", 7)
    assert resumed["resumed_from"] == 3 and resumed["steps"] == 7 and resumed["steps_run"] == 4
    assert (ckpt / "corrupt-4").is_dir()
    assert resumed["state_sha256"] == straight["state_sha256"]
    np.testing.assert_array_equal(resumed["samples"], straight["samples"])


def _killed_after_two_checkpoints(out, over: list[str], timeout: float = 300) -> None:
    """Starts the two async workers with checkpoints and no step limit; SIGKILLs both once two
    checkpoints are complete (process 0 writes a step's sha256.json when its save finished)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    port, ckpt = free_port(), out / "checkpoints"
    common = ["--num-processes", "2", "--port", str(port), "--config", "tiny", "--out", str(out)]
    common += ["--steps", str(10**6), "--checkpoint", *over]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "paragan_jax", "async-worker", "--process-id", str(i), *common],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        deadline = time.monotonic() + timeout
        while len(list(ckpt.glob("*/sha256.json"))) < 2:
            for p in procs:
                assert p.poll() is None, f"worker exited early: {p.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, f"no two checkpoints within {timeout:.0f} s"
            time.sleep(0.05)
    finally:
        for p in procs:
            p.kill()
            p.communicate(timeout=30)
    assert [p.returncode for p in procs] == [-signal.SIGKILL] * 2


@pytest.mark.slow
def test_two_process_async_sigkill_resumes_bit_for_bit_past_a_bit_flipped_checkpoint(tmp_path):
    over = [*RING, "async_.staleness=2", "checkpoint.every=3", "checkpoint.keep=3"]
    out, ckpt = tmp_path / "killed", tmp_path / "killed" / "checkpoints"
    _killed_after_two_checkpoints(out, over)
    steps = CheckpointStore(ckpt).steps()
    assert len(steps) >= 2
    newest, previous = steps[-1], steps[-2]
    manifest = json.loads((ckpt / str(newest) / "sha256.json").read_text())
    biggest = max((ckpt / str(newest) / name for name in manifest), key=lambda f: f.stat().st_size)
    data = bytearray(biggest.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])  # same size
    biggest.write_bytes(bytes(data))
    target = newest + 2
    resumed = run_two_process_async(
        "tiny", over, str(out), steps=target, timeout_s=600, checkpoint=True
    )
    assert resumed["resumed_from"] == previous and resumed["steps"] == target
    assert (ckpt / f"corrupt-{newest}").is_dir()
    straight = run_two_process_async(
        "tiny", over, str(tmp_path / "straight"), steps=target, timeout_s=600, checkpoint=True
    )
    assert resumed["state_sha256"] == straight["state_sha256"]
    np.testing.assert_array_equal(resumed["samples"], straight["samples"])
