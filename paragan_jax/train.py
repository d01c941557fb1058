"""Sharded GAN training: the train state, the synchronous step and the `Trainer` loop.

Stable entry points (other modules and the scale helper's code import these):

- ``make_train_state(config: TrainConfig, mesh: Mesh) -> (TrainState, GANParts)``: builds G, D,
  the G EMA and both optimizer states directly sharded on `mesh` (shapes from `jax.eval_shape`,
  values from a jitted init with ``out_shardings``, so nothing is materialised unsharded).
- ``make_sync_step(config: TrainConfig, parts: GANParts) -> step``: a jitted, state-donating
  ``step(state, batch) -> (state, metrics)`` doing ``n_disc`` D updates then one G update.
  ``batch`` is ``{"image": (n_disc, B, ...) float32, "label": (n_disc, B) int32}`` placed with
  ``parts.batch_sharding`` (batch over the ``data`` axis); `batch_struct` gives its abstract shape.
- ``compile_step(step, state, batch_struct) -> compiled`` lowers and compiles once, logging
  ``memory_analysis()``; the loop then calls the compiled executable only.
- ``Trainer(config, workdir, batch_iterator_factory=None)``: the loop with checkpoints, logs and
  samples; ``scheme=async`` delegates to `paragan_jax.async_scheme`.

Param placement (``sharding.params``): ``replicated``; ``fsdp`` (each array's largest dimension
that divides the ``data`` axis is sharded over it; gradients then reduce-scatter and params
all-gather inside the step, chosen by GSPMD); ``plan`` (placement by a `tapas_jax` plan when a
mesh has a ``model`` axis; see `param_shardings`).

RNG: the state holds one raw key; step ``t`` uses ``fold_in(key, t)``, sub-keys ``fold_in(., i)``
for the i-th D step's fakes and ``fold_in(., n_disc)`` for the G step. With the deterministic
loader (`paragan_jax.data`) a resumed run therefore repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tapas_jax.config import ConfigError
from tapas_jax.mesh import axis_size

from .config import OptimConfig, TrainConfig
from .losses import d_loss, g_loss, r1_penalty
from .models import build_models

__all__ = [
    "GANFunctions",
    "GANParts",
    "TrainState",
    "batch_struct",
    "check_batch_divides",
    "compile_step",
    "make_optimizer",
    "make_sync_step",
    "make_train_state",
    "param_shardings",
]

log = logging.getLogger("paragan_jax")


class TrainState(flax.struct.PyTreeNode):
    """Everything a step reads and writes; a pytree of arrays (checkpointed whole)."""

    step: jax.Array  # int32 scalar: G steps done
    rng: jax.Array  # uint32[2] raw key
    g_params: Any
    g_stats: Any  # BN running stats and spectral-norm vectors of G
    d_params: Any
    d_stats: Any
    ema_params: Any
    g_opt: Any
    d_opt: Any


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Adam with the side's learning rate and betas."""
    return optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


