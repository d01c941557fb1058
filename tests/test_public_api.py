"""The packages' top-level names stay what they say, whatever was imported before them."""

import importlib
import pkgutil
import types

import pytest


@pytest.mark.parametrize("package", ["tapas_jax", "paragan_jax", "serve_jax"])
def test_lazy_exports_are_not_shadowed_by_submodules(package):
    pkg = importlib.import_module(package)
    # Importing every submodule first is what used to replace `tapas_jax.plan` (the function)
    # with the module `tapas_jax/plan.py`, so `tapas_jax.plan(...)` broke after any
    # `from tapas_jax.plan import ...` elsewhere in the process.
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("__main__",):
            importlib.import_module(f"{package}.{info.name}")
    for name in pkg._EXPORTS:
        value = getattr(pkg, name)
        assert not isinstance(value, types.ModuleType), f"{package}.{name} is a module"
    if package == "tapas_jax":
        assert callable(pkg.plan) and callable(pkg.verify)
