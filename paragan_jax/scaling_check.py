"""The scaling model's check on this machine: predictions against multi-process CPU steps the
fit never saw.

`check_cpu` runs the real sync step data-parallel on 1, 2, 3, 4 processes (one CPU device each,
gloo collectives, via `paragan_jax.distributed.launch`) for several model widths, and the async
scheme with a G group and a D group of processes (`paragan_jax.process_groups`) at 2 processes
and up, split by FLOPs with `paragan_jax.scaling.group_split` (G's update runs D forward and
backward too, so this model's G group is the larger: 1 G + 1 D, 2 + 1, and 2 + 2, the split
nearest 3 + 1 that divides the batch).
`paragan_jax.scaling_fit.fit_and_predict` then fits on 1 and 2 processes only and predicts
everything else:

- fitted on (width 0, 1 process): the step's achieved FLOP/s (XLA's FLOPs of the step over its
  median time), the cores one process keeps busy (CPU time per wall second) and the relative
  spread of its step time; with three widths, (width 1, 1 process) separates a fixed per-step
  cost from the FLOP rate;
- fitted on (widths 0 and 1, 2 processes; width 0 alone with two widths): the per-hop latency
  of a collective inside the step (what is left of the 2-process steps after compute, bytes and
  jitter, per latency hop), and for the async scheme, at width 0, the exchange's host cost
  (what is left of the 1 G + 1 D iteration, whose two groups share the cores);
- measured apart: gloo's bandwidth from a bare all-reduce (`tapas_jax.collectives.fit_alpha_beta`)
  and the collectives XLA compiled into each program
  (`tapas_jax.collectives.compiled_collective_terms`);
- predicted: 3 and 4 processes of both schemes, and every process count of the other widths
  (their compute from their own FLOPs at the fitted rate). Each row carries the machine's load
  average while it was measured.

Each process runs `worker` (the internal command ``python -m paragan_jax scaling-worker``).
The fit and the predictions are `paragan_jax.scaling_fit` (NumPy on the recorded measurements).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from tapas_jax.mesh import make_mesh
from tapas_jax.verification import count_collectives

from .distributed import initialize, launch
from .loop import run_steps
from .process_groups import GroupAsyncRunner
from .scaling import group_split, load_model_config, measure_step_costs
from .scaling_fit import fit_and_predict
from .steps import SyncRunner

__all__ = [
    "CPU_CHECK_OVERRIDES",
    "async_plan",
    "check_cpu",
    "main",
    "run_processes",
    "step_flops",
    "worker",
]

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


def _model(width: int, batch: int):
    """The check's model at `width` (G and D) and per-process `batch`."""
    return load_model_config(
        "tiny", batch, [*CPU_CHECK_OVERRIDES, f"model.g_width={width}", f"model.d_width={width}"]
    )


def pair_key(scheme: str, width: int, processes: int) -> str:
    """The key of one measured pair: ``32:4`` (sync, width 32, 4 processes), ``async:32:4``."""
    return f"{width}:{processes}" if scheme == "sync" else f"{scheme}:{width}:{processes}"


def _build(scheme: str, w: int, n: int, n_g: int | None, devices, args):
    """One pair's runner on the first `n` processes and its batches.

    Returns:
      ``(runner, batches)``: the runner and an endless iterator of this process's ``n_disc``
      loader batches per step (none for an async G process).
    """
    pid, b = jax.process_index(), args.per_process_batch
    cfg = _model(w, b * n)  # the global batch grows with the processes (weak scaling)
    m = cfg.model
    shape = (m.resolution, m.resolution, m.channels)
    if scheme == "sync":
        runner = SyncRunner(
            cfg, make_mesh(f"data={n}", devices=devices[:n]), shape, local_batches=True
        )
        runner.compile()
        local_batch = b
    else:
        runner = GroupAsyncRunner(cfg, devices[:n], n_g, shape)
        local_batch = 0 if runner.is_g else b * n // (n - n_g)
    rng = np.random.default_rng(pid)
    images = rng.uniform(-1, 1, (cfg.n_disc, local_batch, *shape)).astype(np.float32)
    labels = rng.integers(0, m.num_classes, (cfg.n_disc, local_batch)).astype(np.int32)
    # This process's share of each D update's batch (the loop stacks them per step).
    local = [{"image": images[i], "label": labels[i]} for i in range(cfg.n_disc)]
    return runner, itertools.repeat(local if local_batch else [])


