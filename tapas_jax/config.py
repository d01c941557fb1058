"""Typed configuration for every package of the stack: frozen dataclasses, YAML presets, overrides.

Each package declares its config as frozen dataclasses (one docstring line per field) and loads it
with `load_config`. The library behind it is OmegaConf's structured configs: a YAML preset is merged
onto the dataclass defaults, then dotted command-line overrides (``model.width=64``) onto that, and
the result is validated against the dataclass types. Unknown keys and values of the wrong type are
errors that name the key and the file (or "command line") they came from.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

T = TypeVar("T")

__all__ = ["ConfigError", "load_config", "config_to_dict", "preset_path"]

CONFIG_ROOT = Path(__file__).resolve().parent.parent / "configs"


class ConfigError(ValueError):
    """A config file or override that does not fit the dataclass it is loaded into."""


def preset_path(package: str, name_or_path: str | os.PathLike) -> Path:
    """Resolves a preset name (``"digits_cpu"``) or a path to a YAML file.

    A bare name is looked up as ``configs/<package>/<name>.yaml`` in the project tree.
    """
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        return path
    candidate = CONFIG_ROOT / package / f"{name_or_path}.yaml"
    if not candidate.exists():
        known = sorted(p.stem for p in (CONFIG_ROOT / package).glob("*.yaml"))
        raise ConfigError(
            f"no preset {str(name_or_path)!r} for {package}; known presets: {', '.join(known)}"
        )
    return candidate


def _merge(base, layer, source: str):
    try:
        return OmegaConf.merge(base, layer)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        raise ConfigError(f"{source}: key {key!r}: {msg}") from None


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
      ConfigError: an unknown key or a wrong type, naming the key and where it came from.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    conf = OmegaConf.structured(cls)
    if path is not None:
        path = Path(path)
        try:
            layer = OmegaConf.load(path)
        except FileNotFoundError:
            raise ConfigError(f"config file {str(path)!r} does not exist") from None
        except Exception as e:  # YAML syntax errors come in several types
            raise ConfigError(f"{path}: cannot parse YAML: {e}") from None
        if layer is None or not OmegaConf.is_dict(layer):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        conf = _merge(conf, layer, str(path))
    if isinstance(overrides, Mapping):
        dotlist = [f"{k}={v}" for k, v in overrides.items()]
    else:
        dotlist = list(overrides)
    for item in dotlist:
        if "=" not in item:
            raise ConfigError(f"command line: override {item!r} is not of the form key=value")
        conf = _merge(conf, OmegaConf.from_dotlist([item]), "command line")
    try:
        return OmegaConf.to_object(conf)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"key {key!r}: {str(e).splitlines()[0]}") from None


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