@dataclasses.dataclass(frozen=True)
class GANFunctions:
    """Pure pieces of a GAN step, shared by the sync step and both async sides.

    Each is traceable under `jax.jit`; `mesh_batch` is the sharding the in-step latents get (batch
    over ``data``), or None.
    """

    config: TrainConfig
    g_def: Any
    d_def: Any
    tx_g: optax.GradientTransformation
    tx_d: optax.GradientTransformation
    batch_sharding_1: NamedSharding | None = None

    def latents(self, key: jax.Array, batch: int) -> tuple[jax.Array, jax.Array]:
        """``(z, labels)`` for one batch of fakes."""
        m = self.config.model
        kz, ky = jax.random.split(key)
        z = jax.random.normal(kz, (batch, m.z_dim), jnp.float32)
        y = (
            jax.random.randint(ky, (batch,), 0, m.num_classes, jnp.int32)
            if m.num_classes
            else jnp.zeros((batch,), jnp.int32)
        )
        if self.batch_sharding_1 is not None:
            z = jax.lax.with_sharding_constraint(z, self.batch_sharding_1)
            y = jax.lax.with_sharding_constraint(y, self.batch_sharding_1)
        return z, y

    def fakes_for_d(self, g_params, g_stats, key: jax.Array, batch: int):
        """Fakes D trains on: G in training mode, its state changes discarded, no gradient."""
        z, y = self.latents(key, batch)
        g = nnx.merge(self.g_def, g_params, g_stats, copy=True)
        return jax.lax.stop_gradient(g(z, y, train=True)), y

    def d_update(self, d_params, d_stats, d_opt, real, real_y, fake, fake_y):
        """One D step on a real and a fake batch; returns new ``(params, stats, opt), metrics``."""
        cfg = self.config
        b = real.shape[0]

        def loss_fn(params, stats):
            d = nnx.merge(self.d_def, params, stats, copy=True)
            logits = d(jnp.concatenate([real, fake]), jnp.concatenate([real_y, fake_y]), True)
            loss = d_loss(cfg.loss, logits[:b], logits[b:])
            metrics = {"d_real": jnp.mean(logits[:b]), "d_fake": jnp.mean(logits[b:])}
            if cfg.r1_gamma > 0:
                r1 = r1_penalty(lambda x: d(x, real_y, False), real)
                loss = loss + 0.5 * cfg.r1_gamma * r1
                metrics["r1"] = r1
            _, _, new_stats = nnx.split(d, nnx.Param, ...)
            metrics["d_loss"] = loss
            return loss, (new_stats, metrics)

        grads, (new_stats, metrics) = jax.grad(loss_fn, has_aux=True)(d_params, d_stats)
        updates, d_opt = self.tx_d.update(grads, d_opt, d_params)
        return (optax.apply_updates(d_params, updates), new_stats, d_opt), metrics

    def g_update(self, g_params, g_stats, g_opt, d_params, d_stats, key, batch: int):
        """One G step scored by the given D (current or a snapshot); D's state is not changed."""
        cfg = self.config
        z, y = self.latents(key, batch)

        def loss_fn(params, stats, d_params, d_stats):
            g = nnx.merge(self.g_def, params, stats, copy=True)
            fake = g(z, y, train=True)
            d = nnx.merge(self.d_def, d_params, d_stats, copy=True)
            loss = g_loss(cfg.loss, d(fake, y, False))
            _, _, new_stats = nnx.split(g, nnx.Param, ...)
            return loss, new_stats

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            g_params, g_stats, d_params, d_stats
        )
        updates, g_opt = self.tx_g.update(grads, g_opt, g_params)
        return (optax.apply_updates(g_params, updates), new_stats, g_opt), {"g_loss": loss}

    def ema_update(self, ema, g_params, step):
        """EMA of G params; a plain copy before ``ema_start`` or when ``ema_decay`` is 0."""
        decay = jnp.where(step >= self.config.ema_start, self.config.ema_decay, 0.0)
        return jax.tree.map(lambda e, p: decay * e + (1.0 - decay) * p, ema, g_params)

    def generate(self, params, stats, z, y):
        """Samples in evaluation mode (BN running averages)."""
        g = nnx.merge(self.g_def, params, stats, copy=True)
        return g(z, y, train=False)


@dataclasses.dataclass(frozen=True)
class GANParts:
    """Static pieces of a run: functions, mesh and shardings."""

    fns: GANFunctions
    mesh: Mesh
    state_shardings: Any  # TrainState of NamedSharding
    batch_sharding: NamedSharding  # (n_disc, B, ...) batch over data
    abstract_state: Any


def check_batch_divides(config: TrainConfig, mesh: Mesh, axis: str = "data") -> None:
    """Raises `ConfigError` if the batch does not split evenly over the data axis."""
    n = axis_size(mesh, axis)
    if config.data.batch_size % n:
        raise ConfigError(
            f"data.batch_size={config.data.batch_size} does not divide the '{axis}' axis of size "
            f"{n} (mesh {dict(mesh.shape)}); use a multiple of {n}"
        )


def _fsdp_spec(shape: tuple[int, ...], n: int, min_size: int = 1024) -> P:
    if n == 1 or math.prod(shape) < min_size:
        return P()
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    for i in dims:
        if shape[i] % n == 0:
            spec = [None] * len(shape)
            spec[i] = "data"
            return P(*spec)
    return P()


