"""Collective overlap read from a compiled train step's schedule, not assumed.

A compiled XLA module with ``is_scheduled=true`` lists each computation's instructions in the
order they run. `analyse_schedule` reads that text and, for every collective, finds:

- ``scheduled_share``: the compute (convolution and dot FLOPs, counted inside fusions and
  loops) that the schedule places between an asynchronous collective's ``*-start`` and its
  ``*-done``, as a share of the program's FLOPs: what the compiled program actually hides. A
  synchronous collective (the CPU backend emits only these) hides nothing.
- ``independent_share``: the compute that neither feeds the collective nor reads its result (the
  dependency graph of its computation): what any schedule could hide behind it. The difference
  is the overlap the compiler left on the table.

`hidden_fraction` turns either share into the hidden fraction of the collective time at a
target scale, given each collective's time there and the program's compute time.

`compile_programs` compiles the programs of each scheme for a mesh: the sync step
(`paragan_jax.steps.make_sync_step`) and the async scheme's two group programs (the D group's
``n_disc`` D updates, the G group's G update and next fakes, as in
`paragan_jax.async_scheme`), on abstract inputs, so it also works for a deviceless TPU
topology (`tpu_topology_devices`, needs ``libtpu`` importable; XLA's TPU latency-hiding
scheduler then decides the overlap) as well as for this machine's CPU devices.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tapas_jax.collectives import op_seconds
from tapas_jax.hardware import HardwareProfile, get_profile

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
    "CollectiveOp",
    "ScheduleReport",
    "analyse_schedule",
    "compile_programs",
    "hidden_fraction",
    "read_schedule",
    "scheme_overlap",
    "tpu_topology_devices",
]

_COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
    "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition)=%([^\s,}]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective of a compiled program and the compute around it."""

    name: str
    kind: str
    is_async: bool
    payload_bytes: float
    """Bytes of the collective's larger side (all-reduce: the reduced buffer)."""
    scheduled_share: float
    """FLOPs scheduled between start and done, as a share of the program's FLOPs."""
    independent_share: float
    """FLOPs independent of the collective (neither feed it nor read it), as a share."""


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """The collectives of one compiled program."""

    total_flops: float
    collectives: tuple[CollectiveOp, ...]

    def summary(self) -> dict[str, Any]:
        ops = self.collectives
        big = [c for c in ops if c.payload_bytes >= 1 << 16]  # gradient-sized (>= 64 KiB)
        return {
            "total_flops": self.total_flops,
            "collectives": len(ops),
            "async_collectives": sum(c.is_async for c in ops),
            "payload_bytes": sum(c.payload_bytes for c in ops),
            "large_collectives": len(big),
            "scheduled_share_mean_large": (
                float(np.mean([c.scheduled_share for c in big])) if big else 0.0
            ),
            "independent_share_mean_large": (
                float(np.mean([c.independent_share for c in big])) if big else 0.0
            ),
        }


def _arrays(type_text: str) -> list[tuple[str, list[int]]]:
    return [(d, [int(x) for x in dims.split(",") if x]) for d, dims in _ARRAY.findall(type_text)]


def _nbytes(type_text: str) -> float:
    return float(sum(_DTYPE_BYTES[d] * math.prod(s) for d, s in _arrays(type_text)))


def _split_type(rest: str) -> tuple[str, str]:
    """``TYPE opcode(...)...`` -> (TYPE, the rest from the opcode on)."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                return rest[: i + 1], rest[i + 1 :].lstrip()
    head, _, tail = rest.partition(" ")
    return head, tail


def _operands(text: str) -> tuple[str, str]:
    """``(a, b), attrs`` -> (``a, b``, ``attrs``)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return text[1:i], text[i + 1 :]
    return text[1:], ""


@dataclasses.dataclass
class _Instr:
    name: str
    type_text: str
    opcode: str
    operands: list[str]
    attrs: str
    called: list[str]


def _parse(text: str) -> dict[str, list[_Instr]]:
    comps: dict[str, list[_Instr]] = {}
    current: list[_Instr] | None = None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head:
            current = comps.setdefault(head.group(1), [])
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTR.match(line) if current is not None else None
        if not m:
            continue
        type_text, rest = _split_type(m.group(2))
        opcode, _, tail = rest.partition("(")
        ops_text, attrs = _operands("(" + tail)
        called = _CALLED.findall(attrs)
        for branches in _BRANCHES.findall(attrs):
            called += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
        names = re.findall(r"%([^\s,()]+)", ops_text)
        current.append(_Instr(m.group(1), type_text, opcode.strip(), names, attrs, called))
    return comps


def _own_flops(ins: _Instr, types: dict[str, str]) -> float:
    out = _arrays(ins.type_text)
    if not out or ins.opcode not in ("dot", "convolution") or len(ins.operands) < 2:
        return 0.0
    out_elems = math.prod(out[0][1])
    lhs = _arrays(types.get(ins.operands[0], ""))
    rhs = _arrays(types.get(ins.operands[1], ""))
    if ins.opcode == "dot":
        dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        if not lhs or not dims:
            return 0.0
        k = math.prod(lhs[0][1][int(i)] for i in dims.group(1).split(",") if i)
        return 2.0 * out_elems * k
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    if not rhs or not labels or "o" not in labels.group(1):
        return 0.0
    kernel = rhs[0][1]
    per_out = math.prod(kernel) / max(1, kernel[labels.group(1).index("o")])
    return 2.0 * out_elems * per_out


def _trip_count(ins: _Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m.group(1)) if m else 1


