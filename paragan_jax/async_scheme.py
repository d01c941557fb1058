"""The ParaGAN asynchronous update scheme, on one process (disjoint sub-meshes).

Our reading of ParaGAN's asynchronous scheme (Wang et al., "ParaGAN: A Scalable Distributed
Training Framework for Generative Adversarial Networks"), as implemented here:

1. The devices are split into two disjoint groups along the ``data`` axis
   (`tapas_jax.mesh.split_mesh`): the generator group holds G, its optimizer state, the G EMA
   and a *snapshot* of D; the discriminator group holds D and its optimizer state. Each group
   is data parallel over its own devices.
2. The two groups step concurrently. In iteration ``t`` the D group trains on a real batch and a
   fake batch it takes from a bounded FIFO *buffer*; at the same time the G group updates G
   against its D snapshot and then writes the fakes of its new G into the buffer (fakes for D
   are produced in G's training mode, without gradient, exactly as the sync step produces them).
   On a single controller the concurrency comes from JAX's asynchronous dispatch: both programs
   are enqueued on their own devices before either result is waited for, so on TPUs/GPUs they
   overlap. Simulated CPU devices execute one program at a time, so the in-process scheme shows
   no speed-up on CPU; `paragan_jax.distributed` runs the same schedule with one process per
   group, where the overlap is real.
3. Staleness bound ``k`` (``async_.staleness``): the D snapshot is refreshed from the D group
   every ``k`` iterations (before that iteration's D update is dispatched), so G always scores
   its loss against a D at most ``k`` D updates older than the one the sync scheme would use.
   ``k = 0`` refreshes the snapshot *after* the D update of the same iteration and makes the
   buffer depth zero: the schedule is then exactly the synchronous one (D step on fakes of the
   current G, then G step against the updated D; same RNG stream), which a test checks.
4. Buffer depth ``buffer_size``: D reads fakes made ``buffer_size - 1`` G steps before the
   freshest ones; 1 (the default) means D always sees fakes of the current G. Larger depths let
   G run ahead of D across processes at the cost of staler fakes. The buffer never holds more
   than ``buffer_size`` fake batches.
5. Asymmetric optimizers: ``async_.g_optim`` / ``async_.d_optim`` override the G/D optimizer
   settings under this scheme only (ParaGAN tunes the two sides separately).

RNG stream: the G step of iteration ``t`` uses ``fold_in(fold_in(key, t), n_disc)``, the fakes
consumed by D in iteration ``t`` use ``fold_in(fold_in(key, t), i)`` for the i-th D step, as in
`paragan_jax.steps.make_sync_step`. Checkpoints hold both groups' state (the snapshot is part of
G's) and the buffer: it always holds ``lag + 1`` entries between iterations (it starts as that many
copies of the fakes of G_0, which is what the first ``lag`` D steps read), so a resumed run
continues bit for bit. A checkpoint written before the buffer was saved restores with a warning
and the buffer refilled from the restored G (exact only for depth 1).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tapas_jax.config import ConfigError
from tapas_jax.mesh import axis_size, split_mesh

from .config import TrainConfig
from .data import device_batch
from .state import graphdefs, init_train_state, make_optimizer, state_shardings
from .steps import GANFunctions, compile_step, stack_batches

__all__ = [
    "AsyncRunner",
    "DSide",
    "GSide",
    "build_d_side",
    "build_g_side",
    "build_sides",
    "check_async_mesh",
    "split_devices",
]


def split_devices(config: TrainConfig, mesh: Mesh) -> tuple[int, int]:
    """``(g_size, d_size)`` along the ``data`` axis for the generator and discriminator groups."""
    n = axis_size(mesh, "data")
    if n < 2:
        raise ConfigError(
            f"scheme=async needs at least 2 devices on the 'data' axis (mesh {dict(mesh.shape)});"
            " set sharding.num_devices >= 2 or use scheme=sync"
        )
    g = config.async_.g_devices or n // 2
    if not 0 < g < n:
        raise ConfigError(f"async_.g_devices={g}: must be between 1 and {n - 1}")
    return g, n - g


def check_async_mesh(config: TrainConfig, mesh: Mesh) -> None:
    """Checks the async split and that the batch divides each group's data axis."""
    g, d = split_devices(config, mesh)
    b = config.data.batch_size
    for name, n in (("generator", g), ("discriminator", d)):
        if b % n:
            raise ConfigError(
                f"data.batch_size={b} does not divide the {name} group's 'data' axis of size {n}"
                f" (async split {g}+{d} of mesh {dict(mesh.shape)})"
            )


@dataclasses.dataclass
class GSide:
    """Jitted programs of the generator group."""

    fns: GANFunctions
    mesh: Mesh
    shardings: dict[str, Any]
    step: Any  # (g_state) -> (g_state, fakes, fake_labels, metrics)
    produce: Any  # (g_state) -> (fakes, fake_labels) for the current step


