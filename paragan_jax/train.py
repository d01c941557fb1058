"""The `Trainer`: a GAN run from a `TrainConfig`, with data, mesh, checkpoints, logs and samples.

The Trainer picks a runner for the config's scheme (`paragan_jax.steps.SyncRunner` or
`paragan_jax.async_scheme.AsyncRunner`; both build their state with `paragan_jax.state`) and
drives it with the one step loop, `paragan_jax.loop.run_steps`; this module adds only what a run
around the loop needs: resume from the newest checkpoint, TensorBoard scalars, a progress bar,
periodic and final checkpoints, sample grids and offline metrics. Only the commands use it
(``train``, ``eval``, ``bench``; ``bench-step`` times the step of `Trainer.make_runner`).

Evaluation during training: every ``eval.every`` steps the (EMA) generator draws
``eval.num_samples`` samples (the same latents each time) and `paragan_jax.metrics` scores them
(FD, KID and classifier score; mode coverage on mixtures) into TensorBoard's ``eval/`` scalars;
every ``eval.sample_every`` steps a sample grid goes to TensorBoard's image tab (``samples``) and to
``<workdir>/samples_step<N>.png``; the final grid of a run goes to both as well. The time these
take counts in the run's ``wall_s``.

Multi-host: with several processes joined by `jax.distributed` (a TPU pod slice, or
``python -m paragan_jax train --num-processes N`` on one machine) every process runs the same
Trainer on the global mesh and takes part in every checkpoint save and restore, while only process
0 writes TensorBoard events, ``config.yaml``, sample grids, the progress bar and the lock file
(`paragan_jax.workdir`). With ``data.source=shards`` each process reads only its own shards and
feeds its share of the global batch (`paragan_jax.train_data`, which also says what the metrics
compare against). The workdir may be ``gs://bucket/run``. A SIGTERM stops the run at a step
boundary agreed by all processes; the final checkpoint is saved at that step and ``train``
returns ``preempted_at`` (the CLI exits 0; rerunning the command resumes there).

Runner interface the Trainer relies on (beyond the loop's ``run_step`` / ``end_step``): ``step``
(G steps done), ``fns`` (`paragan_jax.steps.GANFunctions`, for sampling), ``checkpoint_tree()``
and ``load_checkpoint_tree(tree)`` (the checkpointed pytree), ``sampling_params()`` (EMA params
and G statistics) and ``close()``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from omegaconf import OmegaConf
from tensorboardX import SummaryWriter
from tqdm import tqdm

from tapas_jax.config import ConfigError, config_to_dict
from tapas_jax.mesh import make_mesh

from .async_scheme import AsyncRunner, check_async_mesh
from .checkpoint import CheckpointStore, as_path, tree_sha256
from .config import TrainConfig, validate_config
from .data import Dataset, PrefetchLoader
from .loop import grouped, run_steps
from .metrics import evaluate_samples, load_or_train_classifier, render_samples, write_png
from .state import check_batch_divides
from .steps import SyncRunner, sample_images
from .train_data import load_train_data, reference_dataset
from .workdir import PreemptionWatch, WorkdirLock, is_primary, prepare_workdir

__all__ = ["BatchIteratorFactory", "Trainer"]

log = logging.getLogger("paragan_jax")

BatchIteratorFactory = Callable[..., Iterator[dict[str, np.ndarray]]]


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
            if jax.process_count() > 1 and jax.default_backend() == "cpu":
                raise ConfigError(
                    "scheme=async in a multi-process CPU run: the Trainer's async groups would "
                    "live in different processes, and XLA:CPU cannot move arrays between them; "
                    "train scheme=sync here, or compare the two-process async scheme with "
                    "'python -m paragan_jax bench --processes'"
                )
            check_async_mesh(config, self.mesh)
        else:
            check_batch_divides(config, self.mesh)
        self.data = load_train_data(
            config, self.mesh, jax.process_index(), jax.process_count(), config.scheme == "sync"
        )
        self.batch_iterator_factory = batch_iterator_factory
        self.runner = None
        self._reference: Dataset | None = None  # the metrics' real examples, at the first eval
        self._classifier = None  # the metrics' feature classifier, loaded at the first eval

    @property
    def dataset(self) -> Dataset:
        """The examples this process's loader reads (``self.data.dataset``)."""
        return self.data.dataset

    def make_runner(self) -> SyncRunner | AsyncRunner:
        """A fresh runner of the config's scheme on the Trainer's mesh, fed this process's
        batches (what `train` and `restore` use; ``bench-step`` times its steps)."""
        shape = self.dataset.images.shape[1:]
        if self.config.scheme == "async":
            return AsyncRunner(self.config, self.mesh, shape)
        return SyncRunner(self.config, self.mesh, shape, local_batches=self.data.local)

    def _iterator(self, start: int):
        d = self.data
        if self.batch_iterator_factory is not None:
            return self.batch_iterator_factory(d.dataset, d.batch_size, d.seed, start)
        return PrefetchLoader(d.dataset, d.batch_size, d.seed, start, self.config.data.prefetch)

    def reference(self) -> Dataset:
        """The real examples the metrics compare against (`paragan_jax.train_data`), read at
        the first call."""
        if self._reference is None:
            self._reference = reference_dataset(self.config, self.dataset)
        return self._reference

    def _meta(self, position: int) -> dict[str, Any]:
        return {
            "step": self.runner.step,
            "data_position": position,
            # Global batch i depends on these with per-process reading (`TrainData.local`).
            "process_count": jax.process_count(),
            "local_data": self.data.local,
            "scheme": self.config.scheme,
            "config": config_to_dict(self.config),
        }

    def train(self, steps: int | None = None, seconds: float | None = None) -> dict[str, Any]:
        """Trains up to `steps` G steps in total (default ``config.steps``), resuming if a
        checkpoint exists in the workdir. Every process of a multi-process run calls it.

        Args:
          steps: total G steps to reach.
          seconds: stop early once this much wall-clock time has passed after the first
            (compiling) step; used to compare schemes at equal time.

        Returns:
          Summary: ``step``, ``resumed_from``, ``steps_run``, ``wall_s`` and ``steps_per_sec``
          (both excluding the first, compiling step), ``compile_s``, last ``metrics``,
          ``sample_grid`` (PNG path or None), ``preempted_at`` (the step a SIGTERM stopped the
          run at, else None).

        Raises:
          OSError: the workdir cannot be created or written, or another run holds it.
        """
        workdir = prepare_workdir(self.workdir) if self.workdir else None
        if workdir is None:
            with PreemptionWatch() as watch:
                return self._train(None, steps, seconds, watch)
        with WorkdirLock(workdir), PreemptionWatch() as watch:
            return self._train(workdir, steps, seconds, watch)

    def _restore_into(self, store: CheckpointStore) -> dict[str, Any] | None:
        runner = self.runner
        restored = store.restore_latest(
            runner.checkpoint_tree(), optional=runner.optional_checkpoint_keys
        )
        if restored is None:
            return None
        if restored["missing"]:
            msg = (
                f"checkpoint step {restored['step']} predates {restored['missing']} in "
                "checkpoints: restored without them (rebuilt from the restored state), so this "
                "resume is not bit for bit"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            log.warning(msg)
        runner.load_checkpoint_tree(restored["state"])
        return restored

    def _check_data_layout(self, meta: dict[str, Any], step: int) -> None:
        """Warns if the checkpoint was written by a run whose data layout (process count,
        per-process reading) differs from this one's: its data position then names other
        batches (`paragan_jax.train_data`). Checkpoints from before these keys pass silently."""
        saved = {k: meta[k] for k in ("process_count", "local_data") if k in meta}
        now = {"process_count": jax.process_count(), "local_data": self.data.local}
        if all(saved[k] == now[k] for k in saved):
            return
        msg = (
            f"checkpoint step {step} was written with process_count={meta.get('process_count')}, "
            f"local_data={meta.get('local_data')}; this run has process_count="
            f"{now['process_count']}, local_data={now['local_data']}: resuming at its data "
            "position, but the batches from there differ from those the saved run would have read"
        )
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        log.warning(msg)

    def _train(self, workdir, steps, seconds, watch: PreemptionWatch) -> dict[str, Any]:
        cfg = self.config
        total = cfg.steps if steps is None else steps
        primary = is_primary()
        self.runner = runner = self.make_runner()
        store = writer = None
        position, resumed = 0, None
        if workdir is not None:
            if cfg.checkpoint.enabled:
                store = CheckpointStore(
                    workdir / "checkpoints", keep=cfg.checkpoint.keep, every=cfg.checkpoint.every
                )
                restored = self._restore_into(store)
                if restored is not None:
                    position = int(restored["meta"]["data_position"])
                    resumed = restored["step"]
                    self._check_data_layout(restored["meta"], resumed)
                    log.info("resumed from step %d (data position %d)", resumed, position)
            if primary:
                writer = SummaryWriter(str(workdir / "tb"))
                (workdir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        loader = self._iterator(position)
        start = runner.step
        logged: set[tuple[str, int]] = set()  # (eval or grid, step) written during the loop
        bar = tqdm(
            total=total,
            initial=start,
            disable=not (self.progress and primary),
            desc=cfg.name,
            unit="step",
            dynamic_ncols=True,
        )

        def on_step(done: int, metrics: dict[str, jax.Array]) -> bool:
            step = start + done
            if writer is not None and (step % cfg.eval.log_every == 0 or step == total):
                scalars = {k: float(v) for k, v in jax.device_get(metrics).items()}
                for k, v in scalars.items():
                    writer.add_scalar(f"train/{k}", v, step)
                bar.set_postfix({k: f"{v:.3f}" for k, v in scalars.items()}, refresh=False)
            bar.update(1)
            if watch.should_stop(step):
                return True  # the final save below writes this step
            if workdir is not None and step < total:  # the end of the run does its own
                logged.update(self._periodic_eval(step, workdir, writer))
            if store is not None and store.should_save(step):
                store.save(step, runner.checkpoint_tree(), self._meta(position + cfg.n_disc * done))
            return False

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
        if watch.stopped_at is not None and primary:
            log.warning("SIGTERM: stopped at step %d and saved a checkpoint", watch.stopped_at)
        grid = None
        if workdir is not None:
            step = runner.step
            ev = cfg.eval
            preempted = watch.stopped_at is not None  # leave soon: no evaluation
            if ev.every and step % ev.every == 0 and ("eval", step) not in logged and not preempted:
                self.log_eval(step, writer)
            grid = str(workdir / f"samples_step{step}.png")
            self.sample_grid(grid, writer=None if ("grid", step) in logged else writer)
            if writer is not None:
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
            "preempted_at": watch.stopped_at,
        }

    def _periodic_eval(self, step: int, workdir, writer: SummaryWriter | None) -> set:
        """``eval.every`` / ``eval.sample_every`` at `step`; returns what it wrote."""
        ev, done = self.config.eval, set()
        if ev.every and step % ev.every == 0:
            self.log_eval(step, writer)
            done.add(("eval", step))
        if ev.sample_every and step % ev.sample_every == 0:
            self.sample_grid(str(workdir / f"samples_step{step}.png"), writer=writer)
            done.add(("grid", step))
        return done

    def log_eval(self, step: int, writer: SummaryWriter | None) -> dict[str, float] | None:
        """Scores ``eval.num_samples`` samples of the current generator and writes the metrics
        as ``eval/<name>`` scalars at `step`. Every process samples (the generator may be spread
        over them); process 0 scores and writes, and gets the metrics back (the others None)."""
        samples = self.samples()
        if not is_primary():
            return None
        real = self.reference()
        if self._classifier is None and not real.is_mixture:
            self._classifier = load_or_train_classifier(real)[0]
        out = evaluate_samples(samples, real, classifier=self._classifier)
        out = {k: float(v) for k, v in out.items() if k != "classifier_accuracy"}
        if writer is not None:
            for k, v in out.items():
                writer.add_scalar(f"eval/{k}", v, step)
        log.info("eval at step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in out.items()))
        return out

    def samples(self, n: int | None = None, seed: int = 1234) -> np.ndarray:
        """Samples from the trained (EMA) generator; call after `train` or `restore`."""
        if self.runner is None:
            raise RuntimeError("no trained state: call train() or restore() first")
        params, stats = self.runner.sampling_params()
        n = n or self.config.eval.num_samples
        return sample_images(self.runner.fns, params, stats, jax.random.PRNGKey(seed), n)

    def sample_grid(self, path: str, seed: int = 1234, writer: SummaryWriter | None = None) -> str:
        """Writes a sample grid (images) or scatter plot (mixtures) PNG, and to `writer`'s image
        tab (tag ``samples``, at the current step) if one is given; returns the PNG's path.

        Every process samples (the generator may be spread over them); process 0 writes."""
        rows = self.config.eval.grid_rows
        if self.dataset.is_mixture:
            pts = self.samples(2000, seed)
            real = np.asarray(self.dataset.images[:2000])
            title = f"{self.config.name} step {self.runner.step}"
            image = render_samples(pts, real=real, title=title) if is_primary() else None
        else:
            grid = self.samples(rows * rows, seed)
            image = render_samples(grid, rows=rows) if is_primary() else None
        if image is not None:
            write_png(image, path)
            if writer is not None:
                writer.add_image("samples", image, self.runner.step, dataformats="HWC")
        return path

    def restore(self) -> int:
        """Loads the latest checkpoint of the workdir (for eval/sample); returns its step."""
        ckpt = as_path(self.workdir) / "checkpoints" if self.workdir else None
        if ckpt is None or not ckpt.is_dir():
            raise FileNotFoundError(f"no checkpoints under {self.workdir!r}")
        self.runner = self.make_runner()
        store = CheckpointStore(ckpt)
        restored = self._restore_into(store)
        store.close()
        if restored is None:
            raise FileNotFoundError(f"no readable checkpoint under {self.workdir!r}/checkpoints")
        return restored["step"]

    def state_sha256(self) -> str:
        """SHA-256 over every array of the runner's checkpointed state, in tree order (two runs
        that agree bit for bit give the same digest)."""
        return tree_sha256(self.runner.checkpoint_tree())

    def evaluate(self, n: int | None = None) -> dict[str, Any]:
        """Offline metrics of the current generator (see `paragan_jax.metrics`)."""
        out = evaluate_samples(self.samples(n), self.reference())
        return {"step": self.runner.step, **out}
