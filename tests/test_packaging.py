"""The wheel: presets, py.typed and data inside the packages, console scripts, extras, license.

Builds the wheel (``pip wheel --no-deps``, the build backend fetched by pip as for any user) from
a copy of the source tree, so the shared checkout is not touched by the build. Also checks, by
reading every import, that each package needs only the core dependencies plus its own extra.
"""

import ast
import re
import shutil
import subprocess
import sys
import tomllib
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
    assert "serve_jax/data/azure_llm_conv_2023.csv.gz" in names
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


# Top-level modules each distribution provides (or brings with it, like pydantic with FastAPI).
DIST_MODULES = {
    "jax": {"jax", "jaxlib"},
    "flax": {"flax"},
    "numpy": {"numpy"},
    "scipy": {"scipy"},
    "omegaconf": {"omegaconf"},
    "pyyaml": {"yaml"},
    "safetensors": {"safetensors"},
    "tokenizers": {"tokenizers"},
    "fastapi": {"fastapi", "pydantic", "starlette"},
    "uvicorn": {"uvicorn"},
    "httpx": {"httpx"},
    "prometheus-client": {"prometheus_client"},
    "matplotlib": {"matplotlib"},
    "optax": {"optax"},
    "orbax-checkpoint": {"orbax", "absl"},
    "tensorstore": {"tensorstore"},
    "scikit-learn": {"sklearn"},
    "tqdm": {"tqdm"},
    "tensorboardX": {"tensorboardX"},
    "pillow": {"PIL"},
    "jinja2": {"jinja2"},
    "etils": {"etils"},
}
EXTRA_OF = {"tapas_jax": None, "serve_jax": "serve", "paragan_jax": "gan"}


def _provided(requirements: list[str]) -> set[str]:
    modules = set()
    for req in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0)
        if name == "jax-parallel-stack":
            continue
        assert name in DIST_MODULES, f"{name}: add the modules it provides to DIST_MODULES"
        modules |= DIST_MODULES[name]
    return modules


def _required_imports(path: Path) -> set[str]:
    """Third-party top-level modules a file imports, except those under try/except ImportError."""
    optional: set[int] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            optional |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in optional:
            continue
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", *EXTRA_OF}


@pytest.mark.parametrize("package", list(EXTRA_OF))
def test_each_package_needs_only_the_core_and_its_extra(package):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = EXTRA_OF[package]
    allowed = _provided(project["dependencies"])
    if extra is not None:
        allowed |= _provided(project["optional-dependencies"][extra])
    problems = [
        f"  {path.relative_to(ROOT)}: {', '.join(sorted(missing))}"
        for path in sorted((ROOT / package).rglob("*.py"))
        if (missing := _required_imports(path) - allowed)
    ]
    assert not problems, (
        f"{package} imports modules that neither the core dependencies nor the "
        f"{extra or 'core'} extra install (add them to pyproject.toml, or import them inside "
        "try/except ImportError):\n" + "\n".join(problems)
    )