@dataclasses.dataclass
class DSide:
    """Jitted programs of the discriminator group."""

    fns: GANFunctions
    mesh: Mesh
    shardings: dict[str, Any]
    batch_sharding: NamedSharding
    step: Any  # (d_state, batch, fakes, fake_labels) -> (d_state, metrics)


_G_KEYS = (
    "step",
    "rng",
    "g_params",
    "g_stats",
    "g_opt",
    "ema_params",
    "d_snap_params",
    "d_snap_stats",
)
_D_KEYS = ("d_params", "d_stats", "d_opt")


def _select(full, keys):
    src = {
        "step": full.step,
        "rng": full.rng,
        "g_params": full.g_params,
        "g_stats": full.g_stats,
        "g_opt": full.g_opt,
        "ema_params": full.ema_params,
        "d_params": full.d_params,
        "d_stats": full.d_stats,
        "d_opt": full.d_opt,
        "d_snap_params": full.d_params,
        "d_snap_stats": full.d_stats,
    }
    return {k: src[k] for k in keys}


def _side_setup(config: TrainConfig):
    a = config.async_
    tx_g = make_optimizer(a.g_optim or config.optim_g)
    tx_d = make_optimizer(a.d_optim or config.optim_d)
    g_def, d_def = graphdefs(config)
    init = init_train_state(config, tx_g, tx_d)
    return tx_g, tx_d, g_def, d_def, init, jax.eval_shape(init)


def _side_shardings(config, abstract, keys, mesh: Mesh, g_def, d_def) -> dict[str, Any]:
    """The shardings of one side's part of the state: the sync state's placement on its mesh."""
    return _select(state_shardings(config, mesh, abstract, g_def, d_def), keys)


def build_g_side(config: TrainConfig, g_mesh: Mesh) -> tuple[dict[str, Any], GSide]:
    """The generator group's initial state (with the initial D as snapshot) and programs."""
    tx_g, tx_d, g_def, d_def, init, abstract = _side_setup(config)
    g_sh = _side_shardings(config, abstract, _G_KEYS, g_mesh, g_def, d_def)
    with jax.set_mesh(g_mesh):
        g_state = jax.jit(lambda: _select(init(), _G_KEYS), out_shardings=g_sh)()
    b, n_disc = config.data.batch_size, config.n_disc
    fns = GANFunctions(config, g_def, d_def, tx_g, tx_d, NamedSharding(g_mesh, P("data")))
    g_batch = NamedSharding(g_mesh, P(None, "data"))

    def fakes_at(s, step):
        key = jax.random.fold_in(s["rng"], step)
        outs = [
            fns.fakes_for_d(s["g_params"], s["g_stats"], jax.random.fold_in(key, i), b)
            for i in range(n_disc)
        ]
        return jnp.stack([o[0] for o in outs]), jnp.stack([o[1] for o in outs])

    def g_step(s):
        t = s["step"]
        key = jax.random.fold_in(s["rng"], t)
        (gp, gs, go), metrics = fns.g_update(
            s["g_params"],
            s["g_stats"],
            s["g_opt"],
            s["d_snap_params"],
            s["d_snap_stats"],
            jax.random.fold_in(key, n_disc),
            b,
        )
        new = dict(
            s,
            step=t + 1,
            g_params=gp,
            g_stats=gs,
            g_opt=go,
            ema_params=fns.ema_update(s["ema_params"], gp, t),
        )
        fakes, labels = fakes_at(new, t + 1)
        return new, fakes, labels, metrics

    side = GSide(
        fns,
        g_mesh,
        g_sh,
        jax.jit(
            g_step,
            in_shardings=(g_sh,),
            out_shardings=(g_sh, g_batch, g_batch, NamedSharding(g_mesh, P())),
            donate_argnums=(0,),
        ),
        jax.jit(
            lambda s: fakes_at(s, s["step"]), in_shardings=(g_sh,), out_shardings=(g_batch, g_batch)
        ),
    )
    return g_state, side


def build_d_side(config: TrainConfig, d_mesh: Mesh) -> tuple[dict[str, Any], DSide]:
    """The discriminator group's initial state and program."""
    tx_g, tx_d, g_def, d_def, init, abstract = _side_setup(config)
    d_sh = _side_shardings(config, abstract, _D_KEYS, d_mesh, g_def, d_def)
    with jax.set_mesh(d_mesh):
        d_state = jax.jit(lambda: _select(init(), _D_KEYS), out_shardings=d_sh)()
    fns = GANFunctions(config, g_def, d_def, tx_g, tx_d, NamedSharding(d_mesh, P("data")))
    d_batch = NamedSharding(d_mesh, P(None, "data"))

    def d_step(s, batch, fakes, labels):
        dp, ds, do = s["d_params"], s["d_stats"], s["d_opt"]
        metrics = {}
        for i in range(config.n_disc):
            (dp, ds, do), metrics = fns.d_update(
                dp, ds, do, batch["image"][i], batch["label"][i], fakes[i], labels[i]
            )
        return {"d_params": dp, "d_stats": ds, "d_opt": do}, metrics

    side = DSide(
        fns,
        d_mesh,
        d_sh,
        d_batch,
        jax.jit(
            d_step,
            in_shardings=(d_sh, d_batch, d_batch, d_batch),
            out_shardings=(d_sh, NamedSharding(d_mesh, P())),
            donate_argnums=(0,),
        ),
    )
    return d_state, side