def param_shardings(abstract: Any, mesh: Mesh, mode: str) -> Any:
    """NamedShardings for a pytree of ShapeDtypeStructs under a placement mode.

    Args:
      abstract: pytree of `jax.ShapeDtypeStruct` (params or optimizer state).
      mesh: the mesh.
      mode: ``replicated``; ``fsdp`` (largest dimension divisible by the ``data`` axis, arrays of
        fewer than 1,024 elements replicated); ``plan`` (needs `tapas_jax.plan`).

    Returns:
      A pytree of `NamedSharding` with the structure of `abstract`.
    """
    if mode == "replicated":
        return jax.tree.map(lambda _: NamedSharding(mesh, P()), abstract)
    if mode == "fsdp":
        n = axis_size(mesh, "data")
        return jax.tree.map(lambda a: NamedSharding(mesh, _fsdp_spec(a.shape, n)), abstract)
    if mode == "plan":
        raise ConfigError(
            "sharding.params='plan' is resolved by plan_shardings (it needs the models), not "
            "per pytree"
        )
    raise ConfigError(f"sharding.params={mode!r}: expected 'replicated', 'fsdp' or 'plan'")


def _like_params(opt_abstract: Any, params_abstract: Any, param_sh: Any, mesh: Mesh) -> Any:
    """Optimizer-state shardings: subtrees shaped like the params get the params' shardings."""
    p_struct = jax.tree.structure(params_abstract)
    rep = NamedSharding(mesh, P())

    def is_params(node):
        try:
            return jax.tree.structure(node) == p_struct
        except Exception:
            return False

    return jax.tree.map(
        lambda n: param_sh if is_params(n) else rep, opt_abstract, is_leaf=is_params
    )


def plan_shardings(
    config: TrainConfig, mesh: Mesh, abstract: TrainState, g_def: Any, d_def: Any
) -> dict[str, Any]:
    """Param shardings of G and D from `tapas_jax.plan` (tensor parallel over ``model``).

    Each network's training-mode forward on one abstract batch is planned (batch over ``data``);
    the EMA follows G's plan and Adam's moments follow their params. BN statistics and
    spectral-norm vectors stay replicated.
    """
    from tapas_jax.planner import plan as tapas_plan

    m, b = config.model, config.data.batch_size
    z = jax.ShapeDtypeStruct((b, m.z_dim), jnp.float32)
    y = jax.ShapeDtypeStruct((b,), jnp.int32)
    g_stats, d_stats = abstract.g_stats, abstract.d_stats

    def g_forward(tree, z, y):  # stats ride along as inputs: planned, then kept replicated
        return nnx.merge(g_def, tree[0], tree[1], copy=True)(z, y, train=True)

    x_shape = (b, 2) if m.arch == "mlp" else (b, m.resolution, m.resolution, m.channels)
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)

    def d_forward(tree, x, y):
        return nnx.merge(d_def, tree[0], tree[1], copy=True)(x, y, False)

    out = {}
    for name, fn, params, inputs in (
        ("g_params", g_forward, (abstract.g_params, g_stats), (z, y)),
        ("d_params", d_forward, (abstract.d_params, d_stats), (x, y)),
    ):
        p = tapas_plan(fn, params, *inputs, mesh=mesh, optimizer_state_factor=2.0)
        specs = p.param_specs[0]
        out[name] = jax.tree.map(
            lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P)
        )
        log.info("tapas_jax plan for %s: %s", name, p.predicted)
    out["ema_params"] = out["g_params"]
    out["g_opt"] = _like_params(abstract.g_opt, abstract.g_params, out["g_params"], mesh)
    out["d_opt"] = _like_params(abstract.d_opt, abstract.d_params, out["d_params"], mesh)
    return out


def _init_fn(config: TrainConfig, tx_g, tx_d) -> Callable[[], TrainState]:
    def init() -> TrainState:
        key = jax.random.PRNGKey(config.seed)
        init_key, train_key = jax.random.split(key)
        g, d = build_models(config.model, nnx.Rngs(params=init_key))
        _, g_params, g_stats = nnx.split(g, nnx.Param, ...)
        _, d_params, d_stats = nnx.split(d, nnx.Param, ...)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            rng=train_key,
            g_params=g_params,
            g_stats=g_stats,
            d_params=d_params,
            d_stats=d_stats,
            ema_params=jax.tree.map(jnp.copy, g_params),
            g_opt=tx_g.init(g_params),
            d_opt=tx_d.init(d_params),
        )

    return init


