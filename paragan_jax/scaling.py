"""Scaling model: predicted step time and efficiency of sync and async ParaGAN at pod scale.

Every input is measured, compiled, published or (two ranges) assumed, and the command's
input table says which (`paragan_jax.scale_cli`). The FLOPs (and bytes) of the step's pieces
come from XLA's cost analysis of the lowered programs of `paragan_jax.steps.GANFunctions` (one
D update, one G update, one batch of fakes) at the per-chip batch; parameter sizes from the
abstract train state; collective times from `tapas_jax.collectives` (`torus_allreduce_seconds`,
built on `collective_seconds`) with a `tapas_jax.hardware` profile; the overlap of collectives
with compute from the compiled schedule (`paragan_jax.overlap`). The scaling is weak (fixed
per-chip batch, global batch grows with the chips).

Per step, with N chips on a 2-D torus ``a x b`` (TPU v3 pods are 2-D tori):

- compute ``T_c = FLOPs / (peak x achieved_fraction)`` (``achieved_fraction``: a range,
  `RANGES`; the prediction is a band over it and over ``jitter``, `predict_band`);
- a gradient all-reduce on the torus = reduce-scatter over ``b``, all-reduce of the ``1/b`` shard
  over ``a``, all-gather over ``b`` (`tapas_jax.collectives.torus_allreduce_seconds`);
  ``overlap`` is the fraction hidden behind compute, read per scheme from the compiled schedule
  (`paragan_jax.overlap`);
- ``small_collectives`` latency-bound collectives (batch-norm statistics over the sharded batch,
  loss means), each one torus all-reduce latency; counted from the compiled step of a narrow copy
  of the model (``--count-collectives``), 0 by default;
- network/host jitter: every chip's step time is ``T (1 + jitter Z)``; a barrier over ``n``
  chips waits for the slowest, ``E[max of n] = jitter x T x Phi^-1((n - 0.375)/(n + 0.25))``
  (Blom's approximation of the normal order statistic).

sync: ``n_disc`` D updates and one G update on all N chips, each ending in a gradient all-reduce
over all N and a barrier: ``T = T_c + exposed all-reduces + jitter(N)``.

async (ParaGAN): G and D on disjoint groups ``N_g + N_d = N`` (whole rows of the torus, split in
proportion to their FLOPs);
each group's all-reduce and barrier span only its own chips; fakes (G -> D, every step) and the D
snapshot (D -> G, every ``k`` steps) travel over ICI while the next step computes (only the part
longer than the step is exposed); the bounded buffer lets the two groups drift by up to ``k``
steps, so between groups only the slower group's mean over ``k`` steps matters
(``E[max of 2] / sqrt(k)``). ``T = max(T_G, T_D) + cross-group jitter + exposed exchange``.

Efficiency is ``T_c(1 chip) / T(N)``: per-chip throughput relative to one chip doing the whole
sync step with no communication and no jitter.

The model is checked against measured multi-process CPU runs by `paragan_jax.scaling_check`;
the command is ``python -m paragan_jax scaling`` (`paragan_jax.scale_cli`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import norm

from tapas_jax.collectives import torus_allreduce_seconds, torus_shape
from tapas_jax.hardware import HardwareProfile, get_profile
from tapas_jax.mesh import make_mesh
from tapas_jax.verification import count_collectives

from .config import TrainConfig, load_train_config
from .state import batch_struct, graphdefs, init_train_state, make_optimizer, make_train_state
from .steps import GANFunctions, make_sync_step

__all__ = [
    "MODEL_PRESETS",
    "PAPER_EFFICIENCY_1024_CORES",
    "RANGES",
    "ScalingParams",
    "StepCosts",
    "count_step_collectives",
    "expected_max_normal",
    "group_split",
    "load_model_config",
    "measure_step_costs",
    "predict",
    "predict_band",
]

PAPER_EFFICIENCY_1024_CORES = 0.91
"""ParaGAN reports 91% scaling efficiency for BigGAN on 1024 TPU v3 cores (= 512 chips): Shi, Li,
You, "ParaGAN: A Scalable Distributed Training Framework for Generative Adversarial Networks",
SoCC 2024, arXiv:2411.03999 (abstract)."""

MODEL_PRESETS = {"biggan128": "biggan128_tpu", "biggan256": "biggan256_tpu"}
"""Model names of the command -> the training presets that define them."""


@dataclasses.dataclass(frozen=True)
class StepCosts:
    """Per-chip costs of the pieces of one training step at the per-chip batch."""

    model: str
    per_chip_batch: int
    n_disc: int
    staleness: int
    d_update_flops: float
    d_update_bytes: float
    g_update_flops: float
    g_update_bytes: float
    fakes_flops: float
    fakes_bytes: float
    g_param_bytes: float
    d_param_bytes: float
    image_bytes: float
    """Bytes of one fake image as exchanged (compute dtype)."""

    @property
    def sync_flops(self) -> float:
        return self.n_disc * (self.fakes_flops + self.d_update_flops) + self.g_update_flops

    @property
    def sync_bytes(self) -> float:
        return self.n_disc * (self.fakes_bytes + self.d_update_bytes) + self.g_update_bytes

    @property
    def g_side_flops(self) -> float:
        return self.g_update_flops + self.n_disc * self.fakes_flops

    @property
    def d_side_flops(self) -> float:
        return self.n_disc * self.d_update_flops


@dataclasses.dataclass(frozen=True)
class ScalingParams:
    """The inputs of the model that are not step costs (`StepCosts`) or hardware figures."""

    achieved_fraction: float = 0.5
    """Share of peak FLOP/s the step reaches on one chip (a range: `RANGES`)."""
    jitter: float = 0.02
    """Relative std of one chip's step time (host, network and ICI jitter; a range: `RANGES`)."""
    overlap: float = 0.0
    """Fraction of the gradient all-reduce hidden behind compute; read per scheme from the
    compiled schedule by `paragan_jax.overlap` (``scaling schedule=...``), else 0."""
    small_collectives: int = 0
    """Latency-bound collectives per step besides the gradient all-reduces (batch-norm statistics,
    loss means), each paying one torus all-reduce latency; counted from the compiled step
    (``schedule=...`` or ``--count-collectives``)."""
    use_bytes: bool = False
    """Also bound compute by ``bytes / HBM bandwidth`` (roofline). Off by default: the
    lowered (unfused) HLO overcounts bytes several-fold."""

    def __post_init__(self):
        if not 0 < self.achieved_fraction <= 1:
            raise ValueError(f"achieved_fraction must be in (0, 1], got {self.achieved_fraction}")
        if self.jitter < 0:
            raise ValueError(f"jitter must be >= 0, got {self.jitter}")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")


