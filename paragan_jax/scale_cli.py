"""``python -m paragan_jax scaling`` and the internal ``train-multihost``.

scaling: predicted step time and scaling efficiency of the sync and async schemes at several chip
counts (`paragan_jax.scaling`), optionally checked against measured 1/2/4-process CPU runs
(`paragan_jax.scaling_check`); JSON and a PNG of the efficiency curve with ParaGAN's published
point. Settings are `ScalingCommand` (a preset via ``--config``, flags, ``key=value`` overrides;
`paragan_jax.command_config`)::

    python -m paragan_jax scaling --model biggan128 --chips 8,64,256,1024 --hardware tpu-v3 \
        --json runs/scaling.json --check-cpu 1,2,4

train-multihost (internal, run on every TPU VM worker by ``scripts/tpu_run.sh``):
`jax.distributed.initialize()`, then ``train``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
from matplotlib.figure import Figure

from tapas_jax.hardware import get_profile

from . import cli
from .command_config import command_config_parser, load_command_config
from .scaling import (
    PAPER_EFFICIENCY_1024_CORES,
    ScalingParams,
    count_step_collectives,
    load_model_config,
    measure_step_costs,
    predict,
)
from .scaling_check import check_cpu

__all__ = ["ScalingCommand", "main", "plot_scaling", "run_scaling", "train_multihost"]


@dataclasses.dataclass(frozen=True)
class ScalingCommand:
    """Settings of ``python -m paragan_jax scaling``."""

    model: str = "biggan128"
    """The GAN whose scaling is predicted: biggan128, biggan256 or a training preset."""
    chips: list[int] = dataclasses.field(default_factory=lambda: [8, 64, 256, 1024])
    """Chip counts to predict."""
    hardware: str = "tpu-v3"
    """tapas_jax hardware profile of the chips."""
    per_chip_batch: int = 8
    """Examples per chip (weak scaling: the global batch grows with the chips)."""
    achieved_fraction: float = ScalingParams.achieved_fraction
    """Share of peak FLOP/s one chip's step reaches."""
    jitter: float = ScalingParams.jitter
    """Relative std of one chip's step time."""
    overlap: float = ScalingParams.overlap
    """Fraction of the gradient all-reduce hidden behind the backward pass."""
    small_collectives: int = ScalingParams.small_collectives
    """Latency-bound collectives per step besides the gradient all-reduces."""
    count_collectives: bool = False
    """Count the step's small collectives from a narrow compiled copy of the model (slow)."""
    check_cpu: list[int] = dataclasses.field(default_factory=list)
    """Also measure these CPU process counts (1 and 2 calibrate, e.g. 1,2,4); empty: no check."""
    check_steps: int = 5
    """Steps per round per process count of the CPU check."""
    json: str | None = None
    """Write the rows and inputs here (and the plot next to it as .png)."""

    def __post_init__(self):
        if not self.chips or min(self.chips) < 1:
            raise ValueError(
                f"chips {self.chips}: expected positive integers such as 8,64,256,1024"
            )
        procs = sorted(set(self.check_cpu))
        if procs and (procs[:2] != [1, 2] or len(procs) < 3):
            raise ValueError(
                f"check_cpu {self.check_cpu}: needs 1 and 2 (calibration) and at least one "
                "larger process count, e.g. 1,2,4"
            )


def run_scaling(cfg: ScalingCommand) -> dict[str, Any]:
    """The predictions (and CPU check) of one `ScalingCommand`, printed and returned."""
    hw = get_profile(cfg.hardware)
    small, counted = cfg.small_collectives, None
    if cfg.count_collectives:
        narrow = load_model_config(
            cfg.model,
            cfg.per_chip_batch,
            [
                "model.g_width=4",
                "model.d_width=4",
                "model.dtype=float32",
                "sharding.params=replicated",
            ],
        )
        counted = count_step_collectives(narrow)
        # XLA combines the gradient all-reduces into a few; count them all as small ones
        # (an over-estimate by those few latency terms).
        small = int(sum(counted.values()))
    params = ScalingParams(cfg.achieved_fraction, cfg.jitter, cfg.overlap, small)
    costs = measure_step_costs(load_model_config(cfg.model, cfg.per_chip_batch), cfg.model)
    rows = [predict(costs, n, s, hw, params) for n in cfg.chips for s in ("sync", "async")]
    paper = {
        "published_efficiency": PAPER_EFFICIENCY_1024_CORES,
        "published_at": "1024 TPU v3 cores = 512 chips",
        "predicted_async_512_chips": predict(costs, 512, "async", hw, params)["efficiency"],
        "predicted_sync_512_chips": predict(costs, 512, "sync", hw, params)["efficiency"],
    }
    print(
        f"{cfg.model} on {hw.name}, per-chip batch {cfg.per_chip_batch}, jitter "
        f"{params.jitter:.0%}, achieved {params.achieved_fraction:.0%} of peak"
    )
    print(f"{'chips':>6} {'scheme':>6} {'step ms':>9} {'efficiency':>10} {'allreduce ms':>12}")
    for r in rows:
        print(
            f"{r['chips']:6d} {r['scheme']:>6} {1e3 * r['step_seconds']:9.2f} "
            f"{r['efficiency']:10.1%} {1e3 * r['allreduce_s']:12.2f}"
        )
    print(
        f"ParaGAN published {PAPER_EFFICIENCY_1024_CORES:.0%} at 1024 v3 cores (512 chips); "
        f"predicted here at 512 chips: async {paper['predicted_async_512_chips']:.1%}, "
        f"sync {paper['predicted_sync_512_chips']:.1%}"
    )
    out: dict[str, Any] = {
        "model": cfg.model,
        "hardware": hw.name,
        "rows": rows,
        "params": dataclasses.asdict(params),
        "costs": dataclasses.asdict(costs),
        "paper": paper,
        "counted_collectives": counted,
    }
    if cfg.check_cpu:
        check = check_cpu(tuple(cfg.check_cpu), steps=cfg.check_steps)
        out["cpu_check"] = check
        _print_check(check)
    return out


