"""``python -m paragan_jax bench-pipeline``: fixed against adaptive input pipeline, clean against
congested store.

Input-bound training throughput (steps/s) of a fixed and of the adaptive input pipeline
(`paragan_jax.pipeline`), on a clean and on a congested store. Two stores (``store``):

- ``emulated``: the seeded remote-store EMULATION (`paragan_jax.storage.EmulatedRemoteStorage`)
  in front of real ``.npy`` files written to a temporary directory;
- ``http``: a real socket path. The data set is written in the sharded uint8 format
  (`paragan_jax.shards`), served by the loopback object server from a process of its own
  (`paragan_jax.http_store`:
  aggregate bandwidth shared by all connections, per-request latency with jitter, congestion
  episodes that multiply latency and leave only a share of the bandwidth), and read through
  tensorstore's HTTP kvstore. Besides the four runs it sweeps fixed settings (workers x depth)
  under the same congestion; ``best_fixed_congested`` is the best of them, the honest baseline
  (the ``congested_fixed`` run keeps the old sizing for comparison).

The step is a real jitted discriminator update that casts the uint8 images on the device. The
fixed pipeline is sized as a user would size it for the clean store (Little's law on the measured
step time and clean latency, with 100% headroom); the adaptive one starts from the same setting.
Because this CPU is shared and its speed drifts, each step is held to a fixed period
(``step_ms``, default 40 ms, as a TPU's steady step time would be; the real jitted step runs
inside it), and short rounds of the four runs are interleaved. Steps run through the one step
loop (`paragan_jax.loop.run_steps`, with the step as a `HeldStepRunner`).

Settings are `BenchPipelineCommand`; its ``pipeline`` section is a `PipelineConfig` (YAML and
``pipeline.<key>=value`` overrides like any other; the bench sets ``adaptive`` and
``num_workers`` per run).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from matplotlib.figure import Figure

from tapas_jax.commands import write_json

from .command_config import command_config_parser, load_command_config
from .http_store import CongestionModel
from .layout import choose_layout, stem_conv
from .loop import grouped, run_steps
from .pipeline import InputPipeline
from .pipeline_control import PipelineConfig
from .pipeline_stores import RunCongestion, fixed_sweep, serve_shards
from .storage import (
    CongestionEpisodes,
    EmulatedRemoteStorage,
    LocalArrayStorage,
    write_local_dataset,
)

__all__ = ["BenchPipelineCommand", "HeldStepRunner", "bench_pipeline", "main"]


@dataclasses.dataclass(frozen=True)
class BenchPipelineCommand:
    """Settings of ``python -m paragan_jax bench-pipeline``."""

    store: str = "emulated"
    """``emulated`` (latency model, no sockets) or ``http`` (loopback object server)."""
    steps: int = 180
    """Timed steps per configuration (over all rounds)."""
    warmup: int = 10
    """Untimed steps before each run."""
    rounds: int = 3
    """Interleaved rounds of the four runs."""
    step_ms: float = 40.0
    """Hold each step to this period (a steady accelerator); 0: the bare CPU step."""
    resolution: int = 32
    """Image side of the data set and the step."""
    examples: int = 4096
    """Data set size."""
    base_latency_ms: float = 3.0
    """Clean fetch latency of the store."""
    congestion_factor: float = 5.0
    """Latency multiplier of the store while congested."""
    mean_clean_s: float = 0.3
    """Mean clean episode of the store."""
    mean_congested_s: float = 3.0
    """Mean congested episode of the store."""
    bandwidth_mb_s: float = 40.0
    """http: aggregate bandwidth of the server (MB/s), shared by all connections."""
    bandwidth_share: float = 0.3
    """http: share of that bandwidth left while congested."""
    jitter_sigma: float = 0.25
    """http: log-normal shape of the per-request latency."""
    sweep_workers: list[float] = dataclasses.field(default_factory=lambda: [1.0, 2.0, 4.0, 8.0])
    """http: fixed settings swept under congestion, as multiples of the fixed run's workers;
    each at the depth that keeps them busy and at twice it."""
    seed: int = 0
    """Seed of the data set, the emulated store and its congestion episodes."""
    json: str | None = None
    """Write the results here."""
    png: str | None = None
    """Plot the adaptive controller's trace here."""
    pipeline: PipelineConfig = dataclasses.field(
        default_factory=lambda: PipelineConfig(memory_cap_bytes=8 * 2**20)
    )
    """The pipelines' settings (batch size, memory cap, controller, shuffle seed); here
    ``memory_cap_bytes`` defaults to 8 MiB, and ``adaptive`` and ``num_workers`` are set by the
    bench for each run."""

    def __post_init__(self):
        if self.steps < 10 or self.examples < self.pipeline.batch_size:
            raise ValueError("need steps >= 10 and examples >= pipeline.batch_size")
        if self.rounds < 1:
            raise ValueError("need rounds >= 1")
        if self.store not in ("emulated", "http"):
            raise ValueError(f"store must be 'emulated' or 'http', got {self.store!r}")
        if not self.sweep_workers or min(self.sweep_workers) <= 0:
            raise ValueError("sweep_workers must be positive multiples")


