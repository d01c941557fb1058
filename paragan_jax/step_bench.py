"""``python -m paragan_jax bench-step``: the time of one synchronous training step, as a peer
baseline times its own.

A step is what `paragan_jax.steps.SyncRunner.run_step` does: the host batch onto the devices,
``n_disc`` D updates (each on a real batch and fakes from the current G), one G update against
the updated D, and the G EMA. The step runs through the one step loop
(`paragan_jax.loop.run_steps` with ``block_each_step``), which waits for every step and records
its wall and process CPU time; the first (compiling) step and ``--warmup`` more are left out. The
config, devices, mesh, data and runner are a `paragan_jax.train.Trainer`'s (``make_runner``), so
the step timed is the one a run takes. The real batches come from a pool made before timing
(``--pool`` loader batches of the run's data, cycled), so no loader thread runs beside the step.

``scripts/torch_gan_baseline.py`` builds the same G and D in PyTorch and times its step the same
way; given ``--paragan-python`` it runs this command in alternating pairs with its own timing::

    python -m paragan_jax bench-step --config digits_cpu --steps 60 --json step.json \\
        sharding.num_devices=1

Writes (``--json``) the config name, batch, devices, CPU threads, G and D parameter counts, the
per-step times and their medians (``step_ms_median``, ``steps_per_sec``).
"""

from __future__ import annotations

import itertools
import os
import statistics
from typing import Any

import jax
import numpy as np

from tapas_jax.commands import command_parser, write_json
from tapas_jax.config import ConfigError

from .config import TrainConfig, load_train_config
from .data import batch_at
from .loop import run_steps
from .steps import SyncRunner
from .train import Trainer

__all__ = ["main", "param_counts", "step_bench"]


def param_counts(runner: SyncRunner) -> dict[str, int]:
    """Trainable parameters of G and D (EMA, optimizer state and statistics not counted)."""
    size = lambda tree: int(sum(np.prod(x.shape) for x in jax.tree.leaves(tree)))  # noqa: E731
    return {"g_params": size(runner.state.g_params), "d_params": size(runner.state.d_params)}


def step_bench(config: TrainConfig, steps: int, warmup: int, pool: int = 8) -> dict[str, Any]:
    """Times `steps` synchronous steps of `config` after a compiling step and `warmup` more.

    Returns:
      The JSON payload described in the module doc.
    """
    if config.scheme != "sync":
        raise ConfigError(f"scheme={config.scheme!r}: bench-step times the sync step")
    if steps < 1 or warmup < 0 or pool < 1:
        raise ConfigError("--steps and --pool must be >= 1, --warmup >= 0")
    trainer = Trainer(config, None, progress=False)  # validates; the run's devices and data
    runner = trainer.make_runner()
    d, n = trainer.data, config.n_disc
    batches = [
        [batch_at(d.dataset, d.batch_size, d.seed, n * i + j) for j in range(n)]
        for i in range(pool)
    ]
    stats = run_steps(runner, itertools.cycle(batches), 1 + warmup + steps, block_each_step=True)
    wall = stats.step_times[1 + warmup :]
    cpu = stats.cpu_times[1 + warmup :]
    median = statistics.median(wall)
    return {
        "config": config.name,
        "batch": config.data.batch_size,
        "n_disc": n,
        "devices": trainer.mesh.devices.size,
        "cpu_threads": len(os.sched_getaffinity(0)),
        **param_counts(runner),
        "compile_s": stats.compile_s,
        "steps": len(wall),
        "step_ms": [1e3 * t for t in wall],
        "step_ms_median": 1e3 * median,
        "cpu_ms_median": 1e3 * statistics.median(cpu),
        "steps_per_sec": 1.0 / median,
    }


def main(argv: list[str]) -> int:
    """``python -m paragan_jax bench-step [--config preset] [--steps N] [key=value ...]``."""
    p = command_parser(
        "paragan_jax",
        "bench-step",
        TrainConfig,
        description="Wall and CPU time of one synchronous training step (D and G updates, EMA); "
        "--config defaults to digits_cpu.",
        example="sharding.num_devices=1",
    )
    p.set_defaults(config="digits_cpu")
    p.add_argument("--steps", type=int, default=50, help="timed steps")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps after the compiling one")
    p.add_argument("--pool", type=int, default=8, help="real batches made before timing, cycled")
    p.add_argument("--json", help="write the result here")
    args = p.parse_intermixed_args(argv[1:])
    config = load_train_config(args.config, list(args.overrides))
    res = step_bench(config, args.steps, args.warmup, args.pool)
    print(
        f"{res['config']}: batch {res['batch']}, {res['devices']} device(s), "
        f"{res['cpu_threads']} CPU threads, G {res['g_params']:,} + D {res['d_params']:,} params: "
        f"{res['step_ms_median']:.2f} ms/step median ({res['steps_per_sec']:.1f} steps/s), "
        f"CPU {res['cpu_ms_median']:.2f} ms/step"
    )
    write_json(args.json, res)
    return 0