RANGES: dict[str, tuple[float, float, float]] = {
    "achieved_fraction": (0.35, 0.5, 0.65),
    "jitter": (0.0, 0.02, 0.05),
}
"""(low, expected, high) of the inputs that are ranges, not one value. Neither is measured on a
TPU here (this machine has none); each row of the input table says so.

- ``achieved_fraction``: share of the chip's peak that a bf16 conv GAN step reaches. Expected is
  XLA's TPU cost model's estimate for the compiled BigGAN step when it is read (``scaling
  schedule=tpu:...``: `paragan_jax.overlap`), else 0.5; the range spans what convolutional
  training steps reach on TPUs.
- ``jitter``: relative std of one chip's step time. 0: a dedicated slice with nothing else on
  its hosts; 2%: expected; 5%: a congested cloud host. No published per-chip figure was found
  (ParaGAN, arXiv:2411.03999, builds a congestion-aware pipeline because cloud input traffic
  varies, but its abstract gives no spread), so the three values are assumptions and the input
  table marks them so.
"""


def predict_band(
    costs: StepCosts,
    chips: int,
    scheme: str,
    hardware: str | HardwareProfile,
    params: ScalingParams = ScalingParams(),
    ranges: dict[str, tuple[float, float, float]] = RANGES,
) -> dict[str, Any]:
    """`predict` at the expected inputs, with the efficiency band over every corner of `ranges`.

    Returns:
      `predict`'s row (``step_seconds`` and ``efficiency`` at the expected values) plus
      ``efficiency_low`` / ``efficiency_high`` and ``step_seconds_low`` / ``step_seconds_high``.
    """
    names = list(ranges)
    row = predict(
        costs,
        chips,
        scheme,
        hardware,
        dataclasses.replace(params, **{k: ranges[k][1] for k in names}),
    )
    corners = [
        predict(costs, chips, scheme, hardware, dataclasses.replace(params, **dict(zip(names, c))))
        for c in itertools.product(*[(ranges[k][0], ranges[k][2]) for k in names])
    ]
    effs = [r["efficiency"] for r in corners] + [row["efficiency"]]
    steps = [r["step_seconds"] for r in corners] + [row["step_seconds"]]
    return {
        **row,
        "efficiency_low": min(effs),
        "efficiency_high": max(effs),
        "step_seconds_low": min(steps),
        "step_seconds_high": max(steps),
    }


