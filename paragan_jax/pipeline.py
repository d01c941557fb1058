"""Congestion-aware input pipeline: worker threads and prefetch depth adapted from measurements.

Design (threads, not Grain: Grain fixes its worker and thread counts when an iterator is built,
and the whole point here is to change them while training runs):

- `epoch_indices` gives each process its share of a seeded per-epoch permutation (strided, so the
  shares are disjoint and together cover the data set). Within an epoch every example of a host's
  share is fetched exactly once; with ``drop_remainder=False`` the last batch may be short, so no
  example is lost.
- `BatchStream` (from `InputPipeline.epoch` or the endless `InputPipeline.batches`) runs a pool
  of fetch threads over a window of batches, continuing across epoch boundaries. Examples are
  fetched one at a time (``storage.fetch(i)``) so that a slow fetch only delays its own slot; the
  thread that fills a batch's last slot stacks it. Batches come out in order; ``position`` is the
  ``(epoch, batch)`` to resume from.
- The window is ``prefetch_depth`` batches ahead of the consumer, and every batch that has started
  reserves its full size against ``memory_cap_bytes``: buffered bytes (batches being filled plus
  ready ones) never exceed the cap.
- The consumer's ``next()`` records how long the training step waited for input; together with the
  storage's measured fetch latencies this feeds the controller
  (`paragan_jax.pipeline_control.AimdController`), which every ``control_interval`` steps sets
  the number of active workers and the prefetch depth. A fixed pipeline is the same machinery
  with ``adaptive=False``.

The controller's wait signal assumes the training loop keeps at most one step in flight (it
blocks on step i-1's output before asking for step i+1's batch, as `paragan_jax.loop.run_steps`,
the loop of the Trainer and of the benchmarks, does); a loop that dispatches many steps ahead
drains the buffer at dispatch speed, and the wait then counts queued device time.
`trainer_batch_iterator_factory` puts the pipeline behind the Trainer's loader seam with the
trainer's exact batches.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np

from .pipeline_control import AimdController, Observation, PipelineConfig
from .storage import Example, InMemoryStorage, Storage

__all__ = [
    "BatchStream",
    "InputPipeline",
    "epoch_indices",
    "epoch_order",
    "trainer_batch_iterator_factory",
]


@functools.lru_cache(maxsize=4)
def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of one epoch: a permutation seeded by ``[seed, epoch]`` (read-only).

    Kept for the last few epochs asked for: drawing it costs O(data set) (27 ms for ImageNet's
    1.28M examples), and every batch of an epoch needs it.
    """
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    order.flags.writeable = False
    return order


def epoch_indices(
    num_examples: int,
    epoch: int,
    seed: int = 0,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
) -> np.ndarray:
    """This process's example indices for one epoch.

    All processes draw the same permutation (`epoch_order`) and take every ``process_count``-th
    entry from ``process_index``: the shares are disjoint and cover the set.
    """
    if num_examples < 1:
        raise ValueError(f"the data set is empty (num_examples={num_examples})")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index {process_index} not in [0, {process_count})")
    if shuffle:
        order = epoch_order(num_examples, seed, epoch)
    else:
        order = np.arange(num_examples)
    return order[process_index::process_count]


