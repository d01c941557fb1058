"""Command dispatch for ``python -m <package> <command> ...`` and the console scripts.

Each package's ``__main__`` lists its commands as ``name -> (module, one-line help)`` (or a
`Command`, which can also mark a worker entry point as internal: runnable, but not listed in the
usage). The module is imported only when its command runs (so ``python -m serve_jax simulate``
never pays for the HTTP server's imports) and must define ``main(argv: list[str]) -> int``, where
``argv[0]`` is the command name (one module may serve several commands).

`dispatch` does the process set-up and the error convention shared by the three packages:

- ``--version`` prints the installed distribution's version;
- a user error (`ConfigError`, `ValueError` such as `MeshSpecError`, `FileNotFoundError`,
  `OSError`, or a subclass) becomes one line ``<prog> <command>: error: <message>`` on stderr and
  exit status 2, without a traceback (``JAXSTACK_DEBUG=1`` re-raises it for developers); so does
  a missing optional dependency (`OPTIONAL_MODULES`), naming the extra that installs it;
- on a machine without accelerators, commands see ``JAXSTACK_CPU_DEVICES`` (default 8) simulated
  CPU devices, as the tests do, so ``--mesh data=2,model=4`` works on a laptop. The flag only
  affects the host platform; it must be set before jax is imported, which is why this module
  imports no jax.

Commands build their parser with `command_parser`: ``--config <preset or .yaml path>`` and
positional ``key=value`` overrides, with every overridable key of the command's config dataclass
listed in ``--help`` (`override_help`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.metadata
import inspect
import json
import os
import sys
import textwrap
import typing
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from .config import preset_names

__all__ = [
    "write_json",
    "CONSOLE_SCRIPTS",
    "Command",
    "OPTIONAL_MODULES",
    "USER_ERRORS",
    "command_parser",
    "dispatch",
    "error_line",
    "override_help",
    "program_name",
    "simulate_cpu_devices",
    "version",
]

DISTRIBUTION = "jax-parallel-stack"
"""The distribution (wheel) that ships tapas_jax, serve_jax and paragan_jax."""

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
"""Exceptions that are the user's to fix (ConfigError and MeshSpecError are ValueErrors,
FileNotFoundError is an OSError): reported as one line and exit status 2."""

_SERVE_MODULES = "safetensors tokenizers jinja2 fastapi pydantic uvicorn httpx prometheus_client"
_GAN_MODULES = "optax orbax tensorstore etils sklearn tqdm tensorboardX"
OPTIONAL_MODULES = {
    **dict.fromkeys(_SERVE_MODULES.split(), "serve"),
    **dict.fromkeys(_GAN_MODULES.split(), "gan"),
    **dict.fromkeys(("matplotlib", "PIL"), "serve,gan"),
    "libtpu": "tpu",
}
"""Top-level modules of optional dependencies -> the extra of the distribution installing them."""

CONSOLE_SCRIPTS = {"tapas_jax": "tapas", "serve_jax": "serve-jax", "paragan_jax": "paragan"}
"""package -> its console script ([project.scripts] in pyproject.toml points at its __main__)."""

_programs: dict[str, str] = {}
"""package -> how the user ran it (``tapas`` or ``python -m tapas_jax``), set by `dispatch`."""


class Command(NamedTuple):
    """One entry of a package's command registry."""

    module: str
    """Module whose ``main(argv)`` runs the command."""
    help: str
    """One-line description shown in the usage."""
    internal: bool = False
    """A worker entry point started by another command: runnable, but not listed in the usage."""


def simulate_cpu_devices(default: int = 8) -> None:
    """Asks XLA for several host (CPU) devices, unless jax is already imported or flags say."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = int(os.environ.get("JAXSTACK_CPU_DEVICES", default))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def version() -> str:
    """The installed version of the distribution, or ``"unknown"`` when run from a bare tree."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def program_name(package: str) -> str:
    """How the user ran ``package``: a console script (``serve-jax``) or ``python -m serve_jax``."""
    return _programs.get(package, f"python -m {package}")


def _invoked_as(package: str) -> str:
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    if script and script == CONSOLE_SCRIPTS.get(package):
        return script
    return f"python -m {package}"


def error_line(error: BaseException) -> str:
    """A user error as one line of text (an OSError names its file and the system's reason)."""
    if isinstance(error, OSError) and error.strerror:
        where = f"{error.filename}: " if error.filename is not None else ""
        message = f"{where}{error.strerror}"
    else:
        message = str(error)
    message = "; ".join(line.strip() for line in message.splitlines() if line.strip())
    return message or type(error).__name__


def _usage(prog: str, commands: Mapping[str, Command]) -> str:
    public = {name: c for name, c in commands.items() if not c.internal}
    width = max(map(len, public), default=0)
    lines = [f"usage: {prog} <command> [options]   ({prog} <command> --help for its options)"]
    lines += ["", "commands:"]
    lines += [f"  {name:<{width}}  {c.help}" for name, c in public.items()]
    lines += ["", "options:", "  -h, --help  this message", "  --version   the installed version"]
    return "\n".join(lines)