def group_split(chips: int, g_share: float, batch: int | None = None) -> tuple[int, int]:
    """``(n_g, n_d)``: chips (or processes) of the async G and D groups along one axis, split in
    proportion to their work; `g_share` is G's share of the step's FLOPs (its update and the
    fakes for D). Each group gets at least one. With `batch` (the global batch), the split
    nearest that proportion whose groups both divide the batch."""
    if chips < 2:
        raise ValueError(f"the async scheme needs at least 2 chips, got {chips}")
    target = chips * g_share
    if batch is None:
        n_g = min(chips - 1, max(1, round(target)))
        return n_g, chips - n_g
    options = [g for g in range(1, chips) if batch % g == 0 and batch % (chips - g) == 0]
    if not options:
        raise ValueError(f"no split of {chips} into two groups divides the batch {batch}")
    n_g = min(options, key=lambda g: (abs(g - target), g))
    return n_g, chips - n_g


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n = 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    return float(norm.ppf((n - 0.375) / (n + 0.25)))


def _compute_seconds(flops: float, nbytes: float, hw: HardwareProfile, p: ScalingParams):
    t = flops / (hw.peak_flops * p.achieved_fraction)
    if p.use_bytes:
        t = max(t, nbytes / hw.hbm_bandwidth)
    return t


def predict(
    costs: StepCosts,
    chips: int,
    scheme: str,
    hardware: str | HardwareProfile,
    params: ScalingParams = ScalingParams(),
) -> dict[str, Any]:
    """Predicted step time and efficiency of one scheme at one chip count.

    Returns:
      ``chips``, ``scheme``, ``step_seconds``, ``efficiency`` and the terms they are made of.
    """
    hw = get_profile(hardware)
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    ideal = _compute_seconds(costs.sync_flops, costs.sync_bytes, hw, params)
    if scheme == "sync" or (scheme == "async" and chips == 1):
        comm = costs.n_disc * torus_allreduce_seconds(costs.d_param_bytes, chips, hw)
        comm += torus_allreduce_seconds(costs.g_param_bytes, chips, hw)
        comm += params.small_collectives * torus_allreduce_seconds(4.0, chips, hw)
        exposed = comm * (1 - params.overlap)
        jitter = params.jitter * expected_max_normal(chips) * ideal
        step = ideal + exposed + jitter
        row = {"compute_s": ideal, "allreduce_s": exposed, "jitter_s": jitter, "exchange_s": 0.0}
        if scheme == "async":
            row["note"] = "one chip cannot hold two groups: runs the sync schedule"
    elif scheme == "async":
        share = costs.g_side_flops / (costs.g_side_flops + costs.d_side_flops)
        # Each group is a sub-torus: whole rows of the a x b torus, split by work.
        a, b = torus_shape(chips)
        if b >= 2:
            n_g = a * min(b - 1, max(1, round(b * share)))
        else:
            n_g = group_split(chips, share)[0]
        n_d = chips - n_g
        scale_g, scale_d = chips / n_g, chips / n_d
        t_g = _compute_seconds(
            costs.g_side_flops * scale_g,
            (costs.g_update_bytes + costs.n_disc * costs.fakes_bytes) * scale_g,
            hw,
            params,
        )
        t_d = _compute_seconds(
            costs.d_side_flops * scale_d, costs.n_disc * costs.d_update_bytes * scale_d, hw, params
        )
        # Small collectives split between the groups in proportion to their work.
        small_g = params.small_collectives * share * torus_allreduce_seconds(4.0, n_g, hw)
        small_d = params.small_collectives * (1 - share) * torus_allreduce_seconds(4.0, n_d, hw)
        ar_g = (
            torus_allreduce_seconds(costs.g_param_bytes, n_g, hw) * (1 - params.overlap) + small_g
        )
        ar_d = (
            costs.n_disc
            * torus_allreduce_seconds(costs.d_param_bytes, n_d, hw)
            * (1 - params.overlap)
            + small_d
        )
        j_g = params.jitter * expected_max_normal(n_g) * t_g
        j_d = params.jitter * expected_max_normal(n_d) * t_d
        side_g, side_d = t_g + ar_g + j_g, t_d + ar_d + j_d
        body = max(side_g, side_d)
        k = max(1, costs.staleness)
        cross = params.jitter * expected_max_normal(2) * body / math.sqrt(k)
        global_batch = costs.per_chip_batch * chips
        fakes = costs.n_disc * global_batch / n_d * costs.image_bytes
        exchange = fakes / hw.ici_link_bandwidth + costs.d_param_bytes / hw.ici_link_bandwidth / k
        exposed_x = max(0.0, exchange - body)
        step = body + cross + exposed_x
        row = {
            "compute_s": max(t_g, t_d),
            "allreduce_s": max(ar_g, ar_d),
            "jitter_s": max(j_g, j_d) + cross,
            "exchange_s": exposed_x,
            "g_chips": n_g,
            "d_chips": n_d,
            "g_side_s": side_g,
            "d_side_s": side_d,
            "g_compute_s": t_g,
            "d_compute_s": t_d,
        }
    else:
        raise ValueError(f"scheme must be 'sync' or 'async', got {scheme!r}")
    return {
        "chips": chips,
        "scheme": scheme,
        "step_seconds": step,
        "efficiency": ideal / step,
        **row,
    }


