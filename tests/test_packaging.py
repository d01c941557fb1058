"""The wheel: presets, py.typed and data inside the packages, console scripts, extras, license.

Builds the wheel (``pip wheel --no-deps``, the build backend fetched by pip as for any user) from
a copy of the source tree, so the shared checkout is not touched by the build.
"""

import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from tapas_jax.config import preset_names

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tapas_jax", "serve_jax", "paragan_jax")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "build", "runs", "out", "*.egg-info", "__pycache__", "*.pyc"
        ),
    )
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp / "dist"), src],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    (path,) = (tmp / "dist").glob("jax_parallel_stack-*.whl")
    return path, r.stdout + r.stderr


def test_presets_and_py_typed_are_in_the_wheel(wheel):
    path, _ = wheel
    names = set(zipfile.ZipFile(path).namelist())
    for package in PACKAGES:
        assert f"{package}/py.typed" in names
        presets = preset_names(package)
        assert presets, package
        for name in presets:
            assert f"{package}/presets/{name}.yaml" in names
    assert "serve_jax/data/azure_llm_conv_2023_sample.csv" in names
    assert not any(n.startswith(("configs/", "tests/")) for n in names)


def test_console_scripts_extras_and_license(wheel):
    path, build_log = wheel
    with zipfile.ZipFile(path) as z:
        info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(z.read(info).decode())
        entry_points = z.read(info.replace("METADATA", "entry_points.txt")).decode()
    for line in (
        "tapas = tapas_jax.__main__:main",
        "serve-jax = serve_jax.__main__:main",
        "paragan = paragan_jax.__main__:main",
    ):
        assert line in entry_points
    assert meta["License-Expression"] == "Apache-2.0"
    assert {"serve", "gan", "tpu", "test", "all"} <= set(meta.get_all("Provides-Extra"))
    core = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    for optional in ("fastapi", "scikit-learn", "matplotlib", "tensorboardX", "optax"):
        assert not any(r.startswith(optional) for r in core), (optional, core)
    assert "deprecat" not in build_log.lower(), build_log
