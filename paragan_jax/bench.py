"""The ``bench`` command's work: async against sync, steps/s and quality at equal wall-clock time.

Each variant trains for the same number of seconds through the one step loop
(`paragan_jax.loop.run_steps`): in-process variants through a `Trainer` without a workdir (sync
data parallel over all devices; async with G and D on disjoint halves), two-process variants
through `paragan_jax.distributed.run_two_process_async` (G and D in their own processes). Every
variant is then scored by `paragan_jax.metrics.evaluate_samples` on the same data set; the table,
``bench.json`` and a bar chart ``bench.png`` go to the workdir.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .config import TrainConfig, load_train_config
from .data import load_dataset
from .distributed import run_two_process_async
from .metrics import evaluate_samples, save_sample_png
from .train import Trainer
from .train_data import reference_dataset
from .workdir import prepare_workdir

__all__ = ["bench_command"]


def _trainer_variant(cfg: TrainConfig, seconds: float, workdir: Path, name: str) -> dict[str, Any]:
    trainer = Trainer(cfg, None, progress=False)
    summary = trainer.train(seconds=seconds)
    grid = trainer.sample_grid(str(workdir / f"bench_{name}.png"))
    return {
        "variant": name,
        "steps": summary["step"],
        "wall_s": summary["wall_s"],
        "steps_per_sec": summary["steps_per_sec"],
        "sample_grid": grid,
        **trainer.evaluate(),
    }


def _two_process_variant(
    preset: str, overrides: list[str], seconds: float, workdir: Path, name: str
) -> dict[str, Any]:
    cfg = load_train_config(preset, overrides)  # validate before launching workers
    res = run_two_process_async(preset, overrides, str(workdir / name), seconds=seconds)
    ds = reference_dataset(cfg, load_dataset(cfg))  # what Trainer.evaluate scores against
    samples = res.pop("samples")
    grid = save_sample_png(
        samples[: cfg.eval.grid_rows**2] if samples.ndim > 2 else samples,
        workdir / f"bench_{name}.png",
        rows=cfg.eval.grid_rows,
        real=ds.images[:2000] if ds.is_mixture else None,
    )
    return {
        "variant": name,
        "steps": res["steps"],
        "wall_s": res["wall_s"],
        "steps_per_sec": res["steps_per_sec"],
        "sample_grid": str(grid),
        **evaluate_samples(samples, ds),
    }


def bench_command(
    preset: str,
    overrides: list[str],
    seconds: float,
    staleness: list[int],
    devices: int,
    processes: bool,
    workdir: str,
    json_path: str | None,
) -> int:
    """Runs the variants, prints the table, writes ``bench.json`` and ``bench.png``.

    Args:
      preset: preset name or YAML path.
      overrides: ``key=value`` config overrides applied to every variant.
      seconds: training time per variant (after its compiling step).
      staleness: the async variants' k values.
      devices: simulated devices of the in-process variants.
      processes: two-process mode (sync on 1 device against async in 2 processes).
      workdir: output folder.
      json_path: the JSON path (default ``<workdir>/bench.json``).

    Raises:
      ConfigError: a bad preset or override (before anything trains); OSError: the workdir
        cannot be written.
    """
    out_dir = Path(str(prepare_workdir(workdir)))  # local: the plot goes through pathlib
    base = list(overrides) + ["checkpoint.enabled=false", "steps=1000000000"]
    rows = []
    if processes:
        cfg = load_train_config(preset, base + ["scheme=sync", "sharding.num_devices=1"])
        rows.append(_trainer_variant(cfg, seconds, out_dir, "sync_1proc"))
        for k in staleness:
            over = base + [f"async_.staleness={k}"]
            rows.append(_two_process_variant(preset, over, seconds, out_dir, f"async_k{k}_2proc"))
    else:
        common = base + [f"sharding.num_devices={devices}"]
        cfg = load_train_config(preset, common + ["scheme=sync"])
        rows.append(_trainer_variant(cfg, seconds, out_dir, "sync"))
        for k in staleness:
            cfg = load_train_config(preset, common + ["scheme=async", f"async_.staleness={k}"])
            rows.append(_trainer_variant(cfg, seconds, out_dir, f"async_k{k}"))
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
        "config": preset,
        "seconds": seconds,
        "overrides": overrides,
        "mode": "two_process" if processes else f"in_process_{devices}_devices",
        "rows": rows,
    }
    path = Path(json_path) if json_path else out_dir / "bench.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    _bench_plot(rows, out_dir / "bench.png")
    print(f"wrote {path} and {out_dir / 'bench.png'}")
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