def build_sides(config: TrainConfig, g_mesh: Mesh, d_mesh: Mesh):
    """Initial states of both groups (sharded on their meshes) and their programs.

    Returns:
      ``(g_state, d_state, GSide, DSide)``.
    """
    g_state, g_side = build_g_side(config, g_mesh)
    d_state, d_side = build_d_side(config, d_mesh)
    return g_state, d_state, g_side, d_side


class AsyncRunner:
    """The async scheme as a runner of `paragan_jax.loop.run_steps` (the interface of
    `paragan_jax.steps.SyncRunner`): both groups on disjoint sub-meshes of one process."""

    scheme = "async"

    def __init__(self, config: TrainConfig, mesh: Mesh, image_shape: tuple[int, ...]):
        check_async_mesh(config, mesh)
        self.config = config
        g_size, d_size = split_devices(config, mesh)
        self.g_mesh, self.d_mesh = split_mesh(mesh, [g_size, d_size], axis="data")
        self.g_state, self.d_state, self.g, self.d = build_sides(config, self.g_mesh, self.d_mesh)
        self.fns = self.g.fns
        self.k = config.async_.staleness
        self.lag = 0 if self.k == 0 else config.async_.buffer_size - 1
        self.image_shape = image_shape
        self.buffer: collections.deque = collections.deque()
        self._compiled = False
        self._host_step: int | None = None  # G steps done, tracked on the host (no device sync)

    @property
    def step(self) -> int:
        if self._host_step is None:
            self._host_step = int(self.g_state["step"])
        return self._host_step

    def _compile(self):
        b, n = self.config.data.batch_size, self.config.n_disc
        shape = (n, b) + tuple(self.image_shape)
        img = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=self.d.batch_sharding)
        lab = jax.ShapeDtypeStruct((n, b), jnp.int32, sharding=self.d.batch_sharding)
        self.g.step = compile_step(self.g.step, self.g_state, name="async_g_step")
        self.d.step = compile_step(
            self.d.step, self.d_state, {"image": img, "label": lab}, img, lab, name="async_d_step"
        )
        self._compiled = True

    def _refresh_snapshot(self) -> None:
        sh = self.g.shardings
        self.g_state["d_snap_params"] = jax.device_put(
            self.d_state["d_params"], sh["d_snap_params"]
        )
        self.g_state["d_snap_stats"] = jax.device_put(self.d_state["d_stats"], sh["d_snap_stats"])

    def _fill_buffer(self) -> None:
        """Start (or resume from a checkpoint without a buffer): ``lag + 1`` copies of the fakes
        of the current G, what the next ``lag + 1`` D steps read."""
        if not self.buffer:
            fakes = self._to_d(self.g.produce(self.g_state))
            self.buffer.extend([fakes] * (self.lag + 1))

    def _to_d(self, fakes):
        return tuple(jax.device_put(x, self.d.batch_sharding) for x in fakes)

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        if not self._compiled:
            self._compile()
        self._fill_buffer()
        batch = device_batch(stack_batches(batches), self.d.batch_sharding)
        fakes, labels = self.buffer[0]
        if len(self.buffer) > self.lag:
            self.buffer.popleft()
        t = self.step
        if self.k and t % self.k == 0:
            self._refresh_snapshot()  # from D as it is before this iteration's update
        self.d_state, d_metrics = self.d.step(self.d_state, batch, fakes, labels)
        if self.k == 0:
            self._refresh_snapshot()  # synchronous: G sees the D it just updated
        self.g_state, new_fakes, new_labels, g_metrics = self.g.step(self.g_state)
        self.buffer.append(self._to_d((new_fakes, new_labels)))
        self._host_step = t + 1
        return {**d_metrics, **g_metrics}

    def end_step(self, stop: bool) -> bool:
        """One process holds both groups: the loop's decision stands."""
        return stop

    # Checkpoints written before the buffer was saved have only "g" and "d".
    optional_checkpoint_keys = ("buffer",)

    def checkpoint_tree(self) -> dict[str, Any]:
        """Both groups' state and the fakes D has yet to read (oldest first)."""
        self._fill_buffer()
        buffer = [{"fakes": f, "labels": y} for f, y in self.buffer]
        return {"g": self.g_state, "d": self.d_state, "buffer": buffer}

    def load_checkpoint_tree(self, tree: dict[str, Any]) -> None:
        self.g_state, self.d_state = dict(tree["g"]), dict(tree["d"])
        self.buffer.clear()
        for entry in tree.get("buffer", []):  # absent: refilled from G on the next step
            self.buffer.append((entry["fakes"], entry["labels"]))
        self._host_step = None

    def sampling_params(self) -> tuple[Any, Any]:
        return self.g_state["ema_params"], self.g_state["g_stats"]

    def close(self) -> None:
        self.buffer.clear()
