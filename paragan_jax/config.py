"""Typed configuration of a paragan_jax run: frozen dataclasses loaded from YAML presets.

A run is described by one `TrainConfig` with a section per concern (model, data, optimizers,
scheme, sharding, checkpoints, evaluation, input pipeline). Presets live in
``paragan_jax/presets/*.yaml`` and are loaded with `load_train_config`, which goes through
`tapas_jax.config.load_config`: unknown keys and wrong types are errors naming the key and the
file (or "command line") they came from.
Cross-field checks that OmegaConf cannot express (a resolution that is not a power of two, a batch
that does not divide the data axis, ...) are done by `validate_config`, before any training step.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any

from tapas_jax.config import ConfigError, load_config, preset_path

from .pipeline_control import PipelineConfig

__all__ = [
    "AsyncConfig",
    "CheckpointConfig",
    "DataConfig",
    "EvalConfig",
    "ModelConfig",
    "OptimConfig",
    "ShardingConfig",
    "TrainConfig",
    "load_train_config",
    "validate_config",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Generator and discriminator architecture."""

    arch: str = "dcgan"
    """One of ``dcgan`` (small conv net for CPU), ``biggan`` (residual, SN, CBN, attention) or
    ``mlp`` (for 2-D Gaussian mixtures)."""
    resolution: int = 16
    """Output image side (a power of two, 8 to 1024); ignored by ``mlp``."""
    channels: int = 1
    """Image channels (1 for digits, 3 for RGB data sets)."""
    z_dim: int = 32
    """Latent dimension."""
    num_classes: int = 10
    """Classes for conditioning (conditional BN in G, projection in D); 0 = unconditional."""
    g_width: int = 32
    """Base channel width of G (``ch`` in BigGAN); hidden units for ``mlp``."""
    d_width: int = 32
    """Base channel width of D; hidden units for ``mlp``."""
    g_channel_mult: list[int] = dataclasses.field(default_factory=list)
    """BigGAN G channel multipliers, from 4x4 up (one per up block + 1); empty = derived."""
    d_channel_mult: list[int] = dataclasses.field(default_factory=list)
    """BigGAN D channel multipliers, from full resolution down; empty = derived."""
    attn_resolution: int = 0
    """Resolution at which a self-attention block is inserted in G and D (0 = none)."""
    shared_dim: int = 32
    """Size of the shared class embedding feeding conditional BN (BigGAN)."""
    mlp_layers: int = 3
    """Hidden layers of the ``mlp`` generator and discriminator."""
    spectral_norm: bool = True
    """Spectral normalisation of D weights (and of G weights for ``biggan``)."""
    sn_eps: float = 1e-6
    """Epsilon of the spectral-norm power iteration."""
    bn_momentum: float = 0.9
    """Running-average momentum of batch norm in G."""
    dtype: str = "float32"
    """Compute dtype (``float32`` or ``bfloat16``); params are kept in float32."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where the real samples come from and how they are batched."""

    source: str = "digits"
    """``digits`` (scikit-learn, embedded), ``ring8``, ``grid25``, ``folder``, ``npy`` or
    ``shards`` (``python -m paragan_jax prepare`` output, read lazily)."""
    path: str = ""
    """Image folder (``folder``) or directory of ``.npy``/``.npz`` shards (``npy``)."""
    batch_size: int = 64
    """Global batch of real samples per discriminator step; must divide the data axis."""
    mixture_std: float = 0.02
    """Standard deviation of each Gaussian of ``ring8``/``grid25``."""
    mixture_size: int = 20000
    """Samples drawn once from the mixture to form the training set."""
    prefetch: int = 2
    """Batches prepared ahead by the loader thread."""
    seed: int = 0
    """Seed of the shuffling order (the order is a pure function of seed and position)."""


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer of one side (G or D): Adam with its own learning rate and betas."""

    lr: float = 2e-4
    """Learning rate."""
    b1: float = 0.0
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """The ParaGAN asynchronous scheme (see `paragan_jax.async_scheme`)."""

    staleness: int = 1
    """k: G scores its loss against a D snapshot refreshed at least every k G steps (0 = sync)."""
    buffer_size: int = 1
    """Capacity of the bounded fake-batch buffer between G and D (in G steps)."""
    g_devices: int = 0
    """Devices given to G out of the mesh's data axis (0 = half)."""
    g_optim: OptimConfig | None = None
    """Optional asymmetric G optimizer used only under the async scheme (None = ``optim_g``)."""
    d_optim: OptimConfig | None = None
    """Optional asymmetric D optimizer used only under the async scheme (None = ``optim_d``)."""


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How the mesh is shaped and where params live."""

    mesh: str = "data=-1"
    """Mesh spec for `tapas_jax.mesh.make_mesh` (e.g. ``data=8`` or ``data=4,model=2``)."""
    params: str = "replicated"
    """``replicated``, ``fsdp`` (largest divisible dim over ``data``) or ``plan`` (tapas_jax)."""
    num_devices: int = 0
    """Use only the first N devices (0 = all)."""


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Orbax checkpointing."""

    every: int = 200
    """Save every N steps (and always at the end of a run)."""
    keep: int = 3
    """Keep the last K checkpoints."""
    enabled: bool = True
    """Turn checkpointing off (benchmarks)."""


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Offline metrics and logging."""

    num_samples: int = 1000
    """Generated samples scored by `paragan_jax.metrics`."""
    every: int = 0
    """Evaluate during training every N steps (0 = only via ``eval``)."""
    log_every: int = 50
    """Scalars to TensorBoard every N steps."""
    sample_every: int = 0
    """Sample grid to TensorBoard and PNG every N steps (0 = only at the end)."""
    grid_rows: int = 8
    """Rows (and columns) of the sample grid."""
    reference_size: int = 10000
    """Real examples the metrics compare against (and their feature classifier trains on) with
    ``data.source=shards``: a fixed sample of the whole data set, read by process 0 only. The
    in-memory sources use all their examples."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A complete paragan_jax run."""

    name: str = "run"
    """Run name (used in logs)."""
    seed: int = 0
    """Seed of parameter init and of the training RNG stream."""
    steps: int = 1000
    """Generator steps to train."""
    scheme: str = "sync"
    """``sync`` (alternating D and G on one mesh) or ``async`` (ParaGAN, disjoint sub-meshes)."""
    loss: str = "hinge"
    """``hinge`` or ``ns`` (non-saturating)."""
    n_disc: int = 1
    """Discriminator steps per generator step."""
    r1_gamma: float = 0.0
    """Weight of the R1 penalty on real samples (0 = off)."""
    ema_decay: float = 0.999
    """Decay of the generator EMA (0 = no EMA)."""
    ema_start: int = 0
    """Step from which the EMA averages (before it, it copies G)."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Architecture."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Data source."""
    optim_g: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=1e-4))
    """Generator optimizer."""
    optim_d: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=4e-4))
    """Discriminator optimizer."""
    async_: AsyncConfig = dataclasses.field(default_factory=AsyncConfig)
    """Asynchronous scheme settings (key ``async_`` in YAML)."""
    sharding: ShardingConfig = dataclasses.field(default_factory=ShardingConfig)
    """Mesh and param placement."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoints."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Metrics, samples, logging."""
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    """Input pipeline (`paragan_jax.pipeline`) when training with ``--adaptive-pipeline``: workers,
    prefetch depth, memory cap and controller; batch size, seed, shuffle and remainder are the
    trainer's own."""


