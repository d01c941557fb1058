"""The compiled steps of a GAN run: the pure G/D pieces, the synchronous step, sampling.

- `GANFunctions`: the traceable pieces every scheme is made of (latents, fakes for D, one D
  update, one G update, the EMA, generation); the sync step below and both async sides
  (`paragan_jax.async_scheme`) are built from them.
- ``make_sync_step(config, layout) -> step``: a jitted, state-donating
  ``step(state, batch) -> (state, metrics)`` doing ``n_disc`` D updates then one G update.
  ``batch`` is ``{"image": (n_disc, B, ...) float32, "label": (n_disc, B) int32}`` placed with
  ``layout.batch_sharding`` (batch over the ``data`` axis); `paragan_jax.state.batch_struct`
  gives its abstract shape.
- ``compile_step(step, *args) -> compiled`` lowers and compiles once, logging
  ``memory_analysis()``; loops then call the compiled executable only.
- `SyncRunner`: the sync scheme as a runner of `paragan_jax.loop.run_steps` (one state, one
  compiled step).
- `sample_images`: samples of a generator in evaluation mode.

RNG: the state holds one raw key; step ``t`` uses ``fold_in(key, t)``, sub-keys ``fold_in(., i)``
for the i-th D step's fakes and ``fold_in(., n_disc)`` for the G step. With the deterministic
loader (`paragan_jax.data`) a resumed run therefore repeats an uninterrupted one bit for bit.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import TrainConfig
from .data import device_batch
from .losses import d_loss, g_loss, r1_penalty
from .state import StateLayout, TrainState, batch_struct, make_train_state

__all__ = [
    "GANFunctions",
    "SyncRunner",
    "compile_step",
    "make_sync_step",
    "sample_images",
    "stack_batches",
]

log = logging.getLogger("paragan_jax")


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

    @classmethod
    def from_layout(cls, config: TrainConfig, layout: StateLayout) -> GANFunctions:
        """The functions of a state built by `paragan_jax.state.make_train_state`."""
        return cls(
            config,
            layout.g_def,
            layout.d_def,
            layout.tx_g,
            layout.tx_d,
            NamedSharding(layout.mesh, P("data")),
        )

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


def make_sync_step(config: TrainConfig, layout: StateLayout):
    """The synchronous step: ``n_disc`` D updates (each on its own real batch and fresh fakes from
    the current G), then one G update against the just-updated D, then the EMA.

    Returns:
      ``jax.jit``-ed ``step(state, batch) -> (state, metrics)`` that donates ``state``.
    """
    fns = GANFunctions.from_layout(config, layout)
    b = config.data.batch_size

    def step(state: TrainState, batch: dict[str, jax.Array]):
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
        in_shardings=(layout.shardings, layout.batch_sharding),
        out_shardings=(layout.shardings, NamedSharding(layout.mesh, P())),
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
    """The synchronous scheme as a runner of `paragan_jax.loop.run_steps`: one state on one mesh,
    one compiled step.

    Args:
      config: the run config.
      mesh: the mesh the state lives on (its ``data`` axis splits the batch).
      image_shape: one example's shape (the step is compiled for it).
      local_batches: the loader batches are this process's share of the global batch (each
        process of a multi-process data-parallel run feeds its own examples); by default every
        process holds the same global batch.
    """

    scheme = "sync"

    def __init__(
        self,
        config: TrainConfig,
        mesh: Mesh,
        image_shape: tuple[int, ...],
        local_batches: bool = False,
    ):
        self.config = config
        self.state, self.layout = make_train_state(config, mesh)
        self.fns = GANFunctions.from_layout(config, self.layout)
        self.image_shape = tuple(image_shape)
        self.local_batches = local_batches
        self._compiled = None  # compiled on first use (eval and sample never pay for it)

    @property
    def step(self) -> int:
        """G steps done (reads the device counter)."""
        return int(self.state.step)

    def compile(self):
        """The compiled step (compiled once, on the first call)."""
        if self._compiled is None:
            self._compiled = compile_step(
                make_sync_step(self.config, self.layout),
                self.state,
                batch_struct(self.config, self.layout, self.image_shape),
            )
        return self._compiled

    def put_batch(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        """The step's ``(n_disc, B, ...)`` device batch from ``n_disc`` loader batches."""
        return device_batch(
            stack_batches(batches), self.layout.batch_sharding, local=self.local_batches
        )

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        """Dispatches one step on ``n_disc`` loader batches; returns its (device) metrics."""
        step = self.compile()
        self.state, metrics = step(self.state, self.put_batch(batches))
        return metrics

    def end_step(self, stop: bool) -> bool:
        """One process decides alone: the loop's decision stands."""
        return stop

    optional_checkpoint_keys: tuple[str, ...] = ()  # every checkpoint has the whole state

    def checkpoint_tree(self) -> dict[str, Any]:
        return {"train": self.state}

    def load_checkpoint_tree(self, tree: dict[str, Any]) -> None:
        self.state = tree["train"]

    def sampling_params(self) -> tuple[Any, Any]:
        """The EMA generator's params and G's statistics."""
        return self.state.ema_params, self.state.g_stats

    def close(self) -> None:
        pass
