"""The scaling model's check on this machine: predictions against multi-process CPU steps the
fit never saw.

`check_cpu` runs the real sync step data-parallel on 1, 2, 3, 4 processes (one CPU device each,
gloo collectives, via `paragan_jax.distributed.launch`) for two model widths, then
`fit_and_predict` fits on the first width at 1 and 2 processes only and predicts everything else:

- fitted on (width 0, 1 process): the step's achieved FLOP/s (XLA's FLOPs of the step over its
  median time), the cores one process keeps busy (CPU time per wall second) and the relative
  spread of its step time;
- fitted on (width 0, 2 processes): the per-hop latency of a collective inside the step (what
  is left of the 2-process step after compute, bytes and jitter, per latency hop);
- measured apart: gloo's bandwidth from a bare all-reduce (`tapas_jax.collectives.fit_alpha_beta`)
  and the collectives XLA compiled into each step
  (`tapas_jax.collectives.compiled_collective_terms`);
- predicted: 3 and 4 processes of width 0, and every process count of the other width (its
  compute from its own FLOPs at the fitted FLOP/s). Each row carries the machine's load average
  while it was measured.

Each process runs `worker` (the internal command ``python -m paragan_jax scaling-worker``).
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

from tapas_jax.collectives import compiled_collective_terms, fit_alpha_beta
from tapas_jax.mesh import make_mesh
from tapas_jax.verification import count_collectives

from .distributed import initialize, launch
from .loop import run_steps
from .scaling import expected_max_normal, load_model_config, measure_step_costs
from .steps import SyncRunner

__all__ = [
    "CPU_CHECK_OVERRIDES",
    "check_cpu",
    "fit_and_predict",
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
    pairs = [(w, n) for w in widths for n in counts]
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    runs: dict[tuple[int, int], tuple[SyncRunner, list[dict[str, np.ndarray]]]] = {}
    out: dict[str, Any] = {"counts": counts, "widths": widths, "collectives": {}}
    for w, n in pairs:
        key = f"{w}:{n}"
        if pid < n:
            b = args.per_process_batch
            cfg = _model(w, b * n)
            mesh = make_mesh(f"data={n}", devices=devices[:n])
            m = cfg.model
            runner = SyncRunner(
                cfg, mesh, (m.resolution, m.resolution, m.channels), local_batches=True
            )
            rng = np.random.default_rng(pid)
            images = rng.uniform(-1, 1, (cfg.n_disc, b, m.resolution, m.resolution, m.channels))
            labels = rng.integers(0, m.num_classes, (cfg.n_disc, b))
            # This process's share of each D update's batch (the loop stacks them per step).
            local = [
                {"image": images[i].astype(np.float32), "label": labels[i].astype(np.int32)}
                for i in range(cfg.n_disc)
            ]
            compiled = runner.compile()
            if pid == 0:
                c, moved = count_collectives(compiled.as_text(), n)
                out["collectives"][key] = {"count": c, "moved_bytes": moved}
            runs[(w, n)] = (runner, local)
        barrier(f"compiled-{key}")
        if pid < n:
            runner, local = runs[(w, n)]
            run_steps(runner, itertools.repeat(local), 1)  # warm-up
        barrier(f"warm-{key}")
    times: dict[str, list[float]] = {f"{w}:{n}": [] for w, n in pairs}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    load: dict[str, list[float]] = {k: [] for k in times}
    for r in range(args.rounds):
        for w, n in pairs:
            key = f"{w}:{n}"
            if pid < n:
                runner, local = runs[(w, n)]
                stats = run_steps(runner, itertools.repeat(local), args.steps, block_each_step=True)
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
    return 0


def run_processes(counts, widths, steps: int, rounds: int, batch: int) -> dict[str, Any]:
    """Launches the worker processes and returns process 0's measurements."""
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
    ]
    results = launch(
        extra,
        num_processes=max(counts),
        devices_per_process=1,
        timeout_s=1500,
        command="scaling-worker",
    )
    for line in results[0].stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"process 0 printed no result:\n{results[0].stdout[-2000:]}")


def step_flops(widths, batch: int) -> dict[str, float]:
    """XLA's FLOPs of one process's sync step per width (`measure_step_costs`)."""
    return {str(w): measure_step_costs(_model(w, batch), f"w{w}").sync_flops for w in widths}