def _print_check(check: dict[str, Any]) -> None:
    print(
        f"CPU check ({check['cores']} cores, {check['cores_busy_1_process']:.2f} busy per "
        f"process; per-hop latency in the step {1e3 * check['alpha_s']:.2f} ms (lone "
        f"all-reduce: {1e3 * check['alpha_lone_allreduce_s']:.2f} ms), "
        f"{check['bandwidth_Bps'] / 1e9:.2f} GB/s):"
    )
    print(f"  load average {check['load_average'][0]:.1f} -> {check['load_average'][1]:.1f}")
    for label, key in (("median", "rows"), ("fastest", "rows_min")):
        for r in check[key]:
            print(
                f"  {label:>7} {r['processes']} processes: measured "
                f"{1e3 * r['measured_s']:.1f} ms, predicted {1e3 * r['predicted_s']:.1f} ms "
                f"({r['error']:+.0%}, {r['role']})"
            )


def scaling(argv: list[str]) -> int:
    """``python -m paragan_jax scaling [--config preset] [--flags] [key=value ...]``."""
    parser = command_config_parser(
        "scaling",
        ScalingCommand,
        "Predicted step time and scaling efficiency of sync and async ParaGAN at pod scale.",
    )
    cfg = load_command_config(ScalingCommand, parser.parse_intermixed_args(argv))
    out = run_scaling(cfg)
    if cfg.json:
        path = Path(cfg.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        png = path.with_suffix(".png")
        plot_scaling(out, png)
        print(f"wrote {path} and {png}")
    return 0


def plot_scaling(out: dict[str, Any], path: Path) -> None:
    """Predicted efficiency per chip count (sync, async, ParaGAN's published point) and, when
    the CPU check ran, measured against predicted step time per process count."""
    check = out.get("cpu_check")
    fig = Figure(figsize=(11 if check else 6, 4.2))
    axes = fig.subplots(1, 2 if check else 1)
    ax = axes[0] if check else axes
    for scheme, marker in (("sync", "o"), ("async", "s")):
        rows = [r for r in out["rows"] if r["scheme"] == scheme]
        ax.plot(
            [r["chips"] for r in rows],
            [100 * r["efficiency"] for r in rows],
            marker=marker,
            label=f"{scheme} (predicted)",
        )
    ax.plot([512], [100 * PAPER_EFFICIENCY_1024_CORES], "k*", ms=12, label="ParaGAN, published")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chips")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"{out['model']} on {out['hardware']}")
    ax.grid(alpha=0.3)
    ax.legend()
    if check:
        ax = axes[1]
        rows = check["rows"]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [1e3 * r["measured_s"] for r in rows], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [1e3 * r["predicted_s"] for r in rows], 0.4, label="model")
        ax.set_xticks(
            list(x),
            [
                f"{r['processes']} proc\n{r['role']}"
                if r["role"] != "prediction"
                else f"{r['processes']} proc\n{r['error']:+.0%}"
                for r in rows
            ],
        )
        ax.set_ylabel("sync step, median (ms)")
        ax.set_title(f"CPU check: gloo processes on {check['cores']} cores")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def train_multihost(argv: list[str]) -> int:
    """``python -m paragan_jax train-multihost <train args>`` on every TPU VM worker.

    Joins the slice's JAX runtime (`jax.distributed.initialize()` with no arguments: on a TPU VM
    the runtime supplies coordinator, process count and index), then runs the ordinary
    ``paragan_jax train`` command with the remaining arguments. `scripts/tpu_run.sh` calls this.
    """
    jax.distributed.initialize()
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local "
        f"of {jax.device_count()} devices ({jax.devices()[0].device_kind})",
        flush=True,
    )
    return int(cli.main(["train", *argv]) or 0)


def main(argv: list[str]) -> int:
    """Entry point of the ``scaling`` and ``train-multihost`` commands (``argv[0]``)."""
    if argv[0] == "train-multihost":
        return train_multihost(argv[1:])
    return scaling(argv[1:])
