"""The scaling model's check on this machine: measured against predicted multi-process CPU steps.

`check_cpu` validates the composition of `paragan_jax.scaling`: N = 1, 2, 4 processes (one CPU
device each, gloo collectives, via `paragan_jax.distributed.launch`) run the real sync step
data-parallel; the prediction uses the 1-process step time, jitter and cores kept busy, the
collectives XLA compiled into each step priced per latency hop and per byte
(`tapas_jax.collectives.compiled_collective_terms`), gloo's bandwidth from a bare all-reduce
(`tapas_jax.collectives.fit_alpha_beta`), and a host-contention factor (processes share the
cores; on a TPU each chip computes on its own). The per-hop latency is calibrated on 2
processes; larger counts are predictions.

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

__all__ = ["CPU_CHECK_OVERRIDES", "check_cpu", "main", "worker"]

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


def worker(argv: list[str]) -> int:
    """One process of the CPU check: all process counts in one runtime, in interleaved rounds.

    Every process joins one runtime of ``--num-processes`` processes (one CPU device each). For
    each count n in ``--counts``, the first n processes build the sync step on a mesh of their n
    devices; in each round they run ``--steps`` steps for each n in turn while the others wait at
    a barrier, so every n sees the same drifting machine load. Steps run through the one step loop
    (`paragan_jax.loop.run_steps` of a `paragan_jax.steps.SyncRunner`, each step waited for and
    timed), like the trainer's. Process 0 also times a bare
    all-reduce between two processes at several sizes, and reports the compiled step's
    collectives (`tapas_jax.verification.count_collectives`) for each n.
    """
    ap = argparse.ArgumentParser(prog="python -m paragan_jax scaling-worker")
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
    devices = sorted(jax.devices(), key=lambda d: d.process_index)
    runs: dict[int, tuple[SyncRunner, list[dict[str, np.ndarray]]]] = {}
    out: dict[str, Any] = {"counts": counts, "collectives": {}, "step_times": {}}
    for n in counts:
        if pid < n:
            cfg = load_model_config("tiny", args.per_process_batch * n, CPU_CHECK_OVERRIDES)
            mesh = make_mesh(f"data={n}", devices=devices[:n])
            m, b = cfg.model, args.per_process_batch
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
                out["collectives"][str(n)] = {"count": c, "moved_bytes": moved}
            runs[n] = (runner, local)
        barrier(f"compiled-{n}")
        if pid < n:
            runner, local = runs[n]
            run_steps(runner, itertools.repeat(local), 1)  # warm-up
        barrier(f"warm-{n}")
    times: dict[int, list[float]] = {n: [] for n in counts}
    cpu: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in counts:
            if pid < n:
                runner, local = runs[n]
                stats = run_steps(runner, itertools.repeat(local), args.steps, block_each_step=True)
                times[n] += stats.step_times
                cpu[n] += stats.cpu_times
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
        command="scaling-worker",
    )
    for line in results[0].stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"process 0 printed no result:\n{results[0].stdout[-2000:]}")


def check_cpu(
    processes=(1, 2, 4), steps: int = 5, rounds: int = 4, batch: int = 16, cores: int | None = None
) -> dict[str, Any]:
    """Measured against predicted sync step time at 1, 2, 4 (or more) CPU processes.

    The model composes, for n processes on ``cores`` cores, the same terms as `predict`:

    - compute: the 1-process step time ``t1`` stretched by host contention
      ``max(1, n u1 / cores)``, where ``u1`` is the measured CPU time per wall second of the
      1-process step (how many cores one process keeps busy);
    - collectives: those XLA compiled into the n-process step (`compiled_collective_terms`), at one
      ``alpha`` per latency hop plus the bytes sent over gloo's bandwidth ``W``;
    - jitter: the 1-process step's relative spread times E[max of n normals].

    ``W`` comes from a bare all-reduce at three sizes. ``alpha`` does not: a collective inside
    the step is a rendezvous of processes that the OS schedules, and costs several times what a
    lone all-reduce shows (both are reported). So ``alpha`` is calibrated on the smallest
    multi-process count (2: ``alpha`` = the 2-process step's time left after compute, bytes
    and jitter, per hop), like ``t1`` is on 1 process; every larger count is a prediction, and
    only those rows (``role == "prediction"``) test the model.
    """
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
            hops, sent = compiled_collective_terms(coll["count"], coll["moved_bytes"], n, n)
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


def main(argv: list[str]) -> int:
    """The internal command ``scaling-worker``: one process of the CPU check (`worker`)."""
    return worker(argv[1:])
