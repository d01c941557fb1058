"""Import guardrails: the layering of the three packages, read from their source with ast.

Every import of every module of tapas_jax, serve_jax and paragan_jax is read, inside functions
too (relative imports resolved; ``from pkg import Name`` of a lazy package export counts as an
import of the module that defines it; imports under ``if TYPE_CHECKING:`` never run and are
skipped). The tests fail, with the import chain spelled out, on:

- a cycle between modules;
- jax, jaxlib, flax or optax reachable from serve_jax's pure side (the scheduler, KV block
  manager, preemption policies, predictor, workloads and cost model), which must stay importable
  and fast without JAX;
- the simulator reaching the JAX engine, executor or model;
- serve_jax and paragan_jax importing each other, or tapas_jax (the floor) importing either;
- an import of the stack's own modules inside a function, except in ``__init__.py`` (lazy
  exports), ``__main__.py`` and the command dispatch `tapas_jax.commands`.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tapas_jax", "serve_jax", "paragan_jax")
JAX_LIBS = {"jax", "jaxlib", "flax", "optax"}
SERVE_PURE = ("scheduler", "kv_blocks", "preemption", "predictor", "workloads", "costmodel")
JAX_SERVING = {"serve_jax.engine", "serve_jax.executor", "serve_jax.model"}
LAZY_IMPORTS_ALLOWED = {"tapas_jax.commands"}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module name."""

    source: str
    target: str
    line: int
    in_function: bool

    def where(self) -> str:
        return f"{self.source} (line {self.line})"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _discover() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[_module_name(path)] = path
    return modules


MODULES = _discover()


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _lazy_exports(package: str) -> dict[str, str]:
    """A package's ``_EXPORTS`` (name -> defining module), read from its ``__init__``."""
    tree = ast.parse(MODULES[package].read_text())
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            out = {}
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                    target = v.value
                    out[k.value] = package + target if target.startswith(".") else target
            return out
    return {}


EXPORTS = {p: _lazy_exports(p) for p in PACKAGES}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    def __init__(self, module: str):
        self.module = module
        self.package = module if _is_package(module) else module.rpartition(".")[0]
        self.depth = 0
        self.found: list[Import] = []

    def _add(self, target: str, line: int) -> None:
        self.found.append(Import(self.module, target, line, self.depth > 0))

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        if module == "__future__":
            return
        names = [alias.name for alias in node.names]
        submodules = [f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES]
        exported = [EXPORTS[module][n] for n in names if n in EXPORTS.get(module, {})]
        for target in submodules + exported:
            self._add(target, node.lineno)
        if len(submodules) + len(exported) < len(names):
            self._add(module, node.lineno)


def _collect() -> dict[str, list[Import]]:
    imports = {}
    for module, path in MODULES.items():
        collector = _Collector(module)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        imports[module] = collector.found
    return imports


IMPORTS = _collect()


def _own(target: str) -> str | None:
    """The stack module an import target names (a module or a package), or None."""
    while target:
        if target in MODULES:
            return target
        target = target.rpartition(".")[0]
    return None


def _edges(module: str) -> list[Import]:
    return [i for i in IMPORTS[module] if _own(i.target) is not None]


def _reach(start: str, is_bad) -> list[Import] | None:
    """The shortest import chain from `start` to an import for which `is_bad` holds, or None."""
    queue = deque([(start, [])])
    seen = {start}
    while queue:
        module, path = queue.popleft()
        for imp in IMPORTS[module]:
            if is_bad(imp):
                return path + [imp]
            own = _own(imp.target)
            if own is not None and own not in seen:
                seen.add(own)
                queue.append((own, path + [imp]))
    return None


def _describe(chain: list[Import]) -> str:
    lines = []
    for imp in chain:
        kind = " inside a function" if imp.in_function else ""
        lines.append(f"    {imp.source}, line {imp.line}{kind}: import {imp.target}")
    return "\n".join(lines)


def test_the_modules_were_found():
    for package in PACKAGES:
        assert package in MODULES and f"{package}.__main__" in MODULES
    assert {"serve_jax.scheduler", "serve_jax.kv_blocks"} <= set(MODULES)
    assert any(m.rpartition(".")[2].startswith("simul") for m in MODULES)


def test_no_import_cycles():
    graph = {m: sorted({_own(i.target) for i in _edges(m)} - {None}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def strongconnect(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            strongconnect(v)
    problems = []
    for component in components:
        members = set(component)
        lines = [
            f"    {i.source}, line {i.line}: import {i.target}"
            for m in component
            for i in _edges(m)
            if _own(i.target) in members
        ]
        problems.append(f"  cycle among {', '.join(component)}:\n" + "\n".join(lines))
    assert not problems, "import cycles between modules:\n" + "\n".join(problems)


def test_serve_pure_side_never_reaches_jax():
    problems = []
    for name in SERVE_PURE:
        module = f"serve_jax.{name}"
        if module not in MODULES:
            continue
        chain = _reach(module, lambda i: i.target.split(".")[0] in JAX_LIBS)
        if chain:
            problems.append(f"  {module} reaches {chain[-1].target}:\n{_describe(chain)}")
    assert not problems, "JAX reachable from serve_jax's pure side:\n" + "\n".join(problems)


def test_simulator_never_reaches_the_jax_engine():
    simulators = [m for m in MODULES if m.startswith("serve_jax.sim")]
    assert "serve_jax.simulator" in simulators
    problems = []
    for module in simulators:
        chain = _reach(module, lambda i: _own(i.target) in JAX_SERVING)
        if chain:
            problems.append(f"  {module} reaches {_own(chain[-1].target)}:\n{_describe(chain)}")
    assert not problems, "the simulator imports the JAX serving path:\n" + "\n".join(problems)


def test_packages_are_layered():
    forbidden = {
        "serve_jax": ("paragan_jax",),
        "paragan_jax": ("serve_jax",),
        "tapas_jax": ("serve_jax", "paragan_jax"),
    }
    problems = [
        f"  {i.source}, line {i.line}: import {i.target}"
        for m in MODULES
        for i in IMPORTS[m]
        if i.target.split(".")[0] in forbidden[m.split(".")[0]]
    ]
    assert not problems, (
        "serve_jax and paragan_jax must not import each other, nor tapas_jax either of them:\n"
        + "\n".join(problems)
    )


def test_own_imports_are_at_the_top_of_files():
    problems = [
        f"  {i.source}, line {i.line}: import {i.target}"
        for m in MODULES
        if m.rpartition(".")[2] != "__main__"
        and not _is_package(m)
        and m not in LAZY_IMPORTS_ALLOWED
        for i in _edges(m)
        if i.in_function
    ]
    assert not problems, (
        "imports of the stack's own modules inside functions (move them to the top of the "
        "file; only __init__, __main__ and tapas_jax.commands import lazily):\n"
        + "\n".join(problems)
    )
