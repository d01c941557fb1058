"""Commands ``train``, ``eval``, ``sample`` and ``bench`` of ``python -m paragan_jax``.

::

    python -m paragan_jax train --config digits_cpu --scheme async --steps 300 --workdir runs/d
    python -m paragan_jax train --config digits_cpu --adaptive-pipeline --emulate-remote \
        --workdir runs/p
    python -m paragan_jax eval --workdir runs/d --json out.json
    python -m paragan_jax sample --workdir runs/d --out grid.png
    python -m paragan_jax bench --config ring8_cpu --seconds 20 --staleness 1,2,4 --json b.json

Extra ``key=value`` arguments override config fields (``model.z_dim=64``). Bad input (unknown
key, unreadable data, a batch that does not divide the data axis, ...) prints one clear error line
and exits with status 2 before any training step.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("paragan_jax")


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    logging.getLogger("paragan_jax").setLevel(logging.INFO)
    try:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
    except ImportError:
        pass


def _user_errors():
    from tapas_jax.config import ConfigError
    from tapas_jax.mesh import MeshSpecError

    from .data import DataError

    return (ConfigError, DataError, MeshSpecError, FileNotFoundError)


def _load(args, overrides):
    from .config import load_train_config

    extra = list(overrides)
    if getattr(args, "scheme", None):
        extra.append(f"scheme={args.scheme}")
    if getattr(args, "steps", None) is not None:
        extra.append(f"steps={args.steps}")
    return load_train_config(args.config, extra)


def _train(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paragan_jax train", description="Train a GAN from a preset."
    )
    p.add_argument("--config", default="digits_cpu", help="preset name or YAML path")
    p.add_argument("--scheme", choices=["sync", "async"], help="override the preset's scheme")
    p.add_argument("--steps", type=int, help="total generator steps")
    p.add_argument("--workdir", required=True, help="checkpoints, TensorBoard logs, samples")
    p.add_argument("--time-budget", type=float, help="stop after this many seconds")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--adaptive-pipeline",
        action="store_true",
        help="feed batches through paragan_jax.pipeline (adaptive fetch workers and prefetch "
        "depth under a memory cap); the batches are the same as the default loader's",
    )
    p.add_argument(
        "--emulate-remote",
        action="store_true",
        help="with --adaptive-pipeline: fetch through the EMULATED remote store "
        "(paragan_jax.storage.EmulatedRemoteStorage: seeded latencies, congestion episodes)",
    )
    p.add_argument("--remote-seed", type=int, default=0, help="seed of the emulated store")
    p.add_argument("-v", "--verbose", action="store_true")
    args, overrides = p.parse_known_args(argv)
    _setup_logging(args.verbose)
    from .train import Trainer

    if args.emulate_remote and not args.adaptive_pipeline:
        err = "--emulate-remote needs --adaptive-pipeline"
        print(f"paragan_jax train: error: {err}", file=sys.stderr)
        return 2
    streams: list = []
    try:
        cfg = _load(args, overrides)
        factory = _pipeline_factory(args, streams) if args.adaptive_pipeline else None
        trainer = Trainer(
            cfg, args.workdir, progress=not args.no_progress, batch_iterator_factory=factory
        )
        summary = trainer.train(time_budget_s=args.time_budget)
    except _user_errors() as e:
        print(f"paragan_jax train: error: {e}", file=sys.stderr)
        return 2
    if summary["steps_run"] == 0:
        print(
            f"{cfg.name} is already at step {summary['step']} in {args.workdir}: nothing to "
            "train (raise --steps to continue)"
        )
    else:
        print(
            f"trained {cfg.name} ({cfg.scheme}) to step {summary['step']}: "
            f"{summary['steps_per_sec']:.1f} steps/s, compile {summary['compile_s']:.1f} s"
        )
        print("metrics: " + ", ".join(f"{k}={v:.4f}" for k, v in summary["metrics"].items()))
    print(f"checkpoints: {Path(args.workdir) / 'checkpoints'}")
    print(f"sample grid: {summary['sample_grid']}")
    if streams:
        pipe = streams[-1].pipeline
        print(
            f"input pipeline: {pipe.controller.workers} workers, prefetch depth "
            f"{pipe.controller.depth}, peak buffer {pipe.peak_buffer_bytes / 2**10:.1f} KiB "
            f"(cap {pipe.config.memory_cap_bytes / 2**20:.0f} MiB), input wait "
            f"{pipe.total_wait_s:.2f} s over {pipe.steps} batches"
        )
    return 0


def _pipeline_factory(args, streams: list):
    """The Trainer's batch iterator factory for ``--adaptive-pipeline``; records each stream."""
    from .pipeline import PipelineConfig, trainer_batch_iterator_factory

    wrap = None
    if args.emulate_remote:
        from .storage import CongestionEpisodes, EmulatedRemoteStorage

        # Seeded clean/congested periods (means 10 s / 3 s, for the first hour) so the
        # controller has something to react to.
        episodes = CongestionEpisodes.seeded(args.remote_seed, 3600.0, 10.0, 3.0)

        def wrap(storage):
            return EmulatedRemoteStorage(storage, seed=args.remote_seed, episodes=episodes)

    inner = trainer_batch_iterator_factory(PipelineConfig(), wrap_storage=wrap)

    def factory(*a, **kw):
        stream = inner(*a, **kw)
        streams.append(stream)
        return stream

    return factory