def dispatch(
    package: str,
    commands: Mapping[str, Command | tuple[str, str]],
    argv: Sequence[str],
) -> int:
    """Runs ``commands[argv[0]]`` with the remaining arguments; returns the exit status.

    Prints the usage for no command or ``--help`` and the version for ``--version``. A user error
    raised by the command is printed as one line and gives exit status 2 (see the module doc).
    """
    registry = {name: Command(*entry) for name, entry in commands.items()}
    prog = _programs[package] = _invoked_as(package)
    argv = list(argv)
    usage = _usage(prog, registry)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage, file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(f"{prog} ({DISTRIBUTION}) {version()}")
        return 0
    name = argv[0]
    if name not in registry:
        print(f"{prog}: error: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    simulate_cpu_devices()
    try:
        module = importlib.import_module(registry[name].module)
        return int(module.main(argv) or 0)
    except USER_ERRORS as e:
        if os.environ.get("JAXSTACK_DEBUG") == "1":
            raise
        print(f"{prog} {name}: error: {error_line(e)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        extra = OPTIONAL_MODULES.get((e.name or "").split(".")[0])
        if extra is None or os.environ.get("JAXSTACK_DEBUG") == "1":
            raise
        print(
            f"{prog} {name}: error: this command needs {e.name}, an optional dependency; "
            f"install it with: pip install '{DISTRIBUTION}[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"{prog} {name}: interrupted", file=sys.stderr)
        return 130


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) of a dataclass, by field."""
    docs: dict[str, str] = {}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return docs
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    for stmt, after in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _override_rows(
    cls: type, prefix: str = "", defaults: Any = None
) -> Iterator[tuple[str, str, str]]:
    """Rows of `override_help`; ``defaults`` is the instance a nested section defaults to."""
    docs = _field_docs(cls)
    hints = _type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        key = prefix + field.name
        hint = hints.get(field.name, field.type)
        if defaults is not None:
            value = getattr(defaults, field.name)
        elif field.default is not dataclasses.MISSING:
            value = field.default
        elif field.default_factory is not dataclasses.MISSING:
            value = field.default_factory()
        else:
            value = dataclasses.MISSING
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            # A section's defaults are its parent's default instance, not its class defaults.
            section = value if dataclasses.is_dataclass(value) else None
            yield from _override_rows(hint, key + ".", section)
            continue
        default = "required" if value is dataclasses.MISSING else repr(value)
        type_text = field.type if isinstance(field.type, str) else getattr(hint, "__name__", "")
        yield key, f"{type_text} = {default}", docs.get(field.name, "")


def _type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a hint that cannot be resolved here: fall back to the field's text
        return {}


def override_help(cls: type, width: int = 100) -> str:
    """The ``key=value`` overrides a config dataclass accepts: dotted key, type, default, doc."""
    lines = [f"key=value overrides ({cls.__name__}):"]
    for key, type_default, doc in _override_rows(cls):
        lines.append(f"  {key} ({type_default})")
        if doc:
            lines += textwrap.wrap(doc, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(lines)


def command_parser(
    package: str,
    command: str,
    config_cls: type | None = None,
    *,
    description: str | None = None,
    example: str = "model.width=64",
) -> argparse.ArgumentParser:
    """An argparse parser for ``<prog> <command>`` with ``--config`` and ``key=value`` overrides.

    Args:
      package: the import package (``"serve_jax"``); its presets are listed in ``--config``'s help.
      command: the command name.
      config_cls: the command's config dataclass; when given, ``--help`` lists every override key
        with its type, default and docstring, and ``--config``/``overrides`` are added.
      description: shown at the top of ``--help``.
      example: an override shown in the help of the positional ``overrides``.

    The parsed namespace has ``config`` (preset name, path or None) and ``overrides`` (list).
    """
    epilog = override_help(config_cls) if config_cls is not None else None
    parser = argparse.ArgumentParser(
        prog=f"{program_name(package)} {command}",
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if config_cls is not None:
        names = ", ".join(preset_names(package))
        parser.add_argument(
            "--config",
            metavar="PRESET",
            help=f"preset name ({names}) or a path to a .yaml file",
        )
        parser.add_argument(
            "overrides",
            nargs="*",
            metavar="key=value",
            help=f"key=value overrides, e.g. {example} (keys listed below)",
        )
    return parser


def write_json(path: str | os.PathLike | None, payload: Any) -> Path | None:
    """Writes a command's ``payload`` as JSON at ``path`` (parents created) and says so.

    Does nothing for None or "" (no ``--json`` given). NumPy scalars are written as floats.
    """
    if not path:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(f"wrote {path}")
    return path
