"""Scaling model: predicted step time and efficiency of sync and async ParaGAN at pod scale.

Inputs are measured, not guessed: the FLOPs (and bytes) of the step's pieces come from XLA's cost
analysis of the lowered programs of `paragan_jax.train.GANFunctions` (one D update, one G update,
one batch of fakes) at the per-chip batch, and parameter sizes from the abstract train state;
collective times come from `tapas_jax.collectives.collective_seconds` with a `tapas_jax.hardware`
profile. The scaling is weak (fixed per-chip batch, global batch grows with the chips).

Per step, with N chips on a 2-D torus ``a x b`` (TPU v3 pods are 2-D tori):

- compute ``T_c = FLOPs / (peak x achieved_fraction)`` (``achieved_fraction`` is a parameter:
  the share of peak a conv GAN reaches, 0.5 by default; not measured here);
- a gradient all-reduce on the torus = reduce-scatter over ``b``, all-reduce of the ``1/b`` shard
  over ``a``, all-gather over ``b`` (each priced by `collective_seconds`); ``overlap`` is the
  fraction hidden behind the backward pass;
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

`check_cpu` validates the composition on this machine: N = 1, 2, 4 processes (one CPU device
each, gloo collectives, via `paragan_jax.distributed.launch`) run the real sync step data-parallel;
the prediction uses the 1-process step time, jitter and cores kept busy, the collectives XLA
compiled into each step priced per latency hop and per byte, gloo's bandwidth from a bare
all-reduce, and a host-contention factor (processes share the cores; on a TPU each chip computes
on its own). The per-hop latency is calibrated on 2 processes; larger counts are predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from tapas_jax.collectives import collective_seconds
from tapas_jax.hardware import HardwareProfile, get_profile

__all__ = [
    "PAPER_EFFICIENCY_1024_CORES",
    "ScalingParams",
    "StepCosts",
    "allreduce_seconds",
    "check_cpu",
    "expected_max_normal",
    "measure_step_costs",
    "predict",
    "scaling_command",
    "torus_shape",
    "tpu_slice",
]

PAPER_EFFICIENCY_1024_CORES = 0.91
"""ParaGAN (Wang et al.) reports 91% scaling efficiency on 1024 TPU v3 cores (= 512 chips)."""

MODEL_PRESETS = {"biggan128": "biggan128_tpu", "biggan256": "biggan256_tpu"}


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
    """Parameters of the model that are not measured here (each with its reason)."""

    achieved_fraction: float = 0.5
    """Share of peak FLOP/s the step reaches on one chip (conv GANs on TPU: roughly 0.4-0.6)."""
    jitter: float = 0.02
    """Relative std of one chip's step time (host, network and ICI jitter)."""
    overlap: float = 0.0
    """Fraction of gradient all-reduce hidden behind the backward pass."""
    small_collectives: int = 0
    """Latency-bound collectives per step besides the gradient all-reduces (batch-norm statistics,
    loss means), each paying one torus all-reduce latency; `count_step_collectives` measures it
    from the compiled step (``--count-collectives``)."""
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