def _trainer_from_workdir(workdir: str, overrides: list[str]):
    from .config import load_train_config
    from .train import Trainer

    path = Path(workdir) / "config.yaml"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: is {workdir!r} a paragan_jax workdir?")
    cfg = load_train_config(str(path), overrides)
    trainer = Trainer(cfg, workdir, progress=False)
    step = trainer.restore()
    return trainer, step


def _eval(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paragan_jax eval", description="Offline metrics of the latest checkpoint."
    )
    p.add_argument("--workdir", required=True)
    p.add_argument("--json", help="write the metrics here")
    p.add_argument("--num-samples", type=int)
    args, overrides = p.parse_known_args(argv)
    _setup_logging(False)
    try:
        trainer, _ = _trainer_from_workdir(args.workdir, overrides)
        out = trainer.evaluate(args.num_samples)
    except _user_errors() as e:
        print(f"paragan_jax eval: error: {e}", file=sys.stderr)
        return 2
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


def _sample(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paragan_jax sample",
        description="Sample grid PNG from the latest checkpoint.",
    )
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", default="samples.png")
    p.add_argument("--seed", type=int, default=1234)
    args, overrides = p.parse_known_args(argv)
    _setup_logging(False)
    try:
        trainer, step = _trainer_from_workdir(args.workdir, overrides)
        path = trainer.sample_grid(args.out, seed=args.seed)
    except _user_errors() as e:
        print(f"paragan_jax sample: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} (step {step})")
    return 0


def _bench_variant(cfg, seconds: float, workdir: Path, name: str) -> dict:
    from .train import Trainer

    trainer = Trainer(cfg, None, progress=False)
    summary = trainer.train(time_budget_s=seconds)
    grid = trainer.sample_grid(str(workdir / f"bench_{name}.png"))
    metrics = trainer.evaluate()
    return {
        "variant": name,
        "steps": summary["step"],
        "wall_s": summary["wall_s"],
        "steps_per_sec": summary["steps_per_sec"],
        "sample_grid": grid,
        **metrics,
    }