def graphdefs(config: TrainConfig) -> tuple[Any, Any]:
    """Graph definitions of G and D (built abstractly, no weights allocated)."""
    g, d = nnx.eval_shape(lambda: build_models(config.model, nnx.Rngs(params=0)))
    return nnx.split(g, nnx.Param, ...)[0], nnx.split(d, nnx.Param, ...)[0]


def make_train_state(
    config: TrainConfig,
    mesh: Mesh,
    optim_g: OptimConfig | None = None,
    optim_d: OptimConfig | None = None,
) -> tuple[TrainState, GANParts]:
    """Builds the sharded train state on `mesh` and the static parts of the run.

    Args:
      config: the run config.
      mesh: a mesh from `tapas_jax.mesh` with a ``data`` axis (size 1 is fine).
      optim_g, optim_d: optimizer overrides (the async scheme's asymmetric settings).

    Returns:
      ``(state, parts)``; ``state`` lives on `mesh` with ``parts.state_shardings``.

    Raises:
      ConfigError: the batch does not divide the data axis, or an unknown placement mode.
    """
    check_batch_divides(config, mesh)
    tx_g = make_optimizer(optim_g or config.optim_g)
    tx_d = make_optimizer(optim_d or config.optim_d)
    g_def, d_def = graphdefs(config)
    init = _init_fn(config, tx_g, tx_d)
    abstract = jax.eval_shape(init)
    mode = config.sharding.params
    rep = NamedSharding(mesh, P())
    if mode == "plan":
        planned = plan_shardings(config, mesh, abstract, g_def, d_def)
    else:
        planned = {
            k: param_shardings(getattr(abstract, k), mesh, mode)
            for k in ("g_params", "d_params", "ema_params", "g_opt", "d_opt")
        }
    shardings = TrainState(
        step=rep,
        rng=rep,
        g_stats=param_shardings(abstract.g_stats, mesh, "replicated"),
        d_stats=param_shardings(abstract.d_stats, mesh, "replicated"),
        **planned,
    )
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    b1 = NamedSharding(mesh, P("data"))
    fns = GANFunctions(config, g_def, d_def, tx_g, tx_d, b1)
    parts = GANParts(fns, mesh, shardings, NamedSharding(mesh, P(None, "data")), abstract)
    return state, parts


def batch_struct(config: TrainConfig, parts: GANParts, image_shape: tuple[int, ...]) -> Batch:
    """Abstract ``(n_disc, B, ...)`` batch with its sharding, for lowering the step."""
    lead = (config.n_disc, config.data.batch_size)
    return {
        "image": jax.ShapeDtypeStruct(
            lead + tuple(image_shape), jnp.float32, sharding=parts.batch_sharding
        ),
        "label": jax.ShapeDtypeStruct(lead, jnp.int32, sharding=parts.batch_sharding),
    }


Batch = dict[str, Any]


def make_sync_step(config: TrainConfig, parts: GANParts):
    """The synchronous step: ``n_disc`` D updates (each on its own real batch and fresh fakes from
    the current G), then one G update against the just-updated D, then the EMA.

    Returns:
      ``jax.jit``-ed ``step(state, batch) -> (state, metrics)`` that donates ``state``.
    """
    fns = parts.fns
    b = config.data.batch_size

    def step(state: TrainState, batch: Batch):
        key = jax.random.fold_in(state.rng, state.step)
        d_params, d_stats, d_opt = state.d_params, state.d_stats, state.d_opt
        metrics: dict[str, jax.Array] = {}
        for i in range(config.n_disc):
            fake, fake_y = fns.fakes_for_d(
                state.g_params, state.g_stats, jax.random.fold_in(key, i), b
            )
            (d_params, d_stats, d_opt), metrics = fns.d_update(
                d_params, d_stats, d_opt, batch["image"][i], batch["label"][i], fake, fake_y
            )
        (g_params, g_stats, g_opt), gm = fns.g_update(
            state.g_params,
            state.g_stats,
            state.g_opt,
            d_params,
            d_stats,
            jax.random.fold_in(key, config.n_disc),
            b,
        )
        new = state.replace(
            step=state.step + 1,
            g_params=g_params,
            g_stats=g_stats,
            g_opt=g_opt,
            d_params=d_params,
            d_stats=d_stats,
            d_opt=d_opt,
            ema_params=fns.ema_update(state.ema_params, g_params, state.step),
        )
        return new, {**metrics, **gm}

    return jax.jit(
        step,
        in_shardings=(parts.state_shardings, parts.batch_sharding),
        out_shardings=(parts.state_shardings, NamedSharding(parts.mesh, P())),
        donate_argnums=(0,),
    )