def fit_and_predict(res: dict[str, Any], flops: dict[str, float], cores: int) -> dict[str, Any]:
    """Fits on (first width; 1 and 2 processes) and predicts every other measured pair.

    With three or more widths, the second width's 1-process step is fitted too, so that a step's
    time is ``fixed + FLOPs / rate`` (a per-step cost that does not grow with the model: op
    dispatch and small kernels, which dominate small models on a CPU) rather than ``FLOPs /
    rate`` alone; the remaining widths are then a model size the fit never saw. With two
    widths the fixed part is zero.

    Args:
      res: the workers' measurements (`run_processes`).
      flops: each width's step FLOPs per process (`step_flops`).
      cores: the machine's cores.

    Returns:
      ``rows`` (median steps) and ``rows_min`` (fastest steps, no jitter term), each row with its
      role, measured and predicted seconds, error, terms and load average; and the fit.
    """
    widths = [int(w) for w in res["widths"]]
    counts = sorted(int(n) for n in res["counts"])
    if counts[:2] != [1, 2] or len(counts) < 3:
        raise ValueError(f"processes {counts}: need 1 and 2 (the fit) and a larger count")
    w0 = widths[0]
    alpha_lone, bw = fit_alpha_beta({int(k): v for k, v in res["allreduce_s"].items()}, 2)
    base = np.array(res["step_times"][f"{w0}:1"])
    util = float(np.median(np.array(res["cpu_times"][f"{w0}:1"]) / base))
    q25, q75 = np.percentile(base, [25, 75])

    w1 = widths[1] if len(widths) >= 3 else None
    fitted = {(w0, 1), (w0, 2)} | ({(w1, 1)} if w1 is not None else set())

    def rows_for(stat, with_jitter: bool):
        t1 = float(stat(base))
        fixed = 0.0
        rate = flops[str(w0)] / t1  # achieved FLOP/s of one process
        if w1 is not None:
            t_w1 = float(stat(res["step_times"][f"{w1}:1"]))
            df = flops[str(w1)] - flops[str(w0)]
            if df != 0 and (t_w1 - t1) / df > 0:  # else no fixed part can be told apart
                rate = df / (t_w1 - t1)
                fixed = max(0.0, t1 - flops[str(w0)] / rate)
                rate = flops[str(w0)] / (t1 - fixed)
        jit_rel = float((q75 - q25) / 1.349 / np.median(base)) if with_jitter else 0.0
        terms = {}
        for w in widths:
            for n in counts:
                key = f"{w}:{n}"
                coll = res["collectives"].get(key, {"count": {}, "moved_bytes": {}})
                hops, sent = compiled_collective_terms(coll["count"], coll["moved_bytes"], n, n)
                compute = (fixed + flops[str(w)] / rate) * max(1.0, n * util / cores)
                jit = jit_rel * expected_max_normal(n) * compute
                measured = float(stat(res["step_times"][key]))
                terms[(w, n)] = (measured, compute, hops, sent, jit, coll)
        m2, c2, h2, s2, j2, _ = terms[(w0, 2)]
        alpha = max(1e-6, (m2 - c2 - s2 / bw - j2) / h2) if h2 else 1e-6
        rows = []
        for (w, n), (measured, compute, hops, sent, jit, coll) in terms.items():
            comm = hops * alpha + sent / bw
            pred = compute + comm + jit
            role = "prediction"
            if (w, n) in fitted:
                role = {
                    (w0, 1): "fits FLOP/s, cores, jitter",
                    (w0, 2): "fits per-hop latency",
                }.get((w, n), "fits fixed step cost")
            loads = res.get("load_average", {}).get(f"{w}:{n}", [])
            rows.append(
                {
                    "width": w,
                    "processes": n,
                    "role": role,
                    "measured_s": measured,
                    "predicted_s": pred,
                    "error": pred / measured - 1.0,
                    "compute_s": compute,
                    "collectives_s": comm,
                    "latency_hops": hops,
                    "bytes_sent": sent,
                    "jitter_s": jit,
                    "load_average": float(np.mean(loads)) if loads else None,
                    "collectives": coll["count"],
                }
            )
        return rows, alpha, rate, fixed

    rows, alpha, rate, fixed = rows_for(np.median, True)
    # Best case (fastest step of each pair, no jitter term): least touched by other jobs.
    rows_min, alpha_min, _, _ = rows_for(np.min, False)
    return {
        "rows": rows,
        "rows_min": rows_min,
        "fitted_width": w0,
        "fixed_step_s": fixed,
        "cores": cores,
        "cores_busy_1_process": util,
        "achieved_flops_per_s": rate,
        "alpha_s": alpha,
        "alpha_fastest_s": alpha_min,
        "alpha_lone_allreduce_s": alpha_lone,
        "bandwidth_Bps": bw,
        "step_flops": flops,
    }


def check_cpu(
    processes=(1, 2, 3, 4),
    steps: int = 5,
    rounds: int = 4,
    batch: int = 16,
    widths=(16, 32, 48),
    cores: int | None = None,
) -> dict[str, Any]:
    """Measures the sync step at `processes` x `widths` and checks `fit_and_predict` on it.

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
    load_before = os.getloadavg()
    res = run_processes(processes, tuple(widths), steps, rounds, batch)
    load_after = os.getloadavg()
    out = fit_and_predict(res, step_flops(widths, batch), cores)
    return {
        **out,
        "load_average": [load_before[0], load_after[0]],
        "load_average_1_5_15_after": list(load_after),
        "measurements": res,
    }


def main(argv: list[str]) -> int:
    """The internal command ``scaling-worker``: one process of the CPU check (`worker`)."""
    return worker(argv[1:])
