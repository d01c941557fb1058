"""The `Trainer`: a GAN run from a `TrainConfig`, with data, mesh, checkpoints, logs and samples.

The Trainer picks a runner for the config's scheme (`paragan_jax.steps.SyncRunner` or
`paragan_jax.async_scheme.AsyncRunner`; both build their state with `paragan_jax.state`) and
drives it with the one step loop, `paragan_jax.loop.run_steps`; this module adds only what a run
around the loop needs: resume from the newest checkpoint, TensorBoard scalars, a progress bar,
periodic and final checkpoints, sample grids and offline metrics. Nothing else in the package
imports it.

Runner interface the Trainer relies on (beyond the loop's ``run_step`` / ``end_step``): ``step``
(G steps done), ``fns`` (`paragan_jax.steps.GANFunctions`, for sampling), ``checkpoint_tree()``
and ``load_checkpoint_tree(tree)`` (the checkpointed pytree), ``sampling_params()`` (EMA params
and G statistics) and ``close()``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from omegaconf import OmegaConf
from tensorboardX import SummaryWriter
from tqdm import tqdm

from tapas_jax.config import ConfigError, config_to_dict
from tapas_jax.mesh import make_mesh

from .async_scheme import AsyncRunner, check_async_mesh
from .checkpoint import CheckpointStore
from .config import TrainConfig, validate_config
from .data import PrefetchLoader, load_dataset
from .loop import grouped, run_steps
from .metrics import evaluate_samples, save_sample_png
from .state import check_batch_divides
from .steps import SyncRunner, sample_images

__all__ = ["BatchIteratorFactory", "Trainer", "prepare_workdir"]

log = logging.getLogger("paragan_jax")

BatchIteratorFactory = Callable[..., Iterator[dict[str, np.ndarray]]]


def prepare_workdir(workdir: str) -> Path:
    """Creates `workdir` if needed and checks that files can be written in it.

    Raises:
      OSError: it cannot be created or written (the message names the workdir).
    """
    path = Path(workdir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".paragan_write_test"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        raise OSError(f"workdir {workdir!r} is not a writable directory ({reason})") from None
    return path


class Trainer:
    """Trains a GAN from a `TrainConfig`: data, mesh, scheme, checkpoints, logs, samples.

    Example::

        from paragan_jax import Trainer, load_train_config
        cfg = load_train_config("digits_cpu", ["steps=200"])
        summary = Trainer(cfg, workdir="runs/digits").train()
        print(summary["sample_grid"])

    Everything that can be wrong with the input (config, data, mesh/batch mismatch) raises in the
    constructor, before any step runs; a workdir that cannot be written raises when `train`
    starts. ``batch_iterator_factory(dataset, batch_size, seed, start)`` replaces the default
    `paragan_jax.data.PrefetchLoader` (it must yield the same batches in the same order for exact
    resume).
    """

    def __init__(
        self,
        config: TrainConfig,
        workdir: str | None = None,
        batch_iterator_factory: BatchIteratorFactory | None = None,
        devices: list[jax.Device] | None = None,
        progress: bool = True,
    ):
        validate_config(config)
        self.config = config
        self.workdir = workdir
        self.progress = progress
        self.dataset = load_dataset(config)
        if devices is None:
            devices = jax.devices()
            if config.sharding.num_devices:
                if config.sharding.num_devices > len(devices):
                    raise ConfigError(
                        f"sharding.num_devices={config.sharding.num_devices} but only "
                        f"{len(devices)} devices are visible"
                    )
                devices = devices[: config.sharding.num_devices]
        self.mesh = make_mesh(config.sharding.mesh, devices)
        if config.scheme == "async":
            check_async_mesh(config, self.mesh)
        else:
            check_batch_divides(config, self.mesh)
        self.batch_iterator_factory = batch_iterator_factory
        self.runner = None

    def _make_runner(self):
        shape = self.dataset.images.shape[1:]
        if self.config.scheme == "async":
            return AsyncRunner(self.config, self.mesh, shape)
        return SyncRunner(self.config, self.mesh, shape)

    def _iterator(self, start: int):
        c = self.config.data
        if self.batch_iterator_factory is not None:
            return self.batch_iterator_factory(self.dataset, c.batch_size, c.seed, start)
        return PrefetchLoader(self.dataset, c.batch_size, c.seed, start, c.prefetch)

    def _meta(self, position: int) -> dict[str, Any]:
        return {
            "step": self.runner.step,
            "data_position": position,
            "scheme": self.config.scheme,
            "config": config_to_dict(self.config),
        }

    def train(self, steps: int | None = None, seconds: float | None = None) -> dict[str, Any]:
        """Trains up to `steps` G steps in total (default ``config.steps``), resuming if a
        checkpoint exists in the workdir.

        Args:
          steps: total G steps to reach.
          seconds: stop early once this much wall-clock time has passed after the first
            (compiling) step; used to compare schemes at equal time.

        Returns:
          Summary: ``step``, ``resumed_from``, ``steps_run``, ``wall_s`` and ``steps_per_sec``
          (both excluding the first, compiling step), ``compile_s``, last ``metrics``,
          ``sample_grid`` (PNG path or None).

        Raises:
          OSError: the workdir cannot be created or written.
        """
        cfg = self.config
        total = cfg.steps if steps is None else steps
        workdir = prepare_workdir(self.workdir) if self.workdir else None
        self.runner = runner = self._make_runner()
        store = writer = None
        position, resumed = 0, None
        if workdir is not None:
            if cfg.checkpoint.enabled:
                store = CheckpointStore(
                    workdir / "checkpoints", keep=cfg.checkpoint.keep, every=cfg.checkpoint.every
                )
                restored = store.restore_latest(runner.checkpoint_tree())
                if restored is not None:
                    runner.load_checkpoint_tree(restored["state"])
                    position = int(restored["meta"]["data_position"])
                    resumed = restored["step"]
                    log.info("resumed from step %d (data position %d)", resumed, position)
            writer = SummaryWriter(str(workdir / "tb"))
            (workdir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        loader = self._iterator(position)
        start = runner.step
        bar = tqdm(
            total=total,
            initial=start,
            disable=not self.progress,
            desc=cfg.name,
            unit="step",
            dynamic_ncols=True,
        )

        def on_step(done: int, metrics: dict[str, jax.Array]) -> None:
            step = start + done
            if writer is not None and (step % cfg.eval.log_every == 0 or step == total):
                scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
                for k, v in scalars.items():
                    writer.add_scalar(f"train/{k}", v, step)
                bar.set_postfix({k: f"{v:.3f}" for k, v in scalars.items()}, refresh=False)
            if store is not None and store.should_save(step):
                store.save(step, runner.checkpoint_tree(), self._meta(position + cfg.n_disc * done))
            bar.update(1)

        try:
            stats = run_steps(
                runner,
                grouped(loader, cfg.n_disc),
                total - start,
                seconds=seconds,
                on_step=on_step,
            )
        finally:
            bar.close()
            if hasattr(loader, "close"):
                loader.close()
        position += cfg.n_disc * stats.steps
        if store is not None:
            if runner.step not in store.steps():
                store.save(runner.step, runner.checkpoint_tree(), self._meta(position), force=True)
            store.close()
        grid = None
        if workdir is not None:
            grid = str(workdir / f"samples_step{runner.step}.png")
            self.sample_grid(grid)
            writer.close()
        runner.close()
        return {
            "step": runner.step,
            "resumed_from": resumed,
            "steps_run": stats.steps,
            "wall_s": stats.wall_s,
            "compile_s": stats.compile_s,
            "steps_per_sec": stats.steps_per_sec,
            "metrics": {k: float(v) for k, v in jax.device_get(stats.metrics).items()},
            "sample_grid": grid,
        }

    def samples(self, n: int | None = None, seed: int = 1234) -> np.ndarray:
        """Samples from the trained (EMA) generator; call after `train` or `restore`."""
        if self.runner is None:
            raise RuntimeError("no trained state: call train() or restore() first")
        params, stats = self.runner.sampling_params()
        n = n or self.config.eval.num_samples
        return sample_images(self.runner.fns, params, stats, jax.random.PRNGKey(seed), n)

    def sample_grid(self, path: str, seed: int = 1234) -> str:
        """Writes a sample grid (images) or scatter plot (mixtures) PNG; returns its path."""
        rows = self.config.eval.grid_rows
        if self.dataset.is_mixture:
            pts = self.samples(2000, seed)
            save_sample_png(
                pts,
                path,
                real=self.dataset.images[:2000],
                title=f"{self.config.name} step {self.runner.step}",
            )
        else:
            save_sample_png(self.samples(rows * rows, seed), path, rows=rows)
        return path

    def restore(self) -> int:
        """Loads the latest checkpoint of the workdir (for eval/sample); returns its step."""
        if not self.workdir or not (Path(self.workdir) / "checkpoints").is_dir():
            raise FileNotFoundError(f"no checkpoints under {self.workdir!r}")
        self.runner = self._make_runner()
        store = CheckpointStore(Path(self.workdir) / "checkpoints")
        restored = store.restore_latest(self.runner.checkpoint_tree())
        store.close()
        if restored is None:
            raise FileNotFoundError(f"no readable checkpoint under {self.workdir!r}/checkpoints")
        self.runner.load_checkpoint_tree(restored["state"])
        return restored["step"]

    def evaluate(self, n: int | None = None) -> dict[str, Any]:
        """Offline metrics of the current generator (see `paragan_jax.metrics`)."""
        out = evaluate_samples(self.samples(n), self.dataset)
        return {"step": self.runner.step, **out}