# ---------------------------------------------------------------------------------------------
# Costs of the real step, from XLA's cost analysis.


def _tree_bytes(tree) -> float:
    return float(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _cost(lowered) -> tuple[float, float]:
    ca = lowered.cost_analysis()
    if isinstance(ca, list | tuple):  # older jax returned one dict per program
        ca = ca[0]
    if not ca or "flops" not in ca:
        raise RuntimeError("XLA cost analysis returned no FLOP count for this backend")
    return float(ca["flops"]), float(ca.get("bytes accessed", 0.0))


def load_model_config(model: str, per_chip_batch: int, overrides=()) -> TrainConfig:
    """The `TrainConfig` of a model name (``biggan128``) or preset, at the per-chip batch."""
    preset = MODEL_PRESETS.get(model, model)
    return load_train_config(preset, [f"data.batch_size={per_chip_batch}", *overrides])


def measure_step_costs(config, name: str | None = None) -> StepCosts:
    """Costs of one D update, one G update and one batch of fakes at ``config.data.batch_size``.

    Lowers the trainer's own pieces (`paragan_jax.steps.GANFunctions`) on abstract inputs, so
    nothing is allocated and BigGAN-sized models cost seconds, not minutes.
    """
    tx_g, tx_d = make_optimizer(config.optim_g), make_optimizer(config.optim_d)
    g_def, d_def = graphdefs(config)

    ab = jax.eval_shape(init_train_state(config, tx_g, tx_d))
    fns = GANFunctions(config, g_def, d_def, tx_g, tx_d, None)
    b, m = config.data.batch_size, config.model
    dtype = jnp.bfloat16 if m.dtype == "bfloat16" else jnp.float32
    img = jax.ShapeDtypeStruct((b, m.resolution, m.resolution, m.channels), jnp.float32)
    lab = jax.ShapeDtypeStruct((b,), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    d_f, d_b = _cost(
        jax.jit(fns.d_update).lower(ab.d_params, ab.d_stats, ab.d_opt, img, lab, img, lab)
    )
    g_f, g_b = _cost(
        jax.jit(fns.g_update, static_argnums=(6,)).lower(
            ab.g_params, ab.g_stats, ab.g_opt, ab.d_params, ab.d_stats, key, b
        )
    )
    f_f, f_b = _cost(
        jax.jit(fns.fakes_for_d, static_argnums=(3,)).lower(ab.g_params, ab.g_stats, key, b)
    )
    return StepCosts(
        model=name or config.name,
        per_chip_batch=b,
        n_disc=config.n_disc,
        staleness=config.async_.staleness,
        d_update_flops=d_f,
        d_update_bytes=d_b,
        g_update_flops=g_f,
        g_update_bytes=g_b,
        fakes_flops=f_f,
        fakes_bytes=f_b,
        g_param_bytes=_tree_bytes(ab.g_params),
        d_param_bytes=_tree_bytes(ab.d_params),
        image_bytes=float(m.resolution * m.resolution * m.channels * jnp.dtype(dtype).itemsize),
    )


def count_step_collectives(config, devices: int = 2) -> dict[str, int]:
    """Collectives in the sync step compiled data-parallel over `devices` local devices.

    Compiling a full-width BigGAN on a CPU is slow; the count depends on the architecture
    (layers, batch norms), not on the widths, so a narrow copy of the model gives the same count.
    """
    if jax.device_count() < devices:
        raise RuntimeError(
            f"need {devices} devices to count collectives, have {jax.device_count()}"
        )
    mesh = make_mesh(f"data={devices}", devices=jax.devices()[:devices])
    state, parts = make_train_state(config, mesh)
    m = config.model
    batch = batch_struct(config, parts, (m.resolution, m.resolution, m.channels))
    text = make_sync_step(config, parts).lower(state, batch).compile().as_text()
    return count_collectives(text, devices)[0]