class BatchStream(Iterator[Example]):
    """Batches over one or more epochs, in order, from a pool of fetch threads.

    The stream keeps fetching across epoch boundaries (the next epoch's permutation is drawn when
    the window reaches it), so a long run never drains its buffer at the end of an epoch.

    Args:
      pipeline: the owning `InputPipeline` (storage, config, controller, counters).
      start_epoch: epoch of the first batch.
      start_batch: batch within that epoch (resume position).
      num_epochs: epochs to serve; None for an endless stream.
    """

    def __init__(
        self,
        pipeline: InputPipeline,
        start_epoch: int = 0,
        start_batch: int = 0,
        num_epochs: int | None = None,
    ):
        self._p = pipeline
        self._storage = pipeline.storage
        self._batch_bytes = pipeline.batch_bytes
        self._last_epoch = None if num_epochs is None else start_epoch + num_epochs - 1
        # Planned batches: global batch number -> (epoch, batch in epoch, example indices).
        self._plan: dict[int, tuple[int, int, np.ndarray]] = {}
        self._planned = 0
        self._plan_epoch = start_epoch
        self._extend_plan(skip=start_batch)
        # One lock, three queues: the consumer, active workers, parked workers (so a wake-up
        # meant for a worker with a task is never swallowed by one that is parked).
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        self._work_cv = threading.Condition(self._lock)
        self._park_cv = threading.Condition(self._lock)
        self._task = (0, 0)  # next (batch, slot) to hand out
        self._consumed = 0
        self._slots: dict[int, list[Example | None]] = {}
        self._filled: dict[int, int] = {}
        self._ready: dict[int, Example] = {}
        self._error: BaseException | None = None
        self._stop = False
        self._threads: list[threading.Thread] = []
        self._new_interval(time.perf_counter())
        self._ensure_threads(pipeline.controller.workers)

    # ---- plan ----------------------------------------------------------------------------------
    def _extend_plan(self, skip: int = 0) -> bool:
        """Appends the batches of the next epoch; False when the stream has no more epochs."""
        epoch = self._plan_epoch
        if self._last_epoch is not None and epoch > self._last_epoch:
            return False
        cfg = self._p.config
        idx = self._p.indices(epoch)
        b = cfg.batch_size
        nb = len(idx) // b if cfg.drop_remainder else math.ceil(len(idx) / b)
        if not 0 <= skip <= nb:
            raise ValueError(f"start_batch {skip} not in [0, {nb}] for epoch {epoch}")
        for k in range(skip, nb):
            self._plan[self._planned] = (epoch, k, idx[k * b : (k + 1) * b])
            self._planned += 1
        self._plan_epoch += 1
        return True

    def _has_batch(self, batch: int) -> bool:
        while batch >= self._planned:
            if not self._extend_plan():
                return False
        return True

    # ---- worker side -------------------------------------------------------------------------
    def _reserved(self) -> int:
        return len(self._slots) + len(self._ready)

    def _task_allowed(self) -> bool:
        batch = self._task[0]
        if batch >= self._consumed + self._p.controller.depth or not self._has_batch(batch):
            return False
        if batch in self._slots:
            return True
        return (self._reserved() + 1) * self._batch_bytes <= self._p.config.memory_cap_bytes

    def _ensure_threads(self, n: int) -> None:
        while len(self._threads) < n:
            t = threading.Thread(
                target=self._work,
                args=(len(self._threads),),
                daemon=True,
                name=f"paragan-fetch-{len(self._threads)}",
            )
            self._threads.append(t)
            t.start()

    def _work(self, wid: int) -> None:
        while True:
            with self._lock:
                while not self._stop:
                    if wid >= self._p.controller.workers:
                        self._park_cv.wait()
                    elif not self._task_allowed():
                        self._work_cv.wait()
                    else:
                        break
                if self._stop:
                    return
                batch, slot = self._task
                indices = self._plan[batch][2]
                self._task = (batch, slot + 1) if slot + 1 < len(indices) else (batch + 1, 0)
                if batch not in self._slots:
                    self._slots[batch] = [None] * len(indices)
                    self._filled[batch] = 0
                    self._p._note_buffer(self._reserved() * self._batch_bytes)
                if self._task_allowed():
                    self._work_cv.notify()  # pass the baton: another task is waiting
            try:
                ex = self._storage.fetch(int(indices[slot]))
            except BaseException as e:  # surfaced to the consumer
                with self._lock:
                    self._error = e
                    self._cv.notify_all()
                return
            with self._lock:
                slots = self._slots[batch]
                slots[slot] = ex
                self._filled[batch] += 1
                complete = self._filled[batch] == len(slots)
            if complete:
                stacked = {k: np.stack([s[k] for s in slots]) for k in slots[0]}
                with self._lock:
                    del self._slots[batch], self._filled[batch]
                    self._ready[batch] = stacked
                    self._cv.notify()

    # ---- consumer side -----------------------------------------------------------------------
    def __next__(self) -> Example:
        t0 = time.perf_counter()
        with self._lock:
            if not self._has_batch(self._consumed):
                self._stop_locked()
                raise StopIteration
            full = len(self._ready) >= max(1, self._p.controller.depth - 1)
            while self._consumed not in self._ready and self._error is None:
                self._cv.wait()
            if self._error is not None:
                err = self._error
                self._stop_locked()
                raise RuntimeError(f"input pipeline fetch failed: {err!r}") from err
            batch = self._ready.pop(self._consumed)
            del self._plan[self._consumed]
            self._consumed += 1
            self._work_cv.notify(self._p.config.batch_size)  # one more batch fits the window
        waited = time.perf_counter() - t0
        self._account(waited, len(next(iter(batch.values()))), full)
        return batch

    def _new_interval(self, now: float) -> None:
        self._interval = {
            "t0": now,
            "wait": 0.0,
            "steps": 0,
            "examples": 0,
            "full": 0,
            "fetches": self._storage.stats.count,
        }

    def _account(self, waited: float, examples: int, full: bool) -> None:
        p = self._p
        p.total_wait_s += waited
        p.steps += 1
        iv = self._interval
        iv["wait"] += waited
        iv["steps"] += 1
        iv["examples"] += examples
        iv["full"] += int(full)
        if not p.config.adaptive or iv["steps"] < p.config.control_interval:
            return
        now = time.perf_counter()
        lat = self._storage.stats.recent()
        fetches = self._storage.stats.count - iv["fetches"]
        # Latency of this interval's fetches: reacts within one interval to a change.
        window = lat[-min(256, max(fetches, 16)) :]
        obs = Observation(
            wall_s=now - iv["t0"],
            wait_s=iv["wait"],
            steps=iv["steps"],
            examples=iv["examples"],
            fetch_latency_s=float(window.mean()) if window.size else 0.0,
            full_fraction=iv["full"] / iv["steps"],
            fetch_latency_p95_s=float(np.percentile(window, 95)) if window.size else 0.0,
        )
        with self._lock:
            before = p.controller.workers, p.controller.depth
            workers, depth = p.controller.update(obs)
            self._ensure_threads(workers)
            # Wake threads only when there is more for them to do: a wake-up of every parked
            # or idle thread each interval costs the host the CPU the training step needs.
            if depth > before[1] or workers > before[0]:
                self._work_cv.notify_all()
            if workers > before[0]:
                self._park_cv.notify_all()
        p.trace.append(
            {
                "step": p.steps,
                "time_s": now - p.t_start,
                "workers": workers,
                "depth": p.controller.depth,
                "wait_frac": obs.wait_fraction,
                "fetch_latency_s": obs.fetch_latency_s,
            }
        )
        self._new_interval(now)

    @property
    def pipeline(self) -> InputPipeline:
        """The owning pipeline: its controller (workers, depth), counters and trace."""
        return self._p

    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, batch in epoch)`` of the next batch to be served (resume from it)."""
        with self._lock:
            if self._has_batch(self._consumed):
                epoch, k, _ = self._plan[self._consumed]
                return epoch, k
            return self._plan_epoch, 0

    def _stop_locked(self) -> None:
        self._stop = True
        self._work_cv.notify_all()
        self._park_cv.notify_all()

    def close(self) -> None:
        """Stops the fetch threads (idempotent)."""
        with self._lock:
            self._stop_locked()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=30)

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class InputPipeline:
    """Batches from a `Storage`, with this process's shard of each epoch.

    Args:
      storage: where examples come from.
      config: pipeline settings.
      process_index: this process (defaults to ``jax.process_index()``).
      process_count: processes sharing the data set (defaults to ``jax.process_count()``).
      epoch_size: examples served per epoch, the first of each epoch's permutation (default:
        all of this process's share). A `paragan_jax.shards.ShardedStorage` holds only its own
        process's shards: pass ``process_index=0, process_count=1`` and its ``epoch_size``, so
        every process serves the same number of batches.
    """

    def __init__(
        self,
        storage: Storage,
        config: PipelineConfig,
        process_index: int | None = None,
        process_count: int | None = None,
        epoch_size: int | None = None,
    ):
        if process_index is None or process_count is None:
            import jax

            process_index = jax.process_index() if process_index is None else process_index
            process_count = jax.process_count() if process_count is None else process_count
        self.storage = storage
        self.config = config
        self.process_index = process_index
        self.process_count = process_count
        if epoch_size is not None and not 1 <= epoch_size <= len(storage):
            raise ValueError(f"epoch_size {epoch_size} not in [1, {len(storage)}]")
        self.epoch_size = epoch_size
        self.batch_bytes = storage.example_nbytes() * config.batch_size
        self.controller = AimdController(config, self.batch_bytes)
        self.peak_buffer_bytes = 0
        self.total_wait_s = 0.0
        self.steps = 0
        self.t_start = time.perf_counter()
        self.trace: list[dict[str, float]] = []
        self._lock = threading.Lock()

    def _note_buffer(self, nbytes: int) -> None:
        with self._lock:
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, nbytes)

    def indices(self, epoch: int) -> np.ndarray:
        """This process's examples for `epoch`, in the order they are served."""
        idx = epoch_indices(
            len(self.storage),
            epoch,
            self.config.seed,
            self.config.shuffle,
            self.process_index,
            self.process_count,
        )
        return idx if self.epoch_size is None else idx[: self.epoch_size]

    def epoch(self, epoch: int, start_batch: int = 0) -> BatchStream:
        """The batches of one epoch (resumable at a batch position)."""
        return BatchStream(self, epoch, start_batch, num_epochs=1)

    def batches(self, start_epoch: int = 0, start_batch: int = 0) -> BatchStream:
        """An endless stream of batches over successive epochs, prefetching across boundaries."""
        return BatchStream(self, start_epoch, start_batch, num_epochs=None)