def compile_step(step, *args, name: str = "train_step"):
    """Lowers and compiles `step` once for `args` (arrays or ShapeDtypeStructs); logs memory.

    Returns:
      The compiled executable (call it like the step).
    """
    compiled = step.lower(*args).compile()
    mem = compiled.memory_analysis()
    if mem is not None:
        log.info(
            "%s compiled: arguments %.2f MiB, outputs %.2f MiB, temporaries %.2f MiB, "
            "generated code %.2f MiB",
            name,
            mem.argument_size_in_bytes / 2**20,
            mem.output_size_in_bytes / 2**20,
            mem.temp_size_in_bytes / 2**20,
            mem.generated_code_size_in_bytes / 2**20,
        )
    return compiled


def stack_batches(batches: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Stacks ``n_disc`` loader batches into the step's ``(n_disc, B, ...)`` batch."""
    return {k: np.stack([b[k] for b in batches]) for k in batches[0]}


BatchIteratorFactory = Callable[..., Iterator[dict[str, np.ndarray]]]


def sample_images(
    fns: GANFunctions, params, stats, key: jax.Array, n: int, chunk: int = 500
) -> np.ndarray:
    """`n` samples from G (EMA params by default) in evaluation mode, as a NumPy array."""
    gen = jax.jit(lambda p, s, z, y: fns.generate(p, s, z, y))
    m = fns.config.model
    out = []
    for i in range(0, n, chunk):
        b = min(chunk, n - i)
        kz, ky = jax.random.split(jax.random.fold_in(key, i))
        z = jax.random.normal(kz, (b, m.z_dim))
        y = (
            jax.random.randint(ky, (b,), 0, m.num_classes)
            if m.num_classes
            else jnp.zeros((b,), jnp.int32)
        )
        if m.num_classes:  # class-balanced grid rows are easier to read
            y = jnp.arange(i, i + b, dtype=jnp.int32) % m.num_classes
        out.append(np.asarray(gen(params, stats, z, y)))
    return np.concatenate(out)


class SyncRunner:
    """The synchronous scheme behind the `Trainer` loop: one state, one compiled step."""

    scheme = "sync"

    def __init__(self, config: TrainConfig, mesh: Mesh, image_shape: tuple[int, ...]):
        self.config = config
        self.state, self.parts = make_train_state(config, mesh)
        self.fns = self.parts.fns
        self.image_shape = image_shape
        self._step = None  # compiled on first use (eval and sample never pay for it)

    @property
    def step(self) -> int:
        return int(self.state.step)

    def checkpoint_tree(self) -> dict[str, Any]:
        return {"train": self.state}

    def load_checkpoint_tree(self, tree: dict[str, Any]) -> None:
        self.state = tree["train"]

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        if self._step is None:
            self._step = compile_step(
                make_sync_step(self.config, self.parts),
                self.state,
                batch_struct(self.config, self.parts, self.image_shape),
            )
        batch = jax.device_put(stack_batches(batches), self.parts.batch_sharding)
        self.state, metrics = self._step(self.state, batch)
        return metrics

    def sampling_params(self) -> tuple[Any, Any]:
        return self.state.ema_params, self.state.g_stats

    def close(self) -> None:
        pass


class Trainer:
    """Trains a GAN from a `TrainConfig`: data, mesh, scheme, checkpoints, logs, samples.

    Example::

        from paragan_jax import Trainer, load_train_config
        cfg = load_train_config("digits_cpu", ["steps=200"])
        summary = Trainer(cfg, workdir="runs/digits").train()
        print(summary["sample_grid"])

    Everything that can be wrong with the input (config, data, mesh/batch mismatch) raises in the
    constructor, before any step runs. ``batch_iterator_factory(dataset, batch_size, seed, start)``
    replaces the default `paragan_jax.data.PrefetchLoader` (it must yield the same batches in
    the same order for exact resume; its ``position`` attribute, if any, is not required).
    """

    def __init__(
        self,
        config: TrainConfig,
        workdir: str | None = None,
        batch_iterator_factory: BatchIteratorFactory | None = None,
        devices: list[jax.Device] | None = None,
        progress: bool = True,
    ):
        from tapas_jax.mesh import make_mesh

        from .config import validate_config
        from .data import load_dataset

        validate_config(config)
        self.config = config
        self.workdir = workdir
        self.progress = progress
        self.dataset = load_dataset(config)
        if devices is None:
            devices = jax.devices()
            if config.sharding.num_devices:
                if config.sharding.num_devices > len(devices):
                    raise ConfigError(
                        f"sharding.num_devices={config.sharding.num_devices} but only "
                        f"{len(devices)} devices are visible"
                    )
                devices = devices[: config.sharding.num_devices]
        self.mesh = make_mesh(config.sharding.mesh, devices)
        if config.scheme == "async":
            from .async_scheme import check_async_mesh

            check_async_mesh(config, self.mesh)
        else:
            check_batch_divides(config, self.mesh)
        self.batch_iterator_factory = batch_iterator_factory
        self.runner = None

    def _make_runner(self):
        shape = self.dataset.images.shape[1:]
        if self.config.scheme == "async":
            from .async_scheme import AsyncRunner

            return AsyncRunner(self.config, self.mesh, shape)
        return SyncRunner(self.config, self.mesh, shape)

    def _iterator(self, start: int):
        from .data import PrefetchLoader

        c = self.config.data
        if self.batch_iterator_factory is not None:
            return self.batch_iterator_factory(self.dataset, c.batch_size, c.seed, start)
        return PrefetchLoader(self.dataset, c.batch_size, c.seed, start, c.prefetch)

    def _meta(self, position: int) -> dict[str, Any]:
        from tapas_jax.config import config_to_dict

        return {
            "step": self.runner.step,
            "data_position": position,
            "scheme": self.config.scheme,
            "config": config_to_dict(self.config),
        }

    def train(self, steps: int | None = None, time_budget_s: float | None = None) -> dict[str, Any]:
        """Trains up to `steps` G steps in total (default ``config.steps``), resuming if a
        checkpoint exists in the workdir.

        Args:
          steps: total G steps to reach.
          time_budget_s: stop early once this much wall-clock time has passed after the first
            (compiling) step; used to compare schemes at equal time.

        Returns:
          Summary: ``step``, ``resumed_from``, ``steps_run``, ``wall_s`` and ``steps_per_sec``
          (both excluding the first, compiling step), ``compile_s``, last ``metrics``,
          ``sample_grid`` (PNG path or None).
        """
        import time
        from pathlib import Path

        from tqdm import tqdm

        from .checkpoint import CheckpointStore

        cfg = self.config
        total = cfg.steps if steps is None else steps
        self.runner = runner = self._make_runner()
        store = writer = None
        position, resumed = 0, None
        if self.workdir:
            Path(self.workdir).mkdir(parents=True, exist_ok=True)
            if cfg.checkpoint.enabled:
                store = CheckpointStore(
                    Path(self.workdir) / "checkpoints",
                    keep=cfg.checkpoint.keep,
                    every=cfg.checkpoint.every,
                )
                restored = store.restore_latest(runner.checkpoint_tree())
                if restored is not None:
                    runner.load_checkpoint_tree(restored["state"])
                    position = int(restored["meta"]["data_position"])
                    resumed = restored["step"]
                    log.info("resumed from step %d (data position %d)", resumed, position)
            from tensorboardX import SummaryWriter

            writer = SummaryWriter(str(Path(self.workdir) / "tb"))
        loader = self._iterator(position)
        start = runner.step
        metrics: dict[str, Any] = {}
        t_start = t0 = time.perf_counter()
        compile_s = 0.0
        if self.workdir:
            from omegaconf import OmegaConf

            (Path(self.workdir) / "config.yaml").write_text(
                OmegaConf.to_yaml(OmegaConf.structured(cfg))
            )
        bar = tqdm(
            total=total,
            initial=start,
            disable=not self.progress,
            desc=cfg.name,
            unit="step",
            dynamic_ncols=True,
        )
        try:
            in_flight = None
            for step in range(start, total):
                batches = [next(loader) for _ in range(cfg.n_disc)]
                position += cfg.n_disc
                metrics = runner.run_step(batches)
                # At most one step in flight: the host prepares step i+1 while step i runs,
                # but never races further ahead, so a loader's wait for input measures input
                # stalls rather than queued device work (what the adaptive pipeline reads).
                if in_flight is not None:
                    jax.block_until_ready(in_flight)
                in_flight = metrics
                done = step + 1
                if writer is not None and (done % cfg.eval.log_every == 0 or done == total):
                    scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    for k, v in scalars.items():
                        writer.add_scalar(f"train/{k}", v, done)
                    bar.set_postfix({k: f"{v:.3f}" for k, v in scalars.items()}, refresh=False)
                if store is not None and store.should_save(done):
                    store.save(done, runner.checkpoint_tree(), self._meta(position))
                bar.update(1)
                if step == start:  # the first step compiles: keep it out of the timing
                    jax.block_until_ready(metrics)
                    t0 = time.perf_counter()
                    compile_s = t0 - t_start
                elif time_budget_s is not None and time.perf_counter() - t0 >= time_budget_s:
                    break
            jax.block_until_ready(metrics)
        finally:
            bar.close()
            if hasattr(loader, "close"):
                loader.close()
        wall = time.perf_counter() - t0
        if store is not None:
            if runner.step not in store.steps():
                store.save(runner.step, runner.checkpoint_tree(), self._meta(position), force=True)
            store.close()
        grid = None
        if self.workdir:
            grid = str(Path(self.workdir) / f"samples_step{runner.step}.png")
            self.sample_grid(grid)
            if writer is not None:
                writer.close()
        runner.close()
        done_steps = runner.step - start
        timed = max(done_steps - 1, 0)
        return {
            "step": runner.step,
            "resumed_from": resumed,
            "steps_run": done_steps,
            "wall_s": wall,
            "compile_s": compile_s,
            "steps_per_sec": timed / wall if wall > 0 and timed else float("nan"),
            "metrics": {k: float(v) for k, v in jax.device_get(metrics).items()},
            "sample_grid": grid,
        }

    def samples(self, n: int | None = None, seed: int = 1234) -> np.ndarray:
        """Samples from the trained (EMA) generator; call after `train` or `restore`."""
        if self.runner is None:
            raise RuntimeError("no trained state: call train() or restore() first")
        params, stats = self.runner.sampling_params()
        n = n or self.config.eval.num_samples
        return sample_images(self.runner.fns, params, stats, jax.random.PRNGKey(seed), n)

    def sample_grid(self, path: str, seed: int = 1234) -> str:
        """Writes a sample grid (images) or scatter plot (mixtures) PNG; returns its path."""
        from .metrics import save_sample_png

        rows = self.config.eval.grid_rows
        if self.dataset.is_mixture:
            pts = self.samples(2000, seed)
            save_sample_png(
                pts,
                path,
                real=self.dataset.images[:2000],
                title=f"{self.config.name} step {self.runner.step}",
            )
        else:
            save_sample_png(self.samples(rows * rows, seed), path, rows=rows)
        return path

    def restore(self) -> int:
        """Loads the latest checkpoint of the workdir (for eval/sample); returns its step."""
        from pathlib import Path

        from .checkpoint import CheckpointStore

        if not self.workdir or not (Path(self.workdir) / "checkpoints").is_dir():
            raise FileNotFoundError(f"no checkpoints under {self.workdir!r}")
        self.runner = self._make_runner()
        store = CheckpointStore(Path(self.workdir) / "checkpoints")
        restored = store.restore_latest(self.runner.checkpoint_tree())
        store.close()
        if restored is None:
            raise FileNotFoundError(f"no readable checkpoint under {self.workdir!r}/checkpoints")
        self.runner.load_checkpoint_tree(restored["state"])
        return restored["step"]

    def evaluate(self, n: int | None = None) -> dict[str, Any]:
        """Offline metrics of the current generator (see `paragan_jax.metrics`)."""
        from .metrics import evaluate_samples

        out = evaluate_samples(self.samples(n), self.dataset)
        return {"step": self.runner.step, **out}
