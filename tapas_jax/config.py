"""Typed configuration for every package of the stack: frozen dataclasses, YAML presets, overrides.

Each package declares its config as frozen dataclasses (one docstring line per field) and loads it
with `load_config`. The library behind it is OmegaConf's structured configs: a YAML preset is merged
onto the dataclass defaults, then dotted command-line overrides (``model.width=64``) onto that, and
the result is validated against the dataclass types. Unknown keys and values of the wrong type are
errors that name the key and the file (or "command line") they came from.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

T = TypeVar("T")

__all__ = ["ConfigError", "load_config", "config_to_dict", "preset_path", "preset_names"]

PRESET_PACKAGES = {"tapas": "tapas_jax", "serve": "serve_jax", "paragan": "paragan_jax"}
"""Short package keys -> the import package whose ``presets/`` folder holds their YAML presets."""

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.\[\]]{0,79}")


class ConfigError(ValueError):
    """A config file or override that does not fit the dataclass it is loaded into."""


def _presets_dir(package: str) -> Path:
    import_name = PRESET_PACKAGES.get(package, package)
    if import_name not in PRESET_PACKAGES.values():
        raise ConfigError(
            f"no presets for package {package!r}; packages: {', '.join(PRESET_PACKAGES)}"
        )
    return Path(str(importlib.resources.files(import_name) / "presets"))


def preset_names(package: str) -> list[str]:
    """The preset names shipped with a package (``"tapas"``, ``"serve"``, ``"paragan"``)."""
    return sorted(p.stem for p in _presets_dir(package).glob("*.yaml"))


def preset_path(package: str, name_or_path: str | os.PathLike) -> Path:
    """Resolves a preset name (``"digits_cpu"``) or an explicit path to a YAML file.

    A bare name resolves only to ``<package>/presets/<name>.yaml`` inside the installed package
    (``package`` is ``"tapas"``, ``"serve"`` or ``"paragan"``, or the import name); anything else
    must be an existing file whose name ends in ``.yaml`` or ``.yml``. A name with a path in it
    (``../tapas/gpt_tiny_cpu``) or a file of another kind (``/etc/shadow``) is a ConfigError that
    names it and lists the known presets.
    """
    text = os.fspath(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml"):
        if not path.is_file():
            raise ConfigError(f"config file {text!r} does not exist")
        return path
    known = preset_names(package)
    if text in known:
        return _presets_dir(package) / f"{text}.yaml"
    raise ConfigError(
        f"no preset {text!r} for {package} (a path must end in .yaml or .yml); "
        f"known presets: {', '.join(known)}"
    )


def _key_name(e: OmegaConfBaseException) -> str:
    """The dotted key of an OmegaConf error, or a placeholder when it is not a plain name.

    A file that is not a config (``/etc/passwd`` parses as YAML) would otherwise have its
    contents echoed back as a "key".
    """
    key = str(getattr(e, "full_key", None) or "?")
    return repr(key) if _PLAIN_KEY.fullmatch(key) else "(a key that is not a plain name)"


def _field_type(owner: Any, key: Any) -> str:
    """The declared type of dataclass field ``key`` of ``owner``, as written in the source."""
    if dataclasses.is_dataclass(owner) and isinstance(key, str):
        for field in dataclasses.fields(owner):
            if field.name == key:
                return field.type if isinstance(field.type, str) else repr(field.type)
    return "the field's type"


def _merge(base, layer, source: str, cls: type, echo_values: bool):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = _key_name(e)
        if isinstance(e, ConfigKeyError):
            raise ConfigError(f"{source}: key {key}: not a field of {cls.__name__}") from None
        expected = _field_type(getattr(e, "object_type", None), getattr(e, "key", None))
        value = getattr(e, "value", None)
        got = f"{value!r}" if echo_values else f"a value of type {type(value).__name__}"
        raise ConfigError(f"{source}: key {key}: expected {expected}, got {got}") from None


def _load_yaml_file(path: Path):
    """Parses a YAML file into an OmegaConf node; errors name the file and position only."""
    try:
        return OmegaConf.load(path)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(path)!r}: {e.strerror}") from None
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        raise ConfigError(f"{path}: not a valid YAML config{where}") from None
    except Exception:  # undecodable bytes, unsupported node types: never echo the contents
        raise ConfigError(f"{path}: not a valid YAML config") from None


def _parse_override(item: str):
    if "=" not in item:
        raise ConfigError(f"command line: override {item!r} is not of the form key=value")
    try:
        return OmegaConf.from_dotlist([item])
    except Exception:  # YAML tags (!!python/...), bad syntax: a user error, not a traceback
        raise ConfigError(
            f"command line: override {item!r} is not a plain key=value (YAML tags are not allowed)"
        ) from None


def load_config(
    cls: type[T],
    path: str | os.PathLike | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
) -> T:
    """Loads a frozen dataclass config from defaults, an optional YAML file and overrides.

    Args:
      cls: the (frozen) dataclass type.
      path: a YAML file whose keys are a subset of the dataclass fields (nested as sections).
      overrides: dotted ``key=value`` strings (command line) or a mapping of dotted keys to values;
        applied last.

    Returns:
      An instance of `cls`.

    Raises:
      ConfigError: an unknown key or a wrong type, naming the key and where it came from; an
        unreadable or invalid file, naming the file (its contents are never echoed).
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    conf = OmegaConf.structured(cls)
    if path is not None:
        path = Path(path)
        layer = _load_yaml_file(path)
        if layer is None or not OmegaConf.is_dict(layer):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        conf = _merge(conf, layer, str(path), cls, echo_values=False)
    if isinstance(overrides, Mapping):
        dotlist = [f"{k}={v}" for k, v in overrides.items()]
    else:
        dotlist = list(overrides)
    for item in dotlist:
        conf = _merge(conf, _parse_override(item), "command line", cls, echo_values=True)
    try:
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as e:
        raise ConfigError(f"key {_key_name(e)}: {str(e).splitlines()[0]}") from None


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain nested dict of a dataclass config (for JSON, TensorBoard and checkpoints)."""
    return dataclasses.asdict(config)


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """What `python -m tapas_jax plan` plans: a zoo model, a mesh and a chip."""

    model: str = "gpt"
    """Zoo model name (gpt, gpt_scan, t5, vit, moe, dcgan)."""
    layers: int = 4
    """Number of repeated blocks."""
    d_model: int = 256
    """Hidden width."""
    heads: int = 8
    """Attention heads."""
    seq_len: int = 128
    """Tokens per example."""
    batch: int = 8
    """Global batch size."""
    vocab: int = 1024
    """Vocabulary size."""
    mesh: str = "data=2,model=4"
    """Mesh spec; -1 on one axis takes the remaining devices."""
    num_devices: int | None = None
    """Plan for this many chips on an abstract mesh; None uses the local devices."""
    hardware: str = "tpu-v5e"
    """Hardware profile name (see tapas_jax.hardware.PROFILES)."""
    memory_limit_gib: float | None = None
    """Per-device memory limit; None uses the profile's HBM size."""
    dtype: str = "float32"
    """Param and activation dtype of the zoo model (float32, bfloat16)."""
    remat: bool = False
    """Rematerialise each layer in the backward pass (activation checkpointing)."""


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    """What `python -m tapas_jax bench` compares: the folded search against the integer program."""

    layers: list[int] = dataclasses.field(default_factory=lambda: [2, 4, 8, 16, 24])
    """GPT depths, one row each."""
    d_model: int = 256
    """Hidden width."""
    heads: int = 8
    """Attention heads."""
    seq_len: int = 128
    """Tokens per example."""
    batch: int = 8
    """Global batch size."""
    vocab: int = 1024
    """Vocabulary size."""
    mesh: str = "data=2,model=4"
    """Mesh spec (an abstract mesh of that many chips; no devices needed)."""
    hardware: str = "tpu-v5e"
    """Hardware profile name (see tapas_jax.hardware.PROFILES)."""
    time_limit: float = 600.0
    """Time limit of each search, seconds."""
    space: str = "batch"
    """batch: the data axis only splits the batch (the planner's default); full: every mesh axis
    may split any dimension (Alpa's space)."""
    warmup: bool = True
    """Run one untimed row first, so the first timed row is not charged for imports and caches."""


@dataclasses.dataclass(frozen=True)
class InfoConfig:
    """What `python -m tapas_jax info` shows: the devices, a resolved mesh, hardware profiles."""

    mesh: str = "data=-1"
    """Mesh spec to resolve on the local devices, e.g. data=2,model=4."""