def _programs(runner, n: int) -> dict[str, tuple[str, int]]:
    """``{name: (compiled HLO text, devices)}`` of the programs this process ran: the sync step;
    or its async group's step and each exchange compiled so far (``exchange``, and
    ``exchange_snapshot`` when D's params rode along)."""
    if isinstance(runner, SyncRunner):
        return {"": (runner.compile().as_text(), n)}
    side = ("g", runner.n_g) if runner.is_g else ("d", runner.n_d)
    out = {side[0]: (runner.side.step.as_text(), side[1])}
    for with_snapshot, compiled in runner.exchanges.items():
        out["exchange_snapshot" if with_snapshot else "exchange"] = (compiled.as_text(), n)
    return out


def worker(argv: list[str]) -> int:
    """One process of the CPU check: all (width, process count) pairs in one runtime.

    Every process joins one runtime of ``--num-processes`` processes (one CPU device each). For
    each width and count n in ``--counts``, the first n processes build the sync step on a mesh
    of their n devices; in each round they run ``--steps`` steps for each pair in turn while
    the others wait at a barrier, so every pair sees the same drifting machine load. Steps run
    through the one step loop (`paragan_jax.loop.run_steps` of a `paragan_jax.steps.SyncRunner`,
    each step waited for and timed), like the trainer's. Process 0 records the load average
    after each pair's steps, times a bare all-reduce between two processes at several sizes, and
    reports each compiled step's collectives (`tapas_jax.verification.count_collectives`).
    """
    ap = argparse.ArgumentParser(prog="python -m paragan_jax scaling-worker")
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--counts", default="1,2,3,4")
    ap.add_argument("--widths", default="32,48")
    ap.add_argument("--per-process-batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--allreduce-sizes", default="4096,1048576,4194304")
    ap.add_argument(
        "--async-splits",
        default="",
        help="width:processes:G processes of each async pair to run, comma separated",
    )
    args = ap.parse_args(argv)
    # Single-threaded Eigen kernels, so that a process keeps about one core busy; the check
    # measures how many it does (CPU time per wall second) rather than assuming it.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false"
    )
    initialize(args.process_id, args.num_processes, args.port)

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
    widths = [int(w) for w in args.widths.split(",")]
    splits = {}  # (width, processes) -> G processes of the async scheme
    for item in filter(None, args.async_splits.split(",")):
        w, n, n_g = (int(v) for v in item.split(":"))
        splits[(w, n)] = n_g
    pairs = [("sync", w, n) for w in widths for n in counts]
    pairs += [("async", w, n) for w in widths for n in counts if (w, n) in splits]
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    runs: dict[str, tuple[Any, Any]] = {}
    out: dict[str, Any] = {"counts": counts, "widths": widths, "collectives": {}}
    out["async_splits"] = {f"{w}:{n}": g for (w, n), g in splits.items()}
    out["staleness"] = _model(widths[0], args.per_process_batch).async_.staleness
    for scheme, w, n in pairs:
        key = pair_key(scheme, w, n)
        if pid < n:
            runs[key] = _build(scheme, w, n, splits.get((w, n)), devices, args)
        barrier(f"compiled-{key}")
        if pid < n:
            runner, batches = runs[key]
            run_steps(runner, batches, 1)  # warm-up (compiles an async exchange too)
            if pid == 0 or (scheme == "async" and pid == splits[(w, n)]):
                for name, (text, p) in _programs(runner, n).items():  # G's from 0, D's from n_g
                    c, moved = count_collectives(text, p)
                    out["collectives"][f"{key}:{name}" if name else key] = {
                        "count": c,
                        "moved_bytes": moved,
                        "devices": p,
                    }
        barrier(f"warm-{key}")
    times: dict[str, list[float]] = {pair_key(*p): [] for p in pairs}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    load: dict[str, list[float]] = {k: [] for k in times}
    for r in range(args.rounds):
        for scheme, w, n in pairs:
            key = pair_key(scheme, w, n)
            if pid < n:
                runner, batches = runs[key]
                stats = run_steps(runner, batches, args.steps, block_each_step=True)
                times[key] += stats.step_times
                cpu[key] += stats.cpu_times
                load[key].append(os.getloadavg()[0])
            barrier(f"round-{r}-{key}")
    out["step_times"], out["cpu_times"], out["load_average"] = times, cpu, load
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
    elif out["collectives"]:  # the D group's programs, read by its first process
        print("COLLECTIVES " + json.dumps(out["collectives"]), flush=True)
    return 0


