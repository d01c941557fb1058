"""Commands ``train``, ``eval``, ``sample`` and ``bench`` of ``python -m paragan_jax``.

::

    python -m paragan_jax train --config digits_cpu --scheme async --steps 300 --workdir runs/d
    python -m paragan_jax train --config digits_cpu --adaptive-pipeline --emulate-remote \
        --workdir runs/p
    python -m paragan_jax train --config digits_cpu --num-processes 2 --workdir runs/d2
    python -m paragan_jax eval --workdir runs/d --json out.json
    python -m paragan_jax sample --workdir runs/d --out grid.png
    python -m paragan_jax bench --config ring8_cpu --seconds 20 --staleness 1,2,4 --json b.json

Every command follows the stack's convention (`tapas_jax.commands.command_parser`): ``--config``
takes a preset of ``paragan_jax/presets`` or a ``.yaml`` path, positional ``key=value``
arguments override `paragan_jax.config.TrainConfig` fields (all listed in ``--help``); eval and
sample read the run's own ``<workdir>/config.yaml`` unless ``--config`` says otherwise. Bad input
(unknown key, unreadable data, a batch that does not divide the data axis, a workdir that cannot
be written, ...) raises `ConfigError` / `ValueError` / `OSError` before any training step, which
the dispatcher prints as one line with exit status 2; so does a workdir another run holds.

``train --num-processes N`` starts N local processes (`paragan_jax.distributed.launch`: CPU
devices, ``jax.distributed`` with gloo on 127.0.0.1), each running this same ``train`` command
with ``--process-id`` and ``--port``: the miniature of a pod's hosts (only process 0 prints,
writes logs, TensorBoard and images; all save checkpoints). A SIGTERM, to a training process or
to the launcher (which passes it on), saves a checkpoint at the step the processes agree on and
exits 0. ``eval --json`` adds ``params_sha256``: the SHA-256 of every restored array, in tree
order (two runs equal bit for bit have the same).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

from absl import logging as absl_logging

from tapas_jax.commands import command_parser
from tapas_jax.config import ConfigError

from .bench import bench_command
from .checkpoint import as_path
from .config import TrainConfig, load_train_config
from .distributed import WorkerFailed, initialize, launch
from .pipeline import trainer_batch_iterator_factory
from .storage import CongestionEpisodes, EmulatedRemoteStorage
from .train import Trainer
from .workdir import is_primary

__all__ = ["main", "patient_cpu_collectives"]

PACKAGE = "paragan_jax"

log = logging.getLogger("paragan_jax")


def setup_logging(verbose: bool) -> None:
    """INFO from paragan_jax (compile sizes, resume), WARNING from everything else."""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        force=True,  # an import may already have logged through the root logger
    )
    logging.getLogger("paragan_jax").setLevel(logging.INFO)
    absl_logging.set_verbosity(absl_logging.WARNING)


def _parser(command: str, description: str, default_config: str | None = None):
    p = command_parser(
        PACKAGE, command, TrainConfig, description=description, example="model.z_dim=64"
    )
    if default_config is not None:
        p.set_defaults(config=default_config)
    return p


def _train(argv: list[str]) -> int:
    p = _parser(
        "train",
        "Train a GAN (sync or async scheme); --config defaults to digits_cpu.",
        "digits_cpu",
    )
    p.add_argument("--scheme", choices=["sync", "async"], help="the same as scheme=...")
    p.add_argument("--steps", type=int, help="total generator steps (the same as steps=...)")
    p.add_argument("--workdir", required=True, help="checkpoints, TensorBoard logs, samples")
    p.add_argument(
        "--seconds", type=float, help="stop after this many seconds (the compiling step excluded)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
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
    p.add_argument(
        "--num-processes",
        type=int,
        default=1,
        help="start this many local processes joined by jax.distributed (gloo on 127.0.0.1)",
    )
    p.add_argument(
        "--devices-per-process", type=int, default=1, help="with --num-processes: CPU devices each"
    )
    p.add_argument("--process-id", type=int, help=argparse.SUPPRESS)  # set by the launcher
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("-v", "--verbose", action="store_true", help="log compile sizes and resumes")
    args = p.parse_intermixed_args(argv)
    if args.num_processes < 1 or args.devices_per_process < 1:
        raise ConfigError("--num-processes and --devices-per-process must be >= 1")
    if args.num_processes > 1 and args.process_id is None:
        return _launch_processes(argv, args.num_processes, args.devices_per_process)
    if args.process_id is not None:
        initialize(args.process_id, args.num_processes, args.port)
    setup_logging(args.verbose)
    if not is_primary():
        logging.getLogger("paragan_jax").setLevel(logging.WARNING)
    if args.emulate_remote and not args.adaptive_pipeline:
        raise ConfigError("--emulate-remote needs --adaptive-pipeline")
    overrides = list(args.overrides)
    if args.scheme:
        overrides.append(f"scheme={args.scheme}")
    if args.steps is not None:
        overrides.append(f"steps={args.steps}")
    cfg = load_train_config(args.config, overrides)
    streams: list = []
    factory = _pipeline_factory(cfg, args.emulate_remote, args.remote_seed, streams)
    trainer = Trainer(
        cfg,
        args.workdir,
        progress=not args.no_progress,
        batch_iterator_factory=factory if args.adaptive_pipeline else None,
    )
    summary = trainer.train(seconds=args.seconds)
    if not is_primary():
        return 0
    if summary["preempted_at"] is not None:
        print(
            f"SIGTERM: stopped at step {summary['preempted_at']} and saved a checkpoint there; "
            "rerun the same command to resume"
        )
    if summary["resumed_from"] is not None:
        print(f"resumed from step {summary['resumed_from']}")
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
    print(f"checkpoints: {args.workdir.rstrip('/')}/checkpoints")
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


def _launch_processes(argv: list[str], n: int, devices: int) -> int:
    """``train --num-processes N``: this ``train`` command in N local processes; a SIGTERM or
    Ctrl-C here is passed on to them (they save a checkpoint and exit 0)."""
    procs: list = []

    def forward(signum, frame):
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        launch(argv, n, devices, timeout_s=None, command="train", capture=False, started=procs)
    except WorkerFailed as e:  # the worker printed its own error; the others were stopped
        print(f"train --num-processes {n}: {e}", file=sys.stderr)
        return e.returncode if e.returncode > 0 else 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _pipeline_factory(cfg, emulate_remote: bool, remote_seed: int, streams: list):
    """The Trainer's batch iterator factory for ``--adaptive-pipeline`` (settings: the config's
    ``pipeline`` section); records each stream."""
    wrap = None
    if emulate_remote:
        # Seeded clean/congested periods (means 10 s / 3 s, for the first hour) so the
        # controller has something to react to.
        episodes = CongestionEpisodes.seeded(remote_seed, 3600.0, 10.0, 3.0)

        def wrap(storage):
            return EmulatedRemoteStorage(storage, seed=remote_seed, episodes=episodes)

    inner = trainer_batch_iterator_factory(cfg.pipeline, wrap_storage=wrap)

    def factory(*a, **kw):
        stream = inner(*a, **kw)
        streams.append(stream)
        return stream

    return factory


def _restored_trainer(args) -> tuple[Trainer, int]:
    """The workdir's run (its ``config.yaml`` unless ``--config``) at its latest checkpoint."""
    config = args.config
    if config is None:
        path = as_path(args.workdir) / "config.yaml"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: is {args.workdir!r} a paragan_jax workdir?")
        config = str(path)
    cfg = load_train_config(config, args.overrides)
    trainer = Trainer(cfg, args.workdir, progress=False)
    step = trainer.restore()
    return trainer, step