_ARCHS = ("dcgan", "biggan", "mlp")
_SOURCES = ("digits", "ring8", "grid25", "folder", "npy", "shards")


def validate_config(config: TrainConfig) -> None:
    """Checks what the dataclass types cannot; raises `ConfigError` naming the field.

    The mesh-dependent check (batch divisible by the data axis) lives in `paragan_jax.train`, where
    the mesh is known.
    """
    m, d = config.model, config.data
    if m.arch not in _ARCHS:
        raise ConfigError(f"model.arch={m.arch!r}: expected one of {_ARCHS}")
    if d.source not in _SOURCES:
        raise ConfigError(f"data.source={d.source!r}: expected one of {_SOURCES}")
    mixture = d.source in ("ring8", "grid25")
    if mixture != (m.arch == "mlp"):
        raise ConfigError(
            f"model.arch={m.arch!r} does not fit data.source={d.source!r}: 2-D mixtures need "
            "arch 'mlp', images need 'dcgan' or 'biggan'"
        )
    if m.arch != "mlp":
        r = m.resolution
        if r < 8 or r > 1024 or r & (r - 1):
            raise ConfigError(f"model.resolution={r}: must be a power of two from 8 to 1024")
        if m.attn_resolution and (
            m.attn_resolution > r or m.attn_resolution & (m.attn_resolution - 1)
        ):
            raise ConfigError(
                f"model.attn_resolution={m.attn_resolution}: must be 0 or a power of two <= {r}"
            )
        if m.arch == "biggan":
            n_up = int(math.log2(r)) - 2
            if m.g_channel_mult and len(m.g_channel_mult) != n_up + 1:
                raise ConfigError(
                    f"model.g_channel_mult has {len(m.g_channel_mult)} entries; resolution {r} "
                    f"needs {n_up + 1} (one per 4x4..{r}x{r} stage)"
                )
            if m.d_channel_mult and len(m.d_channel_mult) != n_up + 1:
                raise ConfigError(
                    f"model.d_channel_mult has {len(m.d_channel_mult)} entries; resolution {r} "
                    f"needs {n_up + 1}"
                )
    if m.dtype not in ("float32", "bfloat16"):
        raise ConfigError(f"model.dtype={m.dtype!r}: expected 'float32' or 'bfloat16'")
    if config.scheme not in ("sync", "async"):
        raise ConfigError(f"scheme={config.scheme!r}: expected 'sync' or 'async'")
    if config.loss not in ("hinge", "ns"):
        raise ConfigError(f"loss={config.loss!r}: expected 'hinge' or 'ns'")
    if config.sharding.params not in ("replicated", "fsdp", "plan"):
        raise ConfigError(
            f"sharding.params={config.sharding.params!r}: expected 'replicated', 'fsdp' or 'plan'"
        )
    positive = {
        "steps": config.steps,
        "n_disc": config.n_disc,
        "data.batch_size": d.batch_size,
        "model.z_dim": m.z_dim,
        "checkpoint.every": config.checkpoint.every,
        "checkpoint.keep": config.checkpoint.keep,
        "async_.buffer_size": config.async_.buffer_size,
        "eval.num_samples": config.eval.num_samples,
        "eval.reference_size": config.eval.reference_size,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}={value}: must be >= 1")
    if config.async_.staleness < 0:
        raise ConfigError(f"async_.staleness={config.async_.staleness}: must be >= 0")
    if not 0.0 <= config.ema_decay < 1.0:
        raise ConfigError(f"ema_decay={config.ema_decay}: must be in [0, 1)")
    if d.source in ("folder", "npy", "shards") and not d.path:
        raise ConfigError(f"data.source={d.source!r} needs data.path")


def load_train_config(
    preset: str | os.PathLike | None = None,
    overrides: Iterable[str] | Mapping[str, Any] = (),
) -> TrainConfig:
    """Loads a `TrainConfig` from a preset name (``digits_cpu``) or YAML path, plus overrides.

    Args:
      preset: a name under ``paragan_jax/presets/`` or a path to a YAML file; None = defaults.
      overrides: dotted ``key=value`` strings (``model.z_dim=64``) or a mapping.

    Returns:
      A validated `TrainConfig`.

    Raises:
      ConfigError: unknown key, wrong type or an inconsistent combination, naming the key.
    """
    path = preset_path("paragan", preset) if preset is not None else None
    config = load_config(TrainConfig, path, overrides)
    validate_config(config)
    return config