def _bench_step(resolution: int, batch: int):
    """A jitted discriminator update (conv stem, two strided convs, hinge loss, SGD)."""
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


class HeldStepRunner:
    """The bench's step as a runner of the one step loop (`paragan_jax.loop.run_steps`).

    Each step waits for its result, as a loop that logs its loss does (the time then spent
    fetching the next batch is time the device had no input: the controller's signal), and is
    held to ``step_ms`` like an accelerator with a steady step time (0: the bare step).
    """

    def __init__(self, step, params, step_ms: float):
        self.step, self.params, self.step_ms = step, params, step_ms

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        t0 = time.perf_counter()
        b = batches[0]
        self.params, loss = self.step(self.params, jnp.asarray(b["image"]), jnp.asarray(b["label"]))
        loss.block_until_ready()
        if self.step_ms > 0:
            left = self.step_ms / 1e3 - (time.perf_counter() - t0)
            if left > 0:
                time.sleep(left)
        return {"loss": loss}

    def end_step(self, stop: bool) -> bool:
        return stop


def _time_step(step, params, batch: int, resolution: int, n: int = 20) -> float:
    """Median time of the bare step (not held), over `n` steps after one untimed."""
    zeros = {
        "image": np.zeros((batch, resolution, resolution, 3), np.uint8),
        "label": np.zeros((batch,), np.int32),
    }
    runner = HeldStepRunner(step, params, 0.0)
    stats = run_steps(runner, itertools.repeat([zeros]), n + 1, block_each_step=True)
    return float(np.median(stats.step_times[1:]))


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
    args: BenchPipelineCommand,
    storage,
    control,
    pipe_cfg,
    step,
    params,
    steps: int,
    congested: bool,
    round_: int = 0,
) -> dict:
    horizon = 600.0
    episodes = (
        CongestionEpisodes.seeded(
            args.seed + round_, horizon, args.mean_clean_s, args.mean_congested_s
        )
        if congested
        else None
    )
    control.prepare(episodes)
    pipe = InputPipeline(storage, pipe_cfg, process_index=0, process_count=1)
    batches = pipe.batches()
    runner = HeldStepRunner(step, params, args.step_ms)
    # Fill the pipeline on a clean store; not timed.
    run_steps(runner, grouped(batches, 1), args.warmup)
    control.start()
    marks: dict[str, float] = {}

    def after_first(n: int, _metrics) -> None:
        if n == 1:  # the loop times from the end of its first step
            marks.update(wait0=pipe.total_wait_s, trace0=len(pipe.trace))

    stats = run_steps(runner, grouped(batches, 1), steps + 1, on_step=after_first)
    wall, steps = stats.wall_s, stats.timed_steps
    wait0, trace0 = marks["wait0"], int(marks["trace0"])
    batches.close()
    lat = storage.stats.summary()
    trace = pipe.trace[trace0:]
    workers = [t["workers"] for t in trace] or [pipe.controller.workers]
    depths = [t["depth"] for t in trace] or [pipe.controller.depth]
    frac = episodes.congested_fraction(wall) if episodes else 0.0
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


