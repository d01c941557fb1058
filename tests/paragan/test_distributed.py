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