def _bench(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m paragan_jax bench",
        description="Async against sync: steps/s and quality after equal wall-clock time.",
    )
    p.add_argument("--config", default="ring8_cpu")
    p.add_argument("--seconds", type=float, default=20.0, help="training time per variant")
    p.add_argument("--staleness", default="1,2,4", help="k values of the async variants")
    p.add_argument("--devices", type=int, default=8, help="simulated devices (in-process mode)")
    p.add_argument(
        "--processes",
        action="store_true",
        help="two-process mode: sync on 1 device vs async with G and D in 2 processes",
    )
    p.add_argument("--workdir", default="runs/bench")
    p.add_argument("--json", default=None, help="default: <workdir>/bench.json")
    args, overrides = p.parse_known_args(argv)
    _setup_logging(False)
    from .config import load_train_config

    ks = [int(k) for k in args.staleness.split(",") if k.strip()]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    base = list(overrides) + ["checkpoint.enabled=false", "steps=1000000000"]
    rows = []
    try:
        if args.processes:
            from .distributed import run_two_process_async
            from .metrics import evaluate_samples, save_sample_png

            cfg = load_train_config(args.config, base + ["scheme=sync", "sharding.num_devices=1"])
            rows.append(_bench_variant(cfg, args.seconds, workdir, "sync_1proc"))
            for k in ks:
                over = base + [f"async_.staleness={k}"]
                load_train_config(args.config, over)  # validate before launching workers
                res = run_two_process_async(
                    args.config, over, str(workdir / f"async_k{k}_2proc"), seconds=args.seconds
                )
                from .data import load_dataset

                ds = load_dataset(cfg)
                samples = res.pop("samples")
                name = f"async_k{k}_2proc"
                grid = save_sample_png(
                    samples[: cfg.eval.grid_rows**2] if samples.ndim > 2 else samples,
                    workdir / f"bench_{name}.png",
                    rows=cfg.eval.grid_rows,
                    real=ds.images[:2000] if ds.is_mixture else None,
                )
                rows.append(
                    {
                        "variant": name,
                        "steps": res["steps"],
                        "wall_s": res["wall_s"],
                        "steps_per_sec": res["steps_per_sec"],
                        "sample_grid": str(grid),
                        **evaluate_samples(samples, ds),
                    }
                )
        else:
            common = base + [f"sharding.num_devices={args.devices}"]
            cfg = load_train_config(args.config, common + ["scheme=sync"])
            rows.append(_bench_variant(cfg, args.seconds, workdir, "sync"))
            for k in ks:
                cfg = load_train_config(
                    args.config, common + ["scheme=async", f"async_.staleness={k}"]
                )
                rows.append(_bench_variant(cfg, args.seconds, workdir, f"async_k{k}"))
    except _user_errors() as e:
        print(f"paragan_jax bench: error: {e}", file=sys.stderr)
        return 2
    ref = rows[0]["steps_per_sec"]
    for r in rows:
        r["speed_ratio"] = r["steps_per_sec"] / ref if ref else float("nan")
    cols = ["variant", "steps", "steps_per_sec", "speed_ratio", "fd", "kid", "classifier_score"]
    if "modes_covered" in rows[0]:
        cols += ["modes_covered", "high_quality_fraction"]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    out = {
        "config": args.config,
        "seconds": args.seconds,
        "overrides": overrides,
        "mode": "two_process" if args.processes else f"in_process_{args.devices}_devices",
        "rows": rows,
    }
    path = Path(args.json) if args.json else workdir / "bench.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    _bench_plot(rows, workdir / "bench.png")
    print(f"wrote {path} and {workdir / 'bench.png'}")
    return 0


def _bench_plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    axes[0].bar(names, [r["speed_ratio"] for r in rows], color="tab:blue")
    axes[0].set_ylabel("steps/s relative to sync")
    axes[1].bar(names, [r["fd"] for r in rows], color="tab:orange")
    axes[1].set_ylabel("Frechet distance (lower is better)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


_COMMANDS = {"train": _train, "eval": _eval, "sample": _sample, "bench": _bench}


def patient_cpu_collectives() -> None:
    """Raises XLA:CPU's collective rendezvous timeouts (default 40 s to abort).

    With 8 simulated devices on a small, busy machine, one device thread can be starved long
    enough for XLA to abort the process ("Termination timeout for `all gather`"); waiting longer
    is correct. Only effective before the CPU backend starts, so it runs before jax is used.
    """
    import os

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_collective_call_terminate_timeout_seconds" not in flags:
        flags += (
            " --xla_cpu_collective_call_terminate_timeout_seconds=900"
            " --xla_cpu_collective_call_warn_stuck_timeout_seconds=120"
        )
        os.environ["XLA_FLAGS"] = flags.strip()


def main(argv: list[str]) -> int:
    """Entry point: ``argv[0]`` is the command name (see `paragan_jax.__main__`)."""
    patient_cpu_collectives()
    if not argv or argv[0] not in _COMMANDS:
        print(f"paragan_jax: expected one of {sorted(_COMMANDS)}", file=sys.stderr)
        return 2
    return _COMMANDS[argv[0]](argv[1:])
