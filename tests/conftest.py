"""Test harness: 8 simulated CPU devices, mesh fixtures, and the device-count check.

The environment variables must be set before jax is imported anywhere, which is why they are
set at the top of this file (pytest imports conftest.py before the test modules).
"""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

from tapas_jax import mesh as mesh_lib  # noqa: E402

NUM_DEVICES = 8


@pytest.fixture(scope="session", autouse=True)
def _require_eight_devices():
    n = jax.device_count()
    if n < NUM_DEVICES:
        pytest.fail(
            f"the tests need {NUM_DEVICES} devices but jax sees {n} "
            f"(backend {jax.default_backend()!r}). Set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES} before jax is "
            "imported, and do not import jax in a plugin that loads before tests/conftest.py.",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def mesh8():
    """A 1-D mesh over all 8 devices, axis ``data``."""
    return mesh_lib.make_mesh("data=8")


@pytest.fixture(scope="session")
def mesh_2x4():
    """The ``data=2, model=4`` mesh used for tensor-parallel tests."""
    return mesh_lib.make_mesh("data=2,model=4")


@pytest.fixture(scope="session")
def abstract_mesh_1024():
    """An abstract ``data=32, model=32`` mesh: 1024 chips, no devices."""
    return mesh_lib.abstract_mesh("data=32,model=32", 1024)
