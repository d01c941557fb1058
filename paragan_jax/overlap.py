"""Collective overlap of the ParaGAN train step, read from its compiled schedule, not assumed.

`compile_programs` compiles the programs of each scheme for a mesh: the sync step
(`paragan_jax.steps.make_sync_step`) and the async scheme's two group programs (the D group's
``n_disc`` D updates, the G group's G update and next fakes, as in
`paragan_jax.async_scheme`), on abstract inputs, so it also works for a deviceless TPU
topology (`tpu_topology_devices`, needs ``libtpu`` importable; XLA's TPU scheduler then decides
the overlap) as well as for this machine's CPU devices. `read_schedule` reads each program
with `tapas_jax.hlo_schedule.analyse_schedule` (collectives, async start/done pairs, the FLOPs
scheduled inside them and the FLOPs independent of them), and `scheme_overlap` turns that into
the hidden share of a scheme's collective time at one predicted chip count.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tapas_jax.collectives import op_seconds
from tapas_jax.hardware import HardwareProfile, get_profile
from tapas_jax.hlo_schedule import CollectiveOp, ScheduleReport, analyse_schedule, hidden_fraction

from .config import TrainConfig
from .state import (
    StateLayout,
    batch_struct,
    graphdefs,
    init_train_state,
    make_optimizer,
    state_shardings,
)
from .steps import GANFunctions, make_sync_step

__all__ = [
    "compile_programs",
    "read_schedule",
    "scheme_overlap",
    "tpu_topology_devices",
]


def scheme_overlap(
    reports: dict[str, ScheduleReport],
    row: dict[str, Any],
    hardware: str | HardwareProfile,
    scheduled: bool = True,
) -> float:
    """Hidden share of a scheme's collective time at one `paragan_jax.scaling.predict` row.

    Each compiled collective is priced at the row's chip count (its group's, for async) on a
    torus (`tapas_jax.collectives.op_seconds`) and hides what `hidden_fraction` allows behind
    the row's compute time of its program.
    """
    hw = get_profile(hardware)
    if "g_chips" in row:
        parts = [
            ("async-g", row["g_chips"], row["g_compute_s"]),
            ("async-d", row["d_chips"], row["d_compute_s"]),
        ]
    else:
        parts = [("sync", row["chips"], row["compute_s"])]
    total = hidden = 0.0
    for name, chips, compute in parts:
        if name not in reports:
            raise ValueError(f"no compiled schedule for {name!r}; have {sorted(reports)}")
        rep = reports[name]

        def seconds(c: CollectiveOp, n=chips) -> float:
            return op_seconds(c.kind, c.payload_bytes, n, hw)

        t = sum(seconds(c) for c in rep.collectives)
        total += t
        hidden += t * hidden_fraction(rep, seconds, compute, scheduled)
    return hidden / total if total > 0 else 0.0


def read_schedule(
    config: TrainConfig,
    target: str,
    per_chip_batch: int,
    schemes=("sync", "async"),
    dump_dir: str | Path | None = None,
) -> tuple[dict[str, ScheduleReport], dict[str, Any]]:
    """Compiles each scheme's programs for `target` and reads their schedules.

    Args:
      config: the model's `TrainConfig` (its batch is replaced).
      target: ``cpu`` (this machine's devices, up to 8; ``cpu:2``: two of them),
        ``tpu:<topology>`` (``tpu:v3:4x4``: a deviceless TPU topology, XLA's TPU latency-hiding
        scheduler; ``LIBTPU_INIT_ARGS`` passes compiler flags, recorded in the info) or
        ``hlo:<dir>`` (the programs a previous call wrote with `dump_dir`: nothing compiled).
      per_chip_batch: examples per chip (a TPU v2/v3 chip is two devices, each gets half).
      dump_dir: also write each compiled program's text (``<name>.hlo``) and the info
        (``info.json``) there, to be read again with ``hlo:<dir>``.

    Returns:
      ``(reports, info)``: a `ScheduleReport` per program, and the target, devices, XLA's
      cost-model estimate of each program's seconds where the backend gives one, and its FLOPs.
    """
    if target.startswith("hlo:"):
        return _read_dumped(Path(target[len("hlo:") :]))
    if target == "cpu" or target.startswith("cpu:"):
        n = int(target[len("cpu:") :]) if target != "cpu" else 8
        devices = jax.devices("cpu")[:n]
    elif target.startswith("tpu:"):
        devices = tpu_topology_devices(target[len("tpu:") :])
    else:
        raise ValueError(
            f"schedule target {target!r}: expected 'cpu', 'cpu:<devices>', 'tpu:<topology>' or "
            "'hlo:<dir>'"
        )
    kind = str(getattr(devices[0], "device_kind", ""))
    per_chip_devices = 2 if re.search(r"v[23]\b", kind) else 1
    per_device = max(1, per_chip_batch // per_chip_devices)
    cfg = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, batch_size=per_device * len(devices)),
        sharding=dataclasses.replace(config.sharding, params="replicated"),
    )
    reports: dict[str, ScheduleReport] = {}
    info: dict[str, Any] = {
        "target": target,
        "devices": len(devices),
        "device_kind": kind,
        "per_device_batch": per_device,
        "devices_per_chip": per_chip_devices,
        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "") if target != "cpu" else "",
        "programs": {},
    }
    for scheme in schemes:
        for name, compiled in compile_programs(cfg, devices, scheme).items():
            text = compiled.as_text()
            reports[name] = analyse_schedule(text)
            cost = compiled.cost_analysis() or {}
            if isinstance(cost, list | tuple):
                cost = cost[0] if cost else {}
            info["programs"][name] = {
                **reports[name].summary(),
                "xla_flops": float(cost.get("flops", 0.0)),
                "xla_estimated_seconds": float(cost.get("optimal_seconds", 0.0)),
            }
            if dump_dir is not None:
                Path(dump_dir).mkdir(parents=True, exist_ok=True)
                (Path(dump_dir) / f"{name}.hlo").write_text(text)
    if dump_dir is not None:
        (Path(dump_dir) / "info.json").write_text(json.dumps(info, indent=1))
    return reports, info


def _read_dumped(path: Path) -> tuple[dict[str, ScheduleReport], dict[str, Any]]:
    """The reports and info of programs written by `read_schedule` (``dump_dir``)."""
    if not (path / "info.json").is_file():
        raise FileNotFoundError(f"schedule hlo:{path}: no info.json (write it with dump_dir)")
    info = json.loads((path / "info.json").read_text())
    reports = {}
    for name in info["programs"]:
        reports[name] = analyse_schedule((path / f"{name}.hlo").read_text())
        info["programs"][name].update(reports[name].summary())  # read again, not trusted
    info["compiled_target"], info["target"] = info["target"], f"hlo:{path}"
    return reports, info


def tpu_topology_devices(name: str = "v3:4x4") -> list[Any]:
    """The devices of a deviceless TPU topology (``v3:4x4``: 16 chips, 32 TensorCores), for
    compiling with XLA's TPU compiler on a machine without TPUs (needs ``libtpu`` importable).
    """
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(platform="tpu", topology_name=name).devices)


def _abstract(config: TrainConfig, mesh: Mesh):
    tx_g, tx_d = make_optimizer(config.optim_g), make_optimizer(config.optim_d)
    g_def, d_def = graphdefs(config)
    ab = jax.eval_shape(init_train_state(config, tx_g, tx_d))
    sh = state_shardings(config, mesh, ab, g_def, d_def)
    layout = StateLayout(
        g_def, d_def, tx_g, tx_d, mesh, sh, NamedSharding(mesh, P(None, "data")), ab
    )
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), ab, sh)
    return state, layout


def compile_programs(config: TrainConfig, devices: Sequence[Any], scheme: str) -> dict[str, Any]:
    """A scheme's programs compiled data-parallel over `devices` (XLA executables).

    ``config.data.batch_size`` is the global batch of the devices given (each async group gets
    its half of the devices and of the batch, as a ``1:1`` split of `paragan_jax.async_scheme`).

    Returns:
      ``{"sync": compiled}`` or ``{"async-g": compiled, "async-d": compiled}``.
    """
    devices = list(devices)
    if scheme == "sync":
        mesh = Mesh(np.array(devices), ("data",))
        state, layout = _abstract(config, mesh)
        m = config.model
        batch = batch_struct(config, layout, (m.resolution, m.resolution, m.channels))
        return {"sync": make_sync_step(config, layout).lower(state, batch).compile()}
    if scheme != "async":
        raise ValueError(f"scheme must be 'sync' or 'async', got {scheme!r}")
    if len(devices) < 2:
        raise ValueError("the async scheme needs at least 2 devices (one per group)")
    half = len(devices) // 2
    out = {}
    for side, devs in (("async-g", devices[:half]), ("async-d", devices[half:])):
        mesh = Mesh(np.array(devs), ("data",))
        cfg = dataclasses.replace(
            config,
            data=dataclasses.replace(
                config.data, batch_size=config.data.batch_size * len(devs) // len(devices)
            ),
        )
        state, layout = _abstract(cfg, mesh)
        out[side] = _side_program(cfg, layout, state, side).compile()
    return out


def _side_program(config: TrainConfig, layout: StateLayout, state, side: str):
    """One async group's program, lowered: the pieces `paragan_jax.async_scheme` runs."""
    fns = GANFunctions.from_layout(config, layout)
    b, n_disc, mesh = config.data.batch_size, config.n_disc, layout.mesh
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "data"))
    if side == "async-d":
        m = config.model
        img = jax.ShapeDtypeStruct(
            (n_disc, b, m.resolution, m.resolution, m.channels), jnp.float32, sharding=rows
        )
        lab = jax.ShapeDtypeStruct((n_disc, b), jnp.int32, sharding=rows)

        def d_step(dp, ds, do, real, real_y, fake, fake_y):
            for i in range(n_disc):
                (dp, ds, do), _ = fns.d_update(dp, ds, do, real[i], real_y[i], fake[i], fake_y[i])
            return dp, ds, do

        return jax.jit(d_step, donate_argnums=(0, 1, 2)).lower(
            state.d_params, state.d_stats, state.d_opt, img, lab, img, lab
        )

    def g_step(gp, gs, go, dp, ds, rng, step):
        key = jax.random.fold_in(rng, step)
        (gp, gs, go), _ = fns.g_update(gp, gs, go, dp, ds, jax.random.fold_in(key, n_disc), b)
        nxt = jax.random.fold_in(rng, step + 1)
        fakes = [fns.fakes_for_d(gp, gs, jax.random.fold_in(nxt, i), b) for i in range(n_disc)]
        return gp, gs, go, jnp.stack([f[0] for f in fakes]), jnp.stack([f[1] for f in fakes])

    return jax.jit(g_step, donate_argnums=(0, 1, 2)).lower(
        state.g_params,
        state.g_stats,
        state.g_opt,
        state.d_params,
        state.d_stats,
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=rep),
        jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
    )
