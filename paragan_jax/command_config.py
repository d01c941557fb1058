"""Flags generated from a command's config dataclass, on top of the shared CLI convention.

``scaling``, ``bench-pipeline`` and ``layout`` each take one frozen dataclass of settings. Their
parser is `tapas_jax.commands.command_parser` (``--config <preset or .yaml path>``, positional
``key=value`` overrides, every key listed in ``--help``) plus, from `add_field_flags`, one
``--flag`` per top-level field (``per_chip_batch`` -> ``--per-chip-batch``; list fields take
comma-separated values, ``--chips 8,64``; a bool flag alone means true), its help the field's
docstring, so no flag is copied by hand and a flag means exactly its field.

`load_command_config` loads the dataclass with `tapas_jax.config.load_config`: defaults, the
preset, the flags, then the overrides. Bad keys or types raise `ConfigError`, out-of-range values
the dataclass's own ``ValueError``; each names the field.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TypeVar

from tapas_jax.commands import command_parser
from tapas_jax.config import load_config, preset_path

__all__ = ["add_field_flags", "command_config_parser", "load_command_config"]

T = TypeVar("T")

PACKAGE = "paragan_jax"


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(
        f.default_factory()
    )


def _is_list(f: dataclasses.Field) -> bool:
    return str(f.type).startswith(("list", "tuple"))


def add_field_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """One ``--flag`` per top-level, non-section field of `cls` (see the module doc)."""
    for f in dataclasses.fields(cls):
        if _is_section(f):
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = f"sets {f.name} (listed below)"
        if f.type in ("bool", bool):
            parser.add_argument(flag, dest=f.name, nargs="?", const="true", help=help_)
        elif _is_list(f):
            parser.add_argument(flag, dest=f.name, metavar="A,B,...", help=help_)
        else:
            parser.add_argument(flag, dest=f.name, metavar=f.name.upper(), help=help_)


def command_config_parser(command: str, cls: type, description: str) -> argparse.ArgumentParser:
    """The parser of ``python -m paragan_jax <command>`` whose settings are the dataclass `cls`."""
    parser = command_parser(PACKAGE, command, cls, description=description, example=_example(cls))
    add_field_flags(parser, cls)
    return parser


def _example(cls: type) -> str:
    f = next(f for f in dataclasses.fields(cls) if not _is_section(f))
    return f"{f.name}=..."


def load_command_config(cls: type[T], args: argparse.Namespace) -> T:
    """`cls` from defaults, ``args.config`` (preset or YAML), the flags, then the overrides."""
    path = preset_path(PACKAGE, args.config) if args.config else None
    overrides = []
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if value is None or _is_section(f):
            continue
        if _is_list(f):
            value = "[" + value + "]"
        overrides.append(f"{f.name}={value}")
    return load_config(cls, path, overrides + list(args.overrides))