def _eval(argv: list[str]) -> int:
    p = _parser(
        "eval",
        "Offline metrics of the latest checkpoint (eval.num_samples=N sets the sample count); "
        "--config defaults to the run's <workdir>/config.yaml.",
    )
    p.add_argument("--workdir", required=True, help="the run's workdir")
    p.add_argument("--json", help="write the metrics here")
    args = p.parse_intermixed_args(argv)
    setup_logging(False)
    trainer, _ = _restored_trainer(args)
    out = trainer.evaluate()
    out["params_sha256"] = trainer.state_sha256()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0


def _sample(argv: list[str]) -> int:
    p = _parser(
        "sample",
        "Sample grid PNG from the latest checkpoint; --config defaults to the run's "
        "<workdir>/config.yaml.",
    )
    p.add_argument("--workdir", required=True, help="the run's workdir")
    p.add_argument("--out", default="samples.png", help="PNG path")
    p.add_argument("--seed", type=int, default=1234, help="seed of the latents")
    args = p.parse_intermixed_args(argv)
    setup_logging(False)
    trainer, step = _restored_trainer(args)
    path = trainer.sample_grid(args.out, seed=args.seed)
    print(f"wrote {path} (step {step})")
    return 0


def _bench(argv: list[str]) -> int:
    p = _parser(
        "bench",
        "Async against sync: steps/s and quality after equal wall-clock time; --config "
        "defaults to ring8_cpu.",
        "ring8_cpu",
    )
    p.add_argument("--seconds", type=float, default=20.0, help="training time per variant")
    p.add_argument("--staleness", default="1,2,4", help="k values of the async variants")
    p.add_argument("--devices", type=int, default=8, help="simulated devices (in-process mode)")
    p.add_argument(
        "--processes",
        action="store_true",
        help="two-process mode: sync on 1 device vs async with G and D in 2 processes",
    )
    p.add_argument("--workdir", default="runs/bench", help="sample grids, bench.json, bench.png")
    p.add_argument("--json", default=None, help="default: <workdir>/bench.json")
    args = p.parse_intermixed_args(argv)
    setup_logging(False)
    try:
        ks = [int(k) for k in args.staleness.split(",") if k.strip()]
    except ValueError:
        raise ConfigError(f"--staleness {args.staleness!r}: expected integers like 1,2,4") from None
    return bench_command(
        args.config,
        list(args.overrides),
        seconds=args.seconds,
        staleness=ks,
        devices=args.devices,
        processes=args.processes,
        workdir=args.workdir,
        json_path=args.json,
    )


_COMMANDS = {"train": _train, "eval": _eval, "sample": _sample, "bench": _bench}


def patient_cpu_collectives() -> None:
    """Raises XLA:CPU's collective rendezvous timeouts (default 40 s to abort).

    With 8 simulated devices on a small, busy machine, one device thread can be starved long
    enough for XLA to abort the process ("Termination timeout for `all gather`"); waiting longer
    is correct. Only effective before the CPU backend starts, so it runs before jax is used.
    """
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
        raise ValueError(f"expected one of {sorted(_COMMANDS)}, got {argv[:1]}")
    return _COMMANDS[argv[0]](argv[1:])
