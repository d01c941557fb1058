"""The train state of a GAN run and its placement on a mesh.

- `TrainState`: everything a step reads and writes (G, D, the G EMA, both optimizer states, the
  step counter and the RNG key); one pytree, checkpointed whole.
- `make_train_state(config, mesh) -> (TrainState, StateLayout)`: builds the state directly sharded
  on `mesh`: shapes come from `jax.eval_shape` of `init_train_state`, values from that function
  jitted with ``out_shardings``, so nothing is materialised unsharded. `StateLayout` holds the
  static pieces (graph definitions, optimizers, shardings, abstract state) that the compiled steps
  (`paragan_jax.steps`) and the async sides (`paragan_jax.async_scheme`) are built from.
- `state_shardings`: the state's NamedShardings under ``sharding.params``: ``replicated``;
  ``fsdp`` (each array's largest dimension that divides the ``data`` axis is sharded over it;
  gradients then reduce-scatter and params all-gather inside the step, chosen by GSPMD); ``plan``
  (placement by a `tapas_jax` plan when the mesh has a ``model`` axis; see `plan_shardings`).
  BN statistics and spectral-norm vectors stay replicated.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tapas_jax.config import ConfigError
from tapas_jax.mesh import axis_size
from tapas_jax.planner import plan as tapas_plan

from .config import OptimConfig, TrainConfig
from .models import build_models

__all__ = [
    "StateLayout",
    "TrainState",
    "batch_struct",
    "check_batch_divides",
    "graphdefs",
    "init_train_state",
    "make_optimizer",
    "make_train_state",
    "param_shardings",
    "plan_shardings",
    "state_shardings",
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


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Static pieces of a run's state: models, optimizers, mesh and shardings."""

    g_def: Any  # nnx.GraphDef of G
    d_def: Any
    tx_g: optax.GradientTransformation
    tx_d: optax.GradientTransformation
    mesh: Mesh
    shardings: TrainState  # of NamedSharding
    batch_sharding: NamedSharding  # (n_disc, B, ...) batch over data
    abstract: TrainState  # of ShapeDtypeStruct


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Adam with the side's learning rate and betas."""
    return optax.adam(cfg.lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)


def graphdefs(config: TrainConfig) -> tuple[Any, Any]:
    """Graph definitions of G and D (built abstractly, no weights allocated)."""
    g, d = nnx.eval_shape(lambda: build_models(config.model, nnx.Rngs(params=0)))
    return nnx.split(g, nnx.Param, ...)[0], nnx.split(d, nnx.Param, ...)[0]


def init_train_state(config: TrainConfig, tx_g, tx_d) -> Callable[[], TrainState]:
    """The state's initialiser (no arguments: seeded by ``config.seed``), for `jax.eval_shape` or
    a jit with ``out_shardings``; the async sides select their parts of its result."""

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


def state_shardings(
    config: TrainConfig, mesh: Mesh, abstract: TrainState, g_def: Any, d_def: Any
) -> TrainState:
    """NamedShardings of the whole state on `mesh` under ``config.sharding.params``.

    Raises:
      ConfigError: an unknown placement mode.
    """
    mode = config.sharding.params
    rep = NamedSharding(mesh, P())
    if mode == "plan":
        planned = plan_shardings(config, mesh, abstract, g_def, d_def)
    else:
        planned = {
            k: param_shardings(getattr(abstract, k), mesh, mode)
            for k in ("g_params", "d_params", "ema_params", "g_opt", "d_opt")
        }
    return TrainState(
        step=rep,
        rng=rep,
        g_stats=param_shardings(abstract.g_stats, mesh, "replicated"),
        d_stats=param_shardings(abstract.d_stats, mesh, "replicated"),
        **planned,
    )


def make_train_state(
    config: TrainConfig,
    mesh: Mesh,
    optim_g: OptimConfig | None = None,
    optim_d: OptimConfig | None = None,
) -> tuple[TrainState, StateLayout]:
    """Builds the sharded train state on `mesh` and the static layout of the run.

    Args:
      config: the run config.
      mesh: a mesh from `tapas_jax.mesh` with a ``data`` axis (size 1 is fine).
      optim_g, optim_d: optimizer overrides (the async scheme's asymmetric settings).

    Returns:
      ``(state, layout)``; ``state`` lives on `mesh` with ``layout.shardings``.

    Raises:
      ConfigError: the batch does not divide the data axis, or an unknown placement mode.
    """
    check_batch_divides(config, mesh)
    tx_g = make_optimizer(optim_g or config.optim_g)
    tx_d = make_optimizer(optim_d or config.optim_d)
    g_def, d_def = graphdefs(config)
    init = init_train_state(config, tx_g, tx_d)
    abstract = jax.eval_shape(init)
    shardings = state_shardings(config, mesh, abstract, g_def, d_def)
    with jax.set_mesh(mesh):
        state = jax.jit(init, out_shardings=shardings)()
    layout = StateLayout(
        g_def, d_def, tx_g, tx_d, mesh, shardings, NamedSharding(mesh, P(None, "data")), abstract
    )
    return state, layout


def batch_struct(
    config: TrainConfig, layout: StateLayout, image_shape: tuple[int, ...]
) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract ``(n_disc, B, ...)`` batch with its sharding, for lowering the step."""
    lead = (config.n_disc, config.data.batch_size)
    return {
        "image": jax.ShapeDtypeStruct(
            lead + tuple(image_shape), jnp.float32, sharding=layout.batch_sharding
        ),
        "label": jax.ShapeDtypeStruct(lead, jnp.int32, sharding=layout.batch_sharding),
    }