def trainer_batch_iterator_factory(
    config: PipelineConfig | None = None,
    wrap_storage: Callable[[Storage], Storage] | None = None,
) -> Callable[..., BatchStream]:
    """A ``batch_iterator_factory`` for `paragan_jax.train.Trainer` backed by this pipeline.

    The batches are exactly those of the trainer's default loader (`paragan_jax.data.batch_at`:
    permutation seeded by ``(seed, epoch)``, the data set's ``epoch_size`` first examples of it,
    full batches only), so checkpoints resume the same way; only how they are fetched changes
    (adaptive workers and depth, memory cap).

    Args:
      config: pipeline settings (batch size, seed, shuffle and remainder are taken from the
        trainer); defaults to `PipelineConfig()`.
      wrap_storage: optional wrapper around the in-memory data set, e.g.
        ``lambda s: EmulatedRemoteStorage(s, seed=0)`` to train against the emulated store.

    Returns:
      ``factory(dataset, batch_size, seed, start) -> BatchStream``.
    """
    base = config or PipelineConfig()

    def factory(dataset, batch_size: int, seed: int, start: int = 0) -> BatchStream:
        storage: Storage = InMemoryStorage({"image": dataset.images, "label": dataset.labels})
        if wrap_storage is not None:
            storage = wrap_storage(storage)
        size = dataset.examples_per_epoch
        per_epoch = size // batch_size
        if per_epoch < 1:
            raise ValueError(f"data set of {size} examples is smaller than one batch")
        cfg = dataclasses.replace(
            base,
            batch_size=batch_size,
            seed=seed,
            shuffle=True,
            drop_remainder=True,
            num_workers=min(max(base.num_workers, base.min_workers), base.max_workers),
        )
        epoch, k = divmod(start, per_epoch)
        pipe = InputPipeline(storage, cfg, 0, 1, epoch_size=dataset.epoch_size)
        return pipe.batches(epoch, k)

    return factory
