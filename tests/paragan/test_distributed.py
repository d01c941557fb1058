"""The async scheme across two processes (jax.distributed, gloo): G in one, D in the other."""

import numpy as np
import pytest
from conftest import RING

from paragan_jax.distributed import run_two_process_async


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