def analyse_schedule(text: str) -> ScheduleReport:
    """Collectives of a compiled (scheduled) HLO module and the compute that can hide them."""
    comps = _parse(text)
    memo: dict[str, float] = {}

    def comp_flops(name: str) -> float:
        if name not in memo:
            memo[name] = 0.0  # guards recursion
            memo[name] = sum(instr_flops(i, comps[name]) for i in comps.get(name, []))
        return memo[name]

    type_cache: dict[int, dict[str, str]] = {}

    def instr_flops(ins: _Instr, comp: list[_Instr]) -> float:
        types = type_cache.setdefault(id(comp), {i.name: i.type_text for i in comp})
        inner = sum(comp_flops(c) for c in ins.called)
        return _own_flops(ins, types) + inner * (_trip_count(ins) if ins.opcode == "while" else 1)

    entry = next((m.group(1) for m in re.finditer(r"^ENTRY\s+%([^\s(]+)", text, re.M)), None)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    total = comp_flops(entry)
    found: list[CollectiveOp] = []
    for comp in comps.values():
        index = {ins.name: i for i, ins in enumerate(comp)}
        preds = {ins.name: [o for o in ins.operands if o in index] for ins in comp}
        users: dict[str, list[str]] = {ins.name: [] for ins in comp}
        for ins in comp:
            for op in ins.operands:
                if op in users:
                    users[op].append(ins.name)
        cost = [instr_flops(ins, comp) for ins in comp]
        for pos, ins in enumerate(comp):
            kind, is_async, done_pos = _collective_kind(ins, comp, comps, users, index)
            if kind is None:
                continue
            done = comp[done_pos]
            before = _closure(ins.name, preds)
            after = _closure(done.name, users)
            tied = before | after | {ins.name, done.name}
            indep = sum(c for i, c in enumerate(cost) if comp[i].name not in tied)
            between = sum(cost[pos + 1 : done_pos]) if is_async else 0.0
            payload = max(
                _nbytes(done.type_text),
                sum(_nbytes(comp[index[o]].type_text) for o in ins.operands if o in index),
            )
            found.append(
                CollectiveOp(
                    ins.name,
                    kind,
                    is_async,
                    payload,
                    between / total if total else 0.0,
                    indep / total if total else 0.0,
                )
            )
    return ScheduleReport(total, tuple(found))


def _collective_kind(ins, comp, comps, users, index):
    """(kind, is_async, position of its done) of a collective instruction, else (None, ...)."""
    op = ins.opcode
    if op in _COLLECTIVES:
        return op, False, index[ins.name]
    if not op.endswith("-start"):
        return None, False, -1
    kind = op[: -len("-start")]
    if kind == "async":  # a generic async wrapper: the collective is in its called computation
        inner = [i.opcode for c in ins.called for i in comps.get(c, [])]
        kind = next((k for k in _COLLECTIVES if k in inner), None)
    if kind not in _COLLECTIVES:
        return None, False, -1
    dones = [u for u in users[ins.name] if comp[index[u]].opcode.endswith("-done")]
    return kind, True, index[dones[0]] if dones else index[ins.name]


def _closure(start: str, edges: dict[str, list[str]]) -> set[str]:
    """Every instruction reachable from `start` along `edges` (operands or users)."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in edges[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def hidden_fraction(
    report: ScheduleReport,
    collective_seconds: Callable[[CollectiveOp], float],
    compute_seconds: float,
    scheduled: bool = True,
) -> float:
    """Share of the program's collective time hidden behind its compute at a target scale.

    Each collective hides ``min(its time, share x compute_seconds)``, with ``share`` the compute
    scheduled inside it (``scheduled=True``: what the compiled program does) or independent of
    it (``False``: what a schedule could do).
    """
    times = [collective_seconds(c) for c in report.collectives]
    total = sum(times)
    if total <= 0:
        return 0.0
    hidden = sum(
        min(t, (c.scheduled_share if scheduled else c.independent_share) * compute_seconds)
        for c, t in zip(report.collectives, times)
    )
    return hidden / total


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
    config: TrainConfig, target: str, per_chip_batch: int, schemes=("sync", "async")
) -> tuple[dict[str, ScheduleReport], dict[str, Any]]:
    """Compiles each scheme's programs for `target` and reads their schedules.

    Args:
      config: the model's `TrainConfig` (its batch is replaced).
      target: ``cpu`` (this machine's devices, up to 8) or ``tpu:<topology>``
        (``tpu:v3:4x4``: a deviceless TPU topology, XLA's TPU latency-hiding scheduler).
      per_chip_batch: examples per chip (a TPU v2/v3 chip is two devices, each gets half).

    Returns:
      ``(reports, info)``: a `ScheduleReport` per program, and the target, devices, XLA's
      cost-model estimate of each program's seconds where the backend gives one, and its FLOPs.
    """
    if target == "cpu":
        devices = jax.devices("cpu")[:8]
    elif target.startswith("tpu:"):
        devices = tpu_topology_devices(target[len("tpu:") :])
    else:
        raise ValueError(f"schedule target {target!r}: expected 'cpu' or 'tpu:<topology>'")
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
        "programs": {},
    }
    for scheme in schemes:
        for name, compiled in compile_programs(cfg, devices, scheme).items():
            reports[name] = analyse_schedule(compiled.as_text())
            cost = compiled.cost_analysis() or {}
            if isinstance(cost, list | tuple):
                cost = cost[0] if cost else {}
            info["programs"][name] = {
                **reports[name].summary(),
                "xla_flops": float(cost.get("flops", 0.0)),
                "xla_estimated_seconds": float(cost.get("optimal_seconds", 0.0)),
            }
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
