"""``python -m paragan_jax bench-pipeline`` and ``python -m paragan_jax scaling``.

bench-pipeline: input-bound training throughput (steps/s) of a fixed and of the adaptive input
pipeline, on a clean and on a congested store. The store is the seeded remote-store EMULATION
(`paragan_jax.storage.EmulatedRemoteStorage`) in front of real ``.npy`` files written to a
temporary directory; the step is a real jitted discriminator update. The fixed pipeline is sized
as a user would size it for the clean store (Little's law on the measured step time and clean
latency, with 100% headroom); the adaptive one starts from the same setting. Because this CPU
is shared and its speed drifts, each step is held to a fixed period (``--step-ms``, default 40 ms,
as a TPU's steady step time would be; the real jitted step runs inside it), and short rounds of
the four runs are interleaved.

scaling: predicted step time and scaling efficiency of the sync and async schemes at several chip
counts (`paragan_jax.scaling`), optionally checked against measured 1/2/4-process CPU runs.

train-multihost (``python -m paragan_jax.scale_cli train-multihost ...``, used by
``scripts/tpu_run.sh``): `jax.distributed.initialize()` on a TPU VM worker, then ``train``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["main"]


def _bench_step(resolution: int, batch: int):
    """A jitted discriminator update (conv stem, two strided convs, hinge loss, SGD)."""
    import jax
    import jax.numpy as jnp

    from .layout import choose_layout, stem_conv

    plan = choose_layout()
    keys = jax.random.split(jax.random.key(0), 4)
    params = {
        "stem": jax.random.normal(keys[0], (3, 3, 3, 16)) * 0.1,
        "c1": jax.random.normal(keys[1], (3, 3, 16, 32)) * 0.05,
        "c2": jax.random.normal(keys[2], (3, 3, 32, 32)) * 0.05,
        "head": jax.random.normal(keys[3], (32, 10)) * 0.05,
    }

    def loss(p, images, labels):
        x = images.astype(jnp.float32) / 127.5 - 1.0
        h = jax.nn.relu(stem_conv(x, p["stem"], plan, stride=2))
        for name in ("c1", "c2"):
            h = jax.nn.relu(
                jax.lax.conv_general_dilated(
                    h, p[name], (2, 2), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
                )
            )
        logits = h.mean(axis=(1, 2)) @ p["head"]
        score = jnp.take_along_axis(logits, labels[:, None] % 10, axis=1)
        return jnp.mean(jax.nn.relu(1.0 - score))

    @jax.jit
    def step(p, images, labels):
        value, grads = jax.value_and_grad(loss)(p, images, labels)
        return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads), value

    images = jnp.zeros((batch, resolution, resolution, 3), jnp.uint8)
    labels = jnp.zeros((batch,), jnp.int32)
    params, v = step(params, images, labels)  # compile
    v.block_until_ready()
    return step, params


def _time_step(step, params, batch: int, resolution: int, n: int = 20) -> float:
    import jax.numpy as jnp

    images = jnp.zeros((batch, resolution, resolution, 3), jnp.uint8)
    labels = jnp.zeros((batch,), jnp.int32)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        params, v = step(params, images, labels)
        v.block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _pad_step(t0: float, step_ms: float) -> None:
    """Holds the step to a fixed period, like an accelerator with a steady step time."""
    if step_ms > 0:
        left = step_ms / 1e3 - (time.perf_counter() - t0)
        if left > 0:
            time.sleep(left)


def _merge_runs(runs: list[dict]) -> dict:
    steps = sum(r["steps"] for r in runs)
    wall = sum(r["wall_s"] for r in runs)
    merged = {
        "steps_per_s": steps / wall,
        "steps": steps,
        "wall_s": wall,
        "input_wait_fraction": sum(r["input_wait_fraction"] * r["wall_s"] for r in runs) / wall,
        "peak_buffer_bytes": max(r["peak_buffer_bytes"] for r in runs),
        "mean_workers": float(np.mean([r["mean_workers"] for r in runs])),
        "max_workers": max(r["max_workers"] for r in runs),
        "max_depth": max(r["max_depth"] for r in runs),
        "fetch_p50_s": float(np.median([r["fetch_p50_s"] for r in runs])),
        "fetch_p95_s": float(np.median([r["fetch_p95_s"] for r in runs])),
        "congested_time_fraction": sum(r["congested_time_fraction"] * r["wall_s"] for r in runs)
        / wall,
        "rounds_steps_per_s": [r["steps_per_s"] for r in runs],
        "trace": runs[-1]["trace"],
    }
    return merged


def _run_pipeline(
    args, storage, pipe_cfg, step, params, steps: int, congested: bool, round_: int = 0
) -> dict:
    import jax.numpy as jnp

    from .pipeline import InputPipeline
    from .storage import CongestionEpisodes

    horizon = 600.0
    storage.episodes = (
        CongestionEpisodes.seeded(
            args.seed + round_, horizon, args.mean_clean_s, args.mean_congested_s
        )
        if congested
        else None
    )
    pipe = InputPipeline(storage, pipe_cfg, process_index=0, process_count=1)
    batches = pipe.batches()
    for _ in range(args.warmup):  # fill the pipeline on a clean store; not timed
        b = next(batches)
        t_step = time.perf_counter()
        params, v = step(params, jnp.asarray(b["image"]), jnp.asarray(b["label"]))
        v.block_until_ready()
        _pad_step(t_step, args.step_ms)
    storage.start()
    wait0, trace0 = pipe.total_wait_s, len(pipe.trace)
    t0 = time.perf_counter()
    v = None
    for _ in range(steps):
        b = next(batches)
        t_step = time.perf_counter()
        params, v = step(params, jnp.asarray(b["image"]), jnp.asarray(b["label"]))
        # Wait for the step, as a loop that logs its loss does: the time then spent in next()
        # is time the device had no input, which is the signal the controller needs.
        v.block_until_ready()
        _pad_step(t_step, args.step_ms)
    wall = time.perf_counter() - t0
    batches.close()
    lat = storage.stats.summary()
    trace = pipe.trace[trace0:]
    workers = [t["workers"] for t in trace] or [pipe.controller.workers]
    depths = [t["depth"] for t in trace] or [pipe.controller.depth]
    frac = storage.episodes.congested_fraction(wall) if storage.episodes else 0.0
    return {
        "steps_per_s": steps / wall,
        "steps": steps,
        "wall_s": wall,
        "input_wait_fraction": (pipe.total_wait_s - wait0) / wall,
        "peak_buffer_bytes": pipe.peak_buffer_bytes,
        "mean_workers": float(np.mean(workers)),
        "max_workers": int(max(workers)),
        "max_depth": int(max(depths)),
        "final_workers": pipe.controller.workers,
        "final_depth": pipe.controller.depth,
        "fetch_p50_s": lat["p50_s"],
        "fetch_p95_s": lat["p95_s"],
        "congested_time_fraction": frac,
        "trace": trace,
    }


def bench_pipeline(argv: list[str]) -> int:
    """Fixed against adaptive pipeline, clean against congested (emulated) store."""
    ap = argparse.ArgumentParser(prog="python -m paragan_jax bench-pipeline")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--png", type=Path, help="plot the adaptive controller's trace here")
    ap.add_argument("--steps", type=int, default=180, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps before each run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the 4 runs")
    ap.add_argument(
        "--step-ms",
        type=float,
        default=40.0,
        help="hold each step to this period (a steady accelerator); 0: the bare CPU step",
    )
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--resolution", type=int, default=32)
    ap.add_argument("--examples", type=int, default=4096, help="data set size")
    ap.add_argument("--base-latency-ms", type=float, default=3.0, help="clean fetch latency")
    ap.add_argument("--congestion-factor", type=float, default=5.0)
    ap.add_argument("--mean-clean-s", type=float, default=0.3, help="mean clean episode")
    ap.add_argument("--mean-congested-s", type=float, default=3.0, help="mean congested episode")
    ap.add_argument("--memory-cap-mib", type=float, default=8.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv[1:])
    if args.steps < 10 or args.batch_size < 1 or args.examples < args.batch_size:
        ap.error("need --steps >= 10, --batch-size >= 1 and --examples >= --batch-size")
    if args.rounds < 1:
        ap.error("need --rounds >= 1")

    from .pipeline import PipelineConfig
    from .storage import EmulatedRemoteStorage, LocalArrayStorage, write_local_dataset

    rng = np.random.default_rng(args.seed)
    r = args.resolution
    step, params = _bench_step(r, args.batch_size)
    bare_step_s = _time_step(step, params, args.batch_size, r)
    step_s = max(bare_step_s, args.step_ms / 1e3)
    with tempfile.TemporaryDirectory(prefix="paragan-bench-") as tmp:
        write_local_dataset(
            tmp,
            {
                "image": rng.integers(0, 256, (args.examples, r, r, 3), dtype=np.uint8),
                "label": rng.integers(0, 10, (args.examples,), dtype=np.int32),
            },
        )
        local = LocalArrayStorage(tmp)
        base = args.base_latency_ms / 1e3
        storage = EmulatedRemoteStorage(
            local,
            seed=args.seed,
            base_latency_s=base,
            congestion_factor=args.congestion_factor,
        )
        clean_latency = base + local.example_nbytes() / storage.bandwidth
        need = args.batch_size / step_s * clean_latency
        # Tuned generously for the clean store: twice the Little's-law concurrency.
        fixed_workers = max(1, math.ceil(need * 2.0))
        cap = int(args.memory_cap_mib * 2**20)
        common = dict(
            batch_size=args.batch_size,
            num_workers=fixed_workers,
            prefetch_depth=2,
            memory_cap_bytes=cap,
            seed=args.seed,
        )
        configs = [
            ("clean_fixed", False, False),
            ("clean_adaptive", True, False),
            ("congested_fixed", False, True),
            ("congested_adaptive", True, True),
        ]
        # Interleave short rounds of the four configurations, so that the load of a shared
        # machine drifting over the run affects all four alike.
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
        per_round = max(10, args.steps // args.rounds)
        for r_i in range(args.rounds):
            for name, adaptive, congested in configs:
                cfg = PipelineConfig(adaptive=adaptive, **common)
                runs[name].append(
                    _run_pipeline(args, storage, cfg, step, params, per_round, congested, r_i)
                )
        results = {name: _merge_runs(rs) for name, rs in runs.items()}
    out = {k: v["steps_per_s"] for k, v in results.items()}
    out["peak_buffer_bytes"] = max(v["peak_buffer_bytes"] for v in results.values())
    out["memory_cap_bytes"] = cap
    out["fixed_retained"] = out["congested_fixed"] / out["clean_fixed"]
    out["adaptive_retained"] = out["congested_adaptive"] / out["clean_adaptive"]
    out["compute_only_steps_per_s"] = 1.0 / step_s
    out["bare_cpu_step_s"] = bare_step_s
    out["fixed_workers"] = fixed_workers
    out["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out["storage"] = "EMULATED remote store (seeded latency model) over local .npy files"
    out["details"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "trace"} for k, v in results.items()
    }
    out["adaptive_trace"] = results["congested_adaptive"]["trace"]

    print(
        f"bare CPU step {1e3 * bare_step_s:.1f} ms, held to {1e3 * step_s:.1f} ms "
        f"({1 / step_s:.1f} steps/s); fixed pipeline: {fixed_workers} workers, depth 2"
    )
    print(f"{'config':<20} {'steps/s':>8} {'wait%':>6} {'workers':>8} {'depth':>6} {'peak MiB':>9}")
    for k, v in results.items():
        print(
            f"{k:<20} {v['steps_per_s']:8.1f} {100 * v['input_wait_fraction']:6.1f} "
            f"{v['mean_workers']:8.1f} {v['max_depth']:6d} {v['peak_buffer_bytes'] / 2**20:9.2f}"
        )
    print(
        f"retained under congestion: fixed {out['fixed_retained']:.0%}, "
        f"adaptive {out['adaptive_retained']:.0%} (cap {cap / 2**20:.1f} MiB, "
        f"peak {out['peak_buffer_bytes'] / 2**20:.2f} MiB)"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    if args.png:
        _plot_trace(results["congested_adaptive"]["trace"], args.png)
    return 0


def _plot_trace(trace: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [t["step"] for t in trace]
    fig, ax = plt.subplots(3, 1, figsize=(7, 6), sharex=True)
    ax[0].plot(steps, [1e3 * t["fetch_latency_s"] for t in trace])
    ax[0].set_ylabel("fetch ms")
    ax[1].plot(steps, [t["workers"] for t in trace], label="workers")
    ax[1].plot(steps, [t["depth"] for t in trace], label="depth")
    ax[1].legend()
    ax[2].plot(steps, [t["wait_frac"] for t in trace])
    ax[2].set_ylabel("input wait")
    ax[2].set_xlabel("step")
    fig.suptitle("adaptive pipeline under emulated congestion")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def train_multihost(argv: list[str]) -> int:
    """``python -m paragan_jax.scale_cli train-multihost <train args>`` on every TPU VM worker.

    Joins the slice's JAX runtime (`jax.distributed.initialize()` with no arguments: on a TPU VM
    the runtime supplies coordinator, process count and index), then runs the ordinary
    ``paragan_jax train`` command with the remaining arguments. `scripts/tpu_run.sh` calls this.
    """
    import jax

    jax.distributed.initialize()
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local "
        f"of {jax.device_count()} devices ({jax.devices()[0].device_kind})",
        flush=True,
    )
    from .cli import main as cli_main

    return int(cli_main(["train", *argv[1:]]) or 0)


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the command name."""
    if not argv:
        print("usage: python -m paragan_jax {bench-pipeline|scaling} ...", file=sys.stderr)
        return 2
    if argv[0] == "bench-pipeline":
        return bench_pipeline(argv)
    if argv[0] == "scaling":
        from .scaling import scaling_command

        return scaling_command(argv)
    if argv[0] == "train-multihost":
        return train_multihost(argv)
    print(f"paragan_jax.scale_cli: unknown command {argv[0]!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
