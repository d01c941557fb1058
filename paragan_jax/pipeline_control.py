"""The input pipeline's settings and its controller: workers and prefetch depth from measurements.

`PipelineConfig` holds the settings of `paragan_jax.pipeline.InputPipeline` (a frozen dataclass:
YAML and ``key=value`` overrides load it through `tapas_jax.config.load_config`, e.g. as the
``pipeline`` section of ``python -m paragan_jax bench-pipeline``).

The consumer's ``next()`` records how long the training step waited for input; together with the
storage's measured fetch latencies this feeds `AimdController`, which every
``control_interval`` steps sets the number of active workers and the prefetch depth:

* starving (input wait above ``wait_high`` of the interval): additive increase of workers,
  jumping straight to the Little's-law concurrency ``rate x latency x headroom`` when that is
  higher (latency of the interval's own fetches, so a congestion onset is seen within one
  interval), and depth grown to hold those fetches plus a spare batch; no increase of workers
  past twice that need (the wait then has another cause);
* comfortable (wait below ``wait_low`` with the buffer full, or workers above twice the
  Little's-law need): multiplicative decrease of workers, never below the need x headroom;
  depth one lower whenever the consumer keeps finding the window full, but never below
  what holds the Little's-law concurrency plus one ready batch, nor below what covers the
  tail: a batch is ready only when its slowest fetch is, so the window holds ``rate x p95
  latency x headroom`` examples besides the batch being consumed.

A fixed pipeline is the same machinery with ``adaptive=False``.
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["AimdController", "Observation", "PipelineConfig"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Input pipeline settings."""

    batch_size: int = 32
    """Examples per batch on this process."""
    num_workers: int = 4
    """Fetch threads at start (fixed pipeline: always)."""
    prefetch_depth: int = 2
    """Batches the pipeline may work on ahead of the consumer, at start."""
    adaptive: bool = True
    """Let the controller change workers and depth."""
    min_workers: int = 1
    """Lower bound on fetch threads."""
    max_workers: int = 128
    """Upper bound on fetch threads."""
    min_depth: int = 1
    """Lower bound on prefetch depth."""
    max_depth: int = 32
    """Upper bound on prefetch depth (the memory cap may bound it lower)."""
    memory_cap_bytes: int = 256 * 2**20
    """Most bytes of batches buffered (being filled or ready) at any time."""
    control_interval: int = 4
    """Steps between controller decisions."""
    wait_high: float = 0.03
    """Input-wait fraction of the interval above which the pipeline is starving."""
    wait_low: float = 0.005
    """Input-wait fraction below which the pipeline may shrink."""
    additive_workers: int = 2
    """Workers added per starving interval."""
    decrease_factor: float = 0.75
    """Multiplicative decrease of workers when over-provisioned."""
    headroom: float = 1.5
    """Little's-law concurrency is multiplied by this when growing."""
    shuffle: bool = True
    """Shuffle each epoch with a permutation seeded by (seed, epoch)."""
    seed: int = 0
    """Shuffle seed."""
    drop_remainder: bool = False
    """Drop the last short batch of the epoch (its examples are then skipped)."""

    def __post_init__(self):
        checks = [
            ("batch_size", self.batch_size >= 1),
            ("min_workers", self.min_workers >= 1),
            ("max_workers", self.max_workers >= self.min_workers),
            ("num_workers", self.min_workers <= self.num_workers <= self.max_workers),
            ("min_depth", self.min_depth >= 1),
            ("max_depth", self.max_depth >= self.min_depth),
            ("prefetch_depth", self.min_depth <= self.prefetch_depth <= self.max_depth),
            ("memory_cap_bytes", self.memory_cap_bytes > 0),
            ("control_interval", self.control_interval >= 1),
            ("wait_low", 0 <= self.wait_low <= self.wait_high),
            ("decrease_factor", 0 < self.decrease_factor < 1),
            ("additive_workers", self.additive_workers >= 1),
            ("headroom", self.headroom >= 1),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"PipelineConfig.{name}={getattr(self, name)!r} is out of range")


