"""The packages' top-level names stay what they say, whatever was imported before them.

The lazy exports (``_EXPORTS`` + ``__getattr__``) are invisible to type checkers, so each
package's ``__init__`` also imports every one of them under ``if TYPE_CHECKING:``; the test below
checks that block names exactly the exports, from the modules ``_EXPORTS`` says.
"""

import ast
import importlib
import importlib.util
import pkgutil
import types
from pathlib import Path

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


def _type_checking_imports(package: str) -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in the package's __init__."""
    init = Path(importlib.import_module(package).__file__)
    found: dict[str, str] = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for stmt in node.body:
                assert isinstance(stmt, ast.ImportFrom), ast.dump(stmt)
                module = ("." * stmt.level + stmt.module) if stmt.level else stmt.module
                resolved = importlib.util.resolve_name(module, package)
                for alias in stmt.names:
                    assert alias.asname is None, alias.asname
                    found[alias.name] = resolved
    return found


@pytest.mark.parametrize("package", ["tapas_jax", "paragan_jax", "serve_jax"])
def test_every_lazy_export_is_imported_for_type_checkers(package):
    pkg = importlib.import_module(package)
    exports = {
        name: importlib.util.resolve_name(module, package) for name, module in pkg._EXPORTS.items()
    }
    seen = _type_checking_imports(package)
    missing = sorted(set(exports) - set(seen))
    assert not missing, f"{package}: lazy exports missing from the TYPE_CHECKING block: {missing}"
    extra = sorted(set(seen) - set(exports))
    assert not extra, f"{package}: TYPE_CHECKING imports that are not lazy exports: {extra}"
    wrong = {n: (seen[n], m) for n, m in exports.items() if seen[n] != m}
    assert not wrong, f"{package}: TYPE_CHECKING module differs from _EXPORTS: {wrong}"
    assert sorted(pkg.__all__) == sorted(exports), f"{package}: __all__ is not the exports"