def bench_pipeline(cfg: BenchPipelineCommand) -> dict:
    """Fixed against adaptive pipeline, clean against congested store (and, over HTTP, a sweep
    of fixed settings); prints a table and returns the results (steps/s per configuration,
    retained ratios, traces)."""
    args, batch_size = cfg, cfg.pipeline.batch_size
    rng = np.random.default_rng(args.seed)
    r = args.resolution
    step, params = _bench_step(r, batch_size)
    bare_step_s = _time_step(step, params, batch_size, r)
    step_s = max(bare_step_s, args.step_ms / 1e3)
    images = rng.integers(0, 256, (args.examples, r, r, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, (args.examples,), dtype=np.int32)
    server = None
    with tempfile.TemporaryDirectory(prefix="paragan-bench-") as tmp:
        base = args.base_latency_ms / 1e3
        if args.store == "http":
            model = CongestionModel(
                bandwidth_bytes_per_s=cfg.bandwidth_mb_s * 1e6,
                base_latency_s=base,
                jitter_sigma=cfg.jitter_sigma,
                latency_factor=cfg.congestion_factor,
                bandwidth_share=cfg.bandwidth_share,
                mean_clean_s=cfg.mean_clean_s,
                mean_congested_s=cfg.mean_congested_s,
                seed=cfg.seed,
            )
            server, storage = serve_shards(f"{tmp}/shards", images, labels, model)
            control = RunCongestion(server.congestion)
            bandwidth = cfg.bandwidth_mb_s * 1e6
        else:
            write_local_dataset(tmp, {"image": images, "label": labels})
            storage = EmulatedRemoteStorage(
                LocalArrayStorage(tmp),
                seed=args.seed,
                base_latency_s=base,
                congestion_factor=args.congestion_factor,
            )
            control = RunCongestion(storage.congestion)
            bandwidth = storage.bandwidth
        try:
            clean_latency = base + storage.example_nbytes() / bandwidth
            need = batch_size / step_s * clean_latency
            # Tuned generously for the clean store: twice the Little's-law concurrency.
            fixed_workers = max(1, math.ceil(need * 2.0))
            cap = cfg.pipeline.memory_cap_bytes
            configs = [
                ("clean_fixed", False, False, fixed_workers, cfg.pipeline.prefetch_depth),
                ("clean_adaptive", True, False, fixed_workers, cfg.pipeline.prefetch_depth),
                ("congested_fixed", False, True, fixed_workers, cfg.pipeline.prefetch_depth),
                ("congested_adaptive", True, True, fixed_workers, cfg.pipeline.prefetch_depth),
            ]
            sweep: list[tuple[int, int]] = []
            if args.store == "http":
                max_depth = min(
                    cfg.pipeline.max_depth, cap // (storage.example_nbytes() * batch_size)
                )
                sweep = fixed_sweep(
                    fixed_workers,
                    cfg.sweep_workers,
                    batch_size,
                    cfg.pipeline.max_workers,
                    max_depth,
                )
                configs += [(f"sweep_w{w}_d{d}", False, True, w, d) for w, d in sweep]
            # Interleave short rounds of all configurations, so that the load of a shared
            # machine drifting over the run affects them alike.
            runs: dict[str, list[dict]] = {c[0]: [] for c in configs}
            per_round = max(10, args.steps // args.rounds)
            for r_i in range(args.rounds):
                for name, adaptive, congested, workers, depth in configs:
                    pipe_cfg = dataclasses.replace(
                        cfg.pipeline,
                        adaptive=adaptive,
                        num_workers=min(workers, cfg.pipeline.max_workers),
                        prefetch_depth=min(depth, cfg.pipeline.max_depth),
                    )
                    runs[name].append(
                        _run_pipeline(
                            cfg, storage, control, pipe_cfg, step, params, per_round, congested, r_i
                        )
                    )
            server_counters = dict(server.counters) if server is not None else None
        finally:
            if server is not None:
                server.close()
        results = {name: _merge_runs(rs) for name, rs in runs.items()}
    out = {k: results[k]["steps_per_s"] for k, *_ in configs[:4]}
    out["peak_buffer_bytes"] = max(v["peak_buffer_bytes"] for v in results.values())
    out["memory_cap_bytes"] = cap
    out["fixed_retained"] = out["congested_fixed"] / out["clean_fixed"]
    out["adaptive_retained"] = out["congested_adaptive"] / out["clean_adaptive"]
    out["compute_only_steps_per_s"] = 1.0 / step_s
    out["bare_cpu_step_s"] = bare_step_s
    out["fixed_workers"] = fixed_workers
    out["settings"] = dataclasses.asdict(cfg)
    if args.store == "http":
        best = max(sweep, key=lambda wd: results[f"sweep_w{wd[0]}_d{wd[1]}"]["steps_per_s"])
        out["best_fixed_congested"] = results[f"sweep_w{best[0]}_d{best[1]}"]["steps_per_s"]
        out["best_fixed_setting"] = {"workers": best[0], "depth": best[1]}
        out["adaptive_vs_best_fixed"] = out["congested_adaptive"] / out["best_fixed_congested"]
        out["fixed_sweep"] = [
            {"workers": w, "depth": d, "steps_per_s": results[f"sweep_w{w}_d{d}"]["steps_per_s"]}
            for w, d in sweep
        ]
        out["server"] = server_counters
        out["store"] = (
            "http: loopback object server (paragan_jax.http_store) serving sharded uint8 zarr3 "
            "(paragan_jax.shards), read through tensorstore's http kvstore over real sockets"
        )
    else:
        out["store"] = "EMULATED remote store (seeded latency model) over local .npy files"
    out["storage"] = out["store"]
    out["details"] = {
        k: {kk: vv for kk, vv in v.items() if kk != "trace"} for k, v in results.items()
    }
    out["adaptive_trace"] = results["congested_adaptive"]["trace"]

    print(
        f"{args.store} store; bare CPU step {1e3 * bare_step_s:.1f} ms, held to "
        f"{1e3 * step_s:.1f} ms ({1 / step_s:.1f} steps/s); fixed pipeline: {fixed_workers} "
        "workers, depth 2"
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
    if args.store == "http":
        print(
            f"best fixed under congestion: {out['best_fixed_congested']:.1f} steps/s "
            f"({best[0]} workers, depth {best[1]}); adaptive "
            f"{out['adaptive_vs_best_fixed']:.0%} of it"
        )
    return out


def _plot_trace(trace: list[dict], path: Path) -> None:
    steps = [t["step"] for t in trace]
    fig = Figure(figsize=(7, 6))
    ax = fig.subplots(3, 1, sharex=True)
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


def main(argv: list[str]) -> int:
    """``python -m paragan_jax bench-pipeline [--config preset] [--flags] [key=value ...]``."""
    parser = command_config_parser(
        "bench-pipeline",
        BenchPipelineCommand,
        "Fixed against adaptive input pipeline, on a clean and a congested (emulated) store.",
    )
    cfg = load_command_config(BenchPipelineCommand, parser.parse_intermixed_args(argv[1:]))
    out = bench_pipeline(cfg)
    write_json(cfg.json, out)
    if cfg.png:
        _plot_trace(out["adaptive_trace"], Path(cfg.png))
    return 0