def run_processes(
    counts, widths, steps: int, rounds: int, batch: int, async_splits=None
) -> dict[str, Any]:
    """Launches the worker processes and returns their measurements (process 0's, with the
    D group's compiled collectives read by its first process).

    Args:
      async_splits: ``{(width, processes): G processes}`` of the async pairs to run too.
    """
    splits = ",".join(f"{w}:{n}:{g}" for (w, n), g in (async_splits or {}).items())
    extra = [
        "--counts",
        ",".join(map(str, counts)),
        "--widths",
        ",".join(map(str, widths)),
        "--steps",
        str(steps),
        "--rounds",
        str(rounds),
        "--per-process-batch",
        str(batch),
        "--async-splits",
        splits,
    ]
    results = launch(
        extra,
        num_processes=max(counts),
        devices_per_process=1,
        timeout_s=2400,
        command="scaling-worker",
    )
    out = None
    for line in results[0].stdout.splitlines():
        if line.startswith("RESULT "):
            out = json.loads(line[len("RESULT ") :])
    if out is None:
        raise RuntimeError(f"process 0 printed no result:\n{results[0].stdout[-2000:]}")
    for r in results[1:]:
        for line in r.stdout.splitlines():
            if line.startswith("COLLECTIVES "):
                out["collectives"].update(json.loads(line[len("COLLECTIVES ") :]))
    return out


def step_flops(widths, batch: int) -> dict[str, float]:
    """XLA's FLOPs of one process's sync step per width (`measure_step_costs`)."""
    return {str(w): measure_step_costs(_model(w, batch), f"w{w}").sync_flops for w in widths}


def async_plan(widths, counts, batch: int) -> tuple[dict[tuple[int, int], int], dict[str, Any]]:
    """The async pairs of the check: each (width, processes >= 2) split into G and D groups by
    their FLOPs (`group_split`), and XLA's FLOPs of each group's step per process.

    Returns:
      ``(splits, flops)``: ``{(width, processes): G processes}`` and ``{"width:processes":
      {"g": FLOPs, "d": FLOPs, "g_processes": n_g}}`` (G: its update and the fakes for D at
      its share of the global batch; D: ``n_disc`` updates at its share).
    """
    cache: dict[tuple[int, int], Any] = {}

    def costs(w: int, b: int):
        if (w, b) not in cache:
            cache[(w, b)] = measure_step_costs(_model(w, b), f"w{w}")
        return cache[(w, b)]

    splits, flops = {}, {}
    for w in widths:
        c = costs(w, batch)
        share = c.g_side_flops / (c.g_side_flops + c.d_side_flops)
        for n in counts:
            if n < 2:
                continue
            n_g, n_d = group_split(n, share, batch * n)
            splits[(w, n)] = n_g
            flops[f"{w}:{n}"] = {
                "g": costs(w, batch * n // n_g).g_side_flops,
                "d": costs(w, batch * n // n_d).d_side_flops,
                "g_processes": n_g,
            }
    return splits, flops


def check_cpu(
    processes=(1, 2, 3, 4),
    steps: int = 5,
    rounds: int = 4,
    batch: int = 16,
    widths=(16, 32, 48),
    cores: int | None = None,
    schemes=("sync", "async"),
) -> dict[str, Any]:
    """Measures the sync step at `processes` x `widths` (and, with ``async`` in `schemes`, the
    async scheme at every count >= 2: `GroupAsyncRunner`) and checks
    `paragan_jax.scaling_fit.fit_and_predict` on it.

    Returns:
      `fit_and_predict`'s result plus the raw measurements and the load average before and
      after.
    """
    processes = tuple(sorted(set(processes)))
    if processes[:2] != (1, 2) or len(processes) < 3:
        raise ValueError(
            f"processes {processes}: need 1 and 2 (calibration) and at least one larger count"
        )
    cores = cores or os.cpu_count() or 1
    splits, async_flops = async_plan(widths, processes, batch) if "async" in schemes else ({}, None)
    load_before = os.getloadavg()
    res = run_processes(processes, tuple(widths), steps, rounds, batch, splits)
    load_after = os.getloadavg()
    out = fit_and_predict(res, step_flops(widths, batch), cores, async_flops)
    return {
        **out,
        "load_average": [load_before[0], load_after[0]],
        "load_average_1_5_15_after": list(load_after),
        "measurements": res,
    }


def main(argv: list[str]) -> int:
    """The internal command ``scaling-worker``: one process of the CPU check (`worker`)."""
    return worker(argv[1:])