@dataclasses.dataclass(frozen=True)
class Observation:
    """What the controller sees over one control interval."""

    wall_s: float
    """Wall time of the interval."""
    wait_s: float
    """Time the consumer blocked in ``next()``."""
    steps: int
    """Batches consumed."""
    examples: int
    """Examples consumed."""
    fetch_latency_s: float
    """Mean recent fetch latency."""
    full_fraction: float
    """Fraction of ``next()`` calls that found the window's ready batches at depth - 1 or more."""
    fetch_latency_p95_s: float = 0.0
    """95th percentile of the recent fetch latencies (0: unknown; the mean stands in)."""

    @property
    def wait_fraction(self) -> float:
        """Share of the interval the consumer waited for input."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def demand_rate(self) -> float:
        """Examples the consumer takes per second while it is not waiting (what input must
        keep up with; the storage's own throughput is lower while it starves the consumer)."""
        return self.examples / max(self.wall_s - self.wait_s, 1e-9)


class AimdController:
    """Additive-increase / multiplicative-decrease of workers and depth, with a Little's-law floor.

    Args:
      config: bounds and gains.
      batch_bytes: bytes of one batch (depth is capped at ``memory_cap_bytes // batch_bytes``).
    """

    def __init__(self, config: PipelineConfig, batch_bytes: int):
        self.config = config
        self.max_depth = min(config.max_depth, config.memory_cap_bytes // max(1, batch_bytes))
        if self.max_depth < 1:
            raise ValueError(
                f"memory cap {config.memory_cap_bytes} B is smaller than one batch "
                f"({batch_bytes} B); raise memory_cap_bytes or lower batch_size"
            )
        self.workers = config.num_workers
        self.depth = max(1, min(config.prefetch_depth, self.max_depth))
        self.history: list[tuple[int, int, float]] = []

    def needed_workers(self, obs: Observation) -> float:
        """Little's law: fetches in flight = consumption rate (when not waiting) x latency."""
        return obs.demand_rate * obs.fetch_latency_s

    def update(self, obs: Observation) -> tuple[int, int]:
        """One decision; returns the new ``(workers, depth)``."""
        cfg = self.config
        wait_frac = obs.wait_fraction
        target = math.ceil(self.needed_workers(obs) * cfg.headroom)
        workers, depth = self.workers, self.depth
        if wait_frac > cfg.wait_high:
            # Concurrency is what is short; past twice the Little's-law need the wait comes
            # from elsewhere (CPU, stacking, one slow fetch holding a batch), so hold.
            if workers < 2 * target + cfg.additive_workers:
                workers = max(workers + cfg.additive_workers, target)
            depth = max(depth + 1, math.ceil(workers / cfg.batch_size) + 1)
        else:
            if (wait_frac < cfg.wait_low and obs.full_fraction >= 0.5) or workers > 2 * target:
                workers = max(math.floor(workers * cfg.decrease_factor), target)
            if obs.full_fraction >= 0.5:  # the consumer keeps finding the window full
                depth -= 1
        workers = int(min(max(workers, cfg.min_workers), cfg.max_workers))
        # The window must hold the fetches the need calls for plus one ready batch; a shallower
        # window would cap concurrency below it. It must also cover the tail: a batch waits for
        # its slowest fetch, so the batches ahead of the consumer hold rate x p95 latency.
        tail = max(obs.fetch_latency_p95_s, obs.fetch_latency_s)
        tail_slots = obs.demand_rate * tail * cfg.headroom
        slots = max(min(target, workers), tail_slots)
        floor = max(cfg.min_depth, math.ceil(slots / cfg.batch_size) + 1)
        depth = int(min(max(depth, floor), self.max_depth))
        # Threads beyond what the window can keep busy would only idle.
        workers = min(workers, max(cfg.min_workers, depth * cfg.batch_size))
        self.workers, self.depth = workers, depth
        self.history.append((workers, depth, wait_frac))
        return workers, depth