def tpu_slice(accelerator: str) -> dict[str, Any]:
    """Chips, TensorCores and hosts of a Cloud TPU accelerator type (``v3-32``, ``v6e-16``).

    v2, v3, v4 and v5p types count TensorCores (two per chip); v5e (``v5litepod-N``) and v6e
    count chips. Hosts hold 4 chips, except single-host v5e/v6e slices of up to 8 chips.
    """
    import re

    m = re.fullmatch(r"(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)", accelerator.strip().lower())
    if not m:
        raise ValueError(
            f"unknown accelerator type {accelerator!r}; expected e.g. v3-8, v3-32, v4-16, "
            "v5p-8, v5litepod-16, v6e-8"
        )
    gen, n = m.group(1), int(m.group(2))
    if gen in ("v2", "v3", "v4", "v5p"):
        if n % 2:
            raise ValueError(f"{accelerator}: {gen} sizes count TensorCores, two per chip")
        chips, cores = n // 2, n
    else:
        chips, cores = n, n
    hosts = 1 if (gen in ("v5litepod", "v5e", "v6e") and chips <= 8) else max(1, -(-chips // 4))
    profile = {"v5litepod": "tpu-v5e", "v5e": "tpu-v5e"}.get(gen, f"tpu-{gen}")
    return {
        "accelerator": accelerator,
        "chips": chips,
        "cores": cores,
        "hosts": hosts,
        "profile": profile,
    }


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; 0 for n = 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    from scipy.stats import norm

    return float(norm.ppf((n - 0.375) / (n + 0.25)))


def torus_shape(chips: int) -> tuple[int, int]:
    """The most square ``a x b`` (a <= b) factorisation of a slice of `chips` chips."""
    if chips < 1:
        raise ValueError(f"chips must be >= 1, got {chips}")
    a = int(math.isqrt(chips))
    while chips % a:
        a -= 1
    return a, chips // a


def allreduce_seconds(nbytes: float, chips: int, hw: str | HardwareProfile) -> float:
    """All-reduce of `nbytes` over `chips` on a 2-D torus (RS over b, AR over a, AG over b)."""
    a, b = torus_shape(chips)
    return (
        collective_seconds("reduce-scatter", nbytes, b, hw)
        + collective_seconds("all-reduce", nbytes / b, a, hw)
        + collective_seconds("all-gather", nbytes, b, hw)
    )


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
        comm = costs.n_disc * allreduce_seconds(costs.d_param_bytes, chips, hw)
        comm += allreduce_seconds(costs.g_param_bytes, chips, hw)
        comm += params.small_collectives * allreduce_seconds(4.0, chips, hw)
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
            n_g = min(chips - 1, max(1, round(chips * share)))
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
        small_g = params.small_collectives * share * allreduce_seconds(4.0, n_g, hw)
        small_d = params.small_collectives * (1 - share) * allreduce_seconds(4.0, n_d, hw)
        ar_g = allreduce_seconds(costs.g_param_bytes, n_g, hw) * (1 - params.overlap) + small_g
        ar_d = (
            costs.n_disc * allreduce_seconds(costs.d_param_bytes, n_d, hw) * (1 - params.overlap)
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
    import jax
    import numpy as np

    return float(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def _cost(lowered) -> tuple[float, float]:
    ca = lowered.cost_analysis()
    if isinstance(ca, list | tuple):  # older jax returned one dict per program
        ca = ca[0]
    if not ca or "flops" not in ca:
        raise RuntimeError("XLA cost analysis returned no FLOP count for this backend")
    return float(ca["flops"]), float(ca.get("bytes accessed", 0.0))


def load_model_config(model: str, per_chip_batch: int, overrides=()):
    """The `TrainConfig` of a model name (``biggan128``) or preset, at the per-chip batch."""
    from .config import load_train_config

    preset = MODEL_PRESETS.get(model, model)
    return load_train_config(preset, [f"data.batch_size={per_chip_batch}", *overrides])


def measure_step_costs(config, name: str | None = None) -> StepCosts:
    """Costs of one D update, one G update and one batch of fakes at ``config.data.batch_size``.

    Lowers the trainer's own pieces (`paragan_jax.train.GANFunctions`) on abstract inputs, so
    nothing is allocated and BigGAN-sized models cost seconds, not minutes.
    """
    import jax
    import jax.numpy as jnp

    from .train import GANFunctions, TrainState, graphdefs, make_optimizer

    tx_g, tx_d = make_optimizer(config.optim_g), make_optimizer(config.optim_d)
    g_def, d_def = graphdefs(config)
    from .models import build_models

    def init():
        from flax import nnx

        g, d = build_models(config.model, nnx.Rngs(params=0))
        _, gp, gs = nnx.split(g, nnx.Param, ...)
        _, dp, ds = nnx.split(d, nnx.Param, ...)
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(0),
            g_params=gp,
            g_stats=gs,
            d_params=dp,
            d_stats=ds,
            ema_params=gp,
            g_opt=tx_g.init(gp),
            d_opt=tx_d.init(dp),
        )

    ab = jax.eval_shape(init)
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
    import jax

    from tapas_jax.mesh import make_mesh
    from tapas_jax.verification import count_collectives

    from .train import batch_struct, make_sync_step, make_train_state

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


# ---------------------------------------------------------------------------------------------
# Measured multi-process CPU runs (the model's check).

CPU_CHECK_OVERRIDES = (
    "model.arch=dcgan",
    "model.resolution=16",
    "model.channels=3",
    "model.g_width=32",
    "model.d_width=32",
    "model.z_dim=32",
    "model.num_classes=10",
    "model.shared_dim=16",
    "n_disc=1",
    "sharding.params=replicated",
    "sharding.num_devices=0",
)
"""The CPU check's model: the tiny preset widened so that a step is compute, not dispatch."""


def _worker(argv: list[str]) -> int:
    """One process of the CPU check: all process counts in one runtime, in interleaved rounds.

    Every process joins one runtime of ``--num-processes`` processes (one CPU device each). For
    each count n in ``--counts``, the first n processes build the sync step on a mesh of their n
    devices; in each round they run ``--steps`` steps for each n in turn while the others wait at
    a barrier, so every n sees the same drifting machine load. Process 0 also times a bare
    all-reduce between two processes at several sizes, and reports the compiled step's
    collectives (`tapas_jax.verification.count_collectives`) for each n.
    """
    ap = argparse.ArgumentParser(prog="python -m paragan_jax.scaling")
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--counts", default="1,2,4")
    ap.add_argument("--per-process-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--allreduce-sizes", default="4096,1048576,4194304")
    args = ap.parse_args(argv)
    # Single-threaded Eigen kernels, so that a process keeps about one core busy; the check
    # measures how many it does (CPU time per wall second) rather than assuming it.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    )
    from .distributed import initialize

    initialize(args.process_id, args.num_processes, args.port)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from tapas_jax.mesh import make_mesh
    from tapas_jax.verification import count_collectives

    from .train import make_sync_step, make_train_state

    def barrier(name: str) -> None:
        # The coordinator's key-value barrier: unlike a device collective it has no short
        # connect timeout, so processes that compile at very different speeds still meet.
        try:
            from jax._src import distributed

            client = distributed.global_state.client
        except (ImportError, AttributeError):  # private API moved: use a device barrier
            client = None
        if client is None:
            multihost_utils.sync_global_devices(name)
        else:
            client.wait_at_barrier(name, 1_200_000)

    pid = args.process_id
    counts = [int(c) for c in args.counts.split(",")]
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    runs: dict[int, Any] = {}
    out: dict[str, Any] = {"counts": counts, "collectives": {}, "step_times": {}}
    for n in counts:
        if pid < n:
            cfg = load_model_config("tiny", args.per_process_batch * n, CPU_CHECK_OVERRIDES)
            mesh = make_mesh(f"data={n}", devices=devices[:n])
            state, parts = make_train_state(cfg, mesh)
            step = make_sync_step(cfg, parts)
            m, b = cfg.model, args.per_process_batch
            rng = np.random.default_rng(pid)
            local = {
                "image": rng.uniform(
                    -1, 1, (cfg.n_disc, b, m.resolution, m.resolution, m.channels)
                ).astype(np.float32),
                "label": rng.integers(0, m.num_classes, (cfg.n_disc, b)).astype(np.int32),
            }
            batch = {
                k: jax.make_array_from_process_local_data(parts.batch_sharding, v)
                for k, v in local.items()
            }
            compiled = step.lower(state, batch).compile()
            if pid == 0:
                c, moved = count_collectives(compiled.as_text(), n)
                out["collectives"][str(n)] = {"count": c, "moved_bytes": moved}
            runs[n] = [compiled, state, batch]
        barrier(f"compiled-{n}")
        if pid < n:
            compiled, state, batch = runs[n]
            state, metrics = compiled(state, batch)  # warm-up
            jax.block_until_ready(metrics)
            runs[n][1] = state
        barrier(f"warm-{n}")
    times: dict[int, list[float]] = {n: [] for n in counts}
    cpu: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts:
            if pid < n:
                compiled, state, batch = runs[n]
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    state, metrics = compiled(state, batch)
                    jax.block_until_ready(metrics)
                    times[n].append(time.perf_counter() - t0)
                    cpu[n].append(time.process_time() - c0)
                runs[n][1] = state
            barrier(f"round-{r}-{n}")
    out["step_times"] = {str(n): t for n, t in times.items()}
    out["cpu_times"] = {str(n): t for n, t in cpu.items()}
    sizes = [int(s) for s in args.allreduce_sizes.split(",") if s]
    barrier("allreduce")
    if sizes and args.num_processes >= 2 and pid < 2:
        mesh2 = make_mesh("data=2", devices=devices[:2])
        sharded = NamedSharding(mesh2, P("data"))
        f = jax.jit(lambda x: jnp.sum(x, axis=0), out_shardings=NamedSharding(mesh2, P()))
        coll = {}
        for size in sizes:
            x = jax.make_array_from_process_local_data(
                sharded, np.ones((1, max(1, size // 4)), np.float32)
            )
            jax.block_until_ready(f(x))
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                ts.append(time.perf_counter() - t0)
            coll[str(size)] = float(np.median(ts))
        out["allreduce_s"] = coll
    barrier("done")
    if pid == 0:
        print("RESULT " + json.dumps(out), flush=True)
    return 0


def _run_processes(counts, steps: int, rounds: int, batch: int) -> dict:
    from .distributed import launch

    extra = [
        "--counts",
        ",".join(map(str, counts)),
        "--steps",
        str(steps),
        "--rounds",
        str(rounds),
        "--per-process-batch",
        str(batch),
    ]
    results = launch(
        extra,
        num_processes=max(counts),
        devices_per_process=1,
        timeout_s=1500,
        module="paragan_jax.scaling",
    )
    for line in results[0].stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"process 0 printed no result:\n{results[0].stdout[-2000:]}")


def fit_alpha_beta(sizes_to_seconds: dict[int, float], p: int) -> tuple[float, float]:
    """Per-hop latency and bandwidth of a ring all-reduce over `p` from measured times.

    Fits ``t = 2(p-1) alpha + 2(p-1)/p V / W`` by least squares over the sizes V.
    """
    import numpy as np

    if p < 2 or len(sizes_to_seconds) < 2:
        raise ValueError("need p >= 2 and at least two message sizes")
    v = np.array([float(s) for s in sizes_to_seconds])
    t = np.array(list(sizes_to_seconds.values()))
    a = np.stack([np.full_like(v, 2 * (p - 1)), 2 * (p - 1) / p * v], axis=1)
    (alpha, inv_w), *_ = np.linalg.lstsq(a, t, rcond=None)
    alpha, inv_w = max(float(alpha), 1e-7), max(float(inv_w), 1e-12)
    return alpha, 1.0 / inv_w


HOPS_PER_COLLECTIVE = {
    "all-reduce": lambda p: 2 * (p - 1),
    "all-gather": lambda p: p - 1,
    "reduce-scatter": lambda p: p - 1,
    "all-to-all": lambda p: p - 1,
    "collective-permute": lambda p: 1,
}
"""Latency hops of one collective over ``p`` devices (ring algorithms, as in
`tapas_jax.collectives`; a collective-permute sends to its neighbour: one hop)."""


def hlo_collective_terms(
    counts: dict[str, int], moved: dict[str, float], p_compiled: int, p: int
) -> tuple[int, float]:
    """Latency hops and bytes each device sends for a compiled step's collectives at `p` devices.

    `counts` and `moved` are `tapas_jax.verification.count_collectives` of the step compiled at
    `p_compiled` devices. Under data parallelism each collective keeps its payload as the
    device count changes, so the payloads are recovered from the bytes moved at `p_compiled`
    and priced again at `p` with `tapas_jax.collectives.bytes_moved`.
    """
    from tapas_jax.collectives import bytes_moved

    hops, sent = 0, 0.0
    if p <= 1:
        return 0, 0.0
    for kind, count in counts.items():
        if count <= 0:
            continue
        if kind not in HOPS_PER_COLLECTIVE:
            raise ValueError(f"unknown collective {kind!r} in the compiled step")
        hops += count * HOPS_PER_COLLECTIVE[kind](p)
        if kind == "collective-permute":
            sent += moved.get(kind, 0.0)  # point to point: the payload itself
        else:
            per_byte = bytes_moved(kind, 1.0, max(p_compiled, 2))
            sent += bytes_moved(kind, moved.get(kind, 0.0) / per_byte, p)
    return hops, sent


def check_cpu(
    processes=(1, 2, 4), steps: int = 5, rounds: int = 4, batch: int = 16, cores: int | None = None
) -> dict[str, Any]:
    """Measured against predicted sync step time at 1, 2, 4 (or more) CPU processes.

    The model composes, for n processes on ``cores`` cores, the same terms as `predict`:

    - compute: the 1-process step time ``t1`` stretched by host contention
      ``max(1, n u1 / cores)``, where ``u1`` is the measured CPU time per wall second of the
      1-process step (how many cores one process keeps busy);
    - collectives: those XLA compiled into the n-process step (`hlo_collective_terms`), at one
      ``alpha`` per latency hop plus the bytes sent over gloo's bandwidth ``W``;
    - jitter: the 1-process step's relative spread times E[max of n normals].

    ``W`` comes from a bare all-reduce at three sizes. ``alpha`` does not: a collective inside
    the step is a rendezvous of processes that the OS schedules, and costs several times what a
    lone all-reduce shows (both are reported). So ``alpha`` is calibrated on the smallest
    multi-process count (2: ``alpha`` = the 2-process step's time left after compute, bytes
    and jitter, per hop), like ``t1`` is on 1 process; every larger count is a prediction, and
    only those rows (``role == "prediction"``) test the model.
    """
    import numpy as np

    processes = tuple(sorted(set(processes)))
    if processes[:2] != (1, 2) or len(processes) < 3:
        raise ValueError(
            f"processes {processes}: need 1 and 2 (calibration) and at least one larger count"
        )
    cores = cores or os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    res = _run_processes(processes, steps, rounds, batch)
    load_after = os.getloadavg()[0]
    alpha_lone, bw = fit_alpha_beta({int(k): v for k, v in res["allreduce_s"].items()}, 2)
    base = np.array(res["step_times"]["1"])
    util = float(np.median(np.array(res["cpu_times"]["1"]) / base))
    q25, t1, q75 = np.percentile(base, [25, 50, 75])
    jitter = float((q75 - q25) / 1.349 / t1)  # robust std: other jobs' bursts are outliers

    def rows_for(stat, t_1, jit_rel):
        terms = {}
        for n in processes:
            coll = res["collectives"].get(str(n), {"count": {}, "moved_bytes": {}})
            hops, sent = hlo_collective_terms(coll["count"], coll["moved_bytes"], n, n)
            compute = t_1 * max(1.0, n * util / cores)
            jit = jit_rel * expected_max_normal(n) * compute
            terms[n] = (float(stat(res["step_times"][str(n)])), compute, hops, sent, jit, coll)
        m2, c2, h2, s2, j2, _ = terms[2]
        alpha = max(1e-6, (m2 - c2 - s2 / bw - j2) / h2) if h2 else 1e-6
        rows = []
        for n, (measured, compute, hops, sent, jit, coll) in terms.items():
            comm = hops * alpha + sent / bw
            pred = compute + comm + jit
            rows.append(
                {
                    "processes": n,
                    "role": {1: "calibrates t1", 2: "calibrates alpha"}.get(n, "prediction"),
                    "measured_s": measured,
                    "predicted_s": pred,
                    "error": pred / measured - 1.0,
                    "compute_s": compute,
                    "collectives_s": comm,
                    "latency_hops": hops,
                    "bytes_sent": sent,
                    "jitter_s": jit,
                    "collectives": coll["count"],
                }
            )
        return rows, alpha

    rows, alpha = rows_for(np.median, float(t1), jitter)
    # Best case (fastest step of each count, no jitter term): least touched by other jobs.
    rows_min, alpha_min = rows_for(np.min, float(base.min()), 0.0)
    cfg = load_model_config("tiny", batch, CPU_CHECK_OVERRIDES)
    costs = measure_step_costs(cfg, "cpu-check")
    return {
        "rows": rows,
        "rows_min": rows_min,
        "cores": cores,
        "load_average": [load_before, load_after],
        "cores_busy_1_process": util,
        "alpha_s": alpha,
        "alpha_fastest_s": alpha_min,
        "alpha_lone_allreduce_s": alpha_lone,
        "bandwidth_Bps": bw,
        "jitter": jitter,
        "step_flops": costs.sync_flops,
        "achieved_flops_per_s": costs.sync_flops / float(t1),
        "allreduce_measured_s": res["allreduce_s"],
        "step_times": res["step_times"],
        "cpu_times": res["cpu_times"],
    }


# ---------------------------------------------------------------------------------------------
# The command.


def scaling_command(argv: list[str]) -> int:
    """``python -m paragan_jax scaling --model biggan128 --chips 8,64,256,1024 ...``."""
    ap = argparse.ArgumentParser(prog="python -m paragan_jax scaling")
    ap.add_argument("--model", default="biggan128", help="biggan128, biggan256 or a preset")
    ap.add_argument("--chips", default="8,64,256,1024", help="comma-separated chip counts")
    ap.add_argument("--hardware", default="tpu-v3", help="tapas_jax hardware profile")
    ap.add_argument("--json", type=Path, help="write rows and inputs here")
    ap.add_argument("--per-chip-batch", type=int, default=8)
    ap.add_argument(
        "--jitter",
        type=float,
        default=ScalingParams.jitter,
        help="relative std of one chip's step time",
    )
    ap.add_argument("--achieved-fraction", type=float, default=ScalingParams.achieved_fraction)
    ap.add_argument("--overlap", type=float, default=ScalingParams.overlap)
    ap.add_argument(
        "--count-collectives",
        action="store_true",
        help="count the step's small collectives from a narrow compiled copy (slow)",
    )
    ap.add_argument(
        "--small-collectives",
        type=int,
        default=0,
        help="latency-bound collectives per step besides gradient all-reduces",
    )
    ap.add_argument("--check-cpu", default="", help="also measure N CPU processes, e.g. 1,2,4")
    ap.add_argument("--check-steps", type=int, default=5, help="steps per round per count")
    args = ap.parse_args(argv[1:])
    try:
        chips = [int(c) for c in args.chips.split(",") if c.strip()]
        if not chips or min(chips) < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--chips {args.chips!r}: expected positive integers such as 8,64,256,1024")
    cfg = load_model_config(args.model, args.per_chip_batch)
    small, counted = args.small_collectives, None
    if args.count_collectives:
        narrow = load_model_config(
            args.model,
            args.per_chip_batch,
            [
                "model.g_width=4",
                "model.d_width=4",
                "model.dtype=float32",
                "sharding.params=replicated",
            ],
        )
        counted = count_step_collectives(narrow)
        # XLA combines the gradient all-reduces into a few; count them all as small ones
        # (an over-estimate by those few latency terms).
        small = int(sum(counted.values()))
    try:
        hw = get_profile(args.hardware)
        params = ScalingParams(args.achieved_fraction, args.jitter, args.overlap, small)
    except ValueError as e:
        ap.error(str(e))
    costs = measure_step_costs(cfg, args.model)
    rows = [predict(costs, n, s, hw, params) for n in chips for s in ("sync", "async")]
    paper = {
        "published_efficiency": PAPER_EFFICIENCY_1024_CORES,
        "published_at": "1024 TPU v3 cores = 512 chips",
        "predicted_async_512_chips": predict(costs, 512, "async", hw, params)["efficiency"],
        "predicted_sync_512_chips": predict(costs, 512, "sync", hw, params)["efficiency"],
    }
    print(
        f"{args.model} on {hw.name}, per-chip batch {args.per_chip_batch}, jitter "
        f"{params.jitter:.0%}, achieved {params.achieved_fraction:.0%} of peak"
    )
    print(f"{'chips':>6} {'scheme':>6} {'step ms':>9} {'efficiency':>10} {'allreduce ms':>12}")
    for r in rows:
        print(
            f"{r['chips']:6d} {r['scheme']:>6} {1e3 * r['step_seconds']:9.2f} "
            f"{r['efficiency']:10.1%} {1e3 * r['allreduce_s']:12.2f}"
        )
    print(
        f"ParaGAN published {PAPER_EFFICIENCY_1024_CORES:.0%} at 1024 v3 cores (512 chips); "
        f"predicted here at 512 chips: async {paper['predicted_async_512_chips']:.1%}, "
        f"sync {paper['predicted_sync_512_chips']:.1%}"
    )
    out: dict[str, Any] = {
        "model": args.model,
        "hardware": hw.name,
        "rows": rows,
        "params": dataclasses.asdict(params),
        "costs": dataclasses.asdict(costs),
        "paper": paper,
        "counted_collectives": counted,
    }
    if args.check_cpu:
        try:
            procs = tuple(sorted({int(p) for p in args.check_cpu.split(",") if p.strip()}))
        except ValueError:
            procs = ()
        if procs[:2] != (1, 2) or len(procs) < 3:
            ap.error(
                f"--check-cpu {args.check_cpu!r}: needs 1 and 2 (calibration) and at least one "
                "larger process count, e.g. 1,2,4"
            )
        check = check_cpu(procs, steps=args.check_steps)
        out["cpu_check"] = check
        print(
            f"CPU check ({check['cores']} cores, {check['cores_busy_1_process']:.2f} busy per "
            f"process; per-hop latency in the step {1e3 * check['alpha_s']:.2f} ms (lone "
            f"all-reduce: {1e3 * check['alpha_lone_allreduce_s']:.2f} ms), "
            f"{check['bandwidth_Bps'] / 1e9:.2f} GB/s):"
        )
        print(f"  load average {check['load_average'][0]:.1f} -> {check['load_average'][1]:.1f}")
        for label, key in (("median", "rows"), ("fastest", "rows_min")):
            for r in check[key]:
                print(
                    f"  {label:>7} {r['processes']} processes: measured "
                    f"{1e3 * r['measured_s']:.1f} ms, predicted {1e3 * r['predicted_s']:.1f} ms "
                    f"({r['error']:+.0%}, {r['role']})"
                )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
        png = args.json.with_suffix(".png")
        plot_scaling(out, png)
        print(f"wrote {args.json} and {png}")
    return 0


def plot_scaling(out: dict[str, Any], path: Path) -> None:
    """Predicted efficiency per chip count (sync, async, ParaGAN's published point) and, when
    the CPU check ran, measured against predicted step time per process count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    check = out.get("cpu_check")
    fig, axes = plt.subplots(1, 2 if check else 1, figsize=(11 if check else 6, 4.2))
    ax = axes[0] if check else axes
    for scheme, marker in (("sync", "o"), ("async", "s")):
        rows = [r for r in out["rows"] if r["scheme"] == scheme]
        ax.plot(
            [r["chips"] for r in rows],
            [100 * r["efficiency"] for r in rows],
            marker=marker,
            label=f"{scheme} (predicted)",
        )
    ax.plot([512], [100 * PAPER_EFFICIENCY_1024_CORES], "k*", ms=12, label="ParaGAN, published")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chips")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"{out['model']} on {out['hardware']}")
    ax.grid(alpha=0.3)
    ax.legend()
    if check:
        ax = axes[1]
        rows = check["rows"]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [1e3 * r["measured_s"] for r in rows], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [1e3 * r["predicted_s"] for r in rows], 0.4, label="model")
        ax.set_xticks(
            list(x),
            [
                f"{r['processes']} proc\n{r['role']}"
                if r["role"] != "prediction"
                else f"{r['processes']} proc\n{r['error']:+.0%}"
                for r in rows
            ],
        )
        ax.set_ylabel("sync step, median (ms)")
        ax.set_title(f"CPU check: gloo processes on {check['cores']} cores")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
