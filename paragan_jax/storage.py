"""Storage backends for the input pipeline, with the latency of every fetch measured.

Two backends share one interface (`Storage`): ``fetch(index) -> Example`` and ``stats()``.

- `LocalArrayStorage` reads examples from ``.npy`` files on local disk (memory-mapped, so a fetch
  reads only its own example). `write_local_dataset` writes that format.
- `EmulatedRemoteStorage` is an EMULATION of a remote object store (GCS/S3-like) built on top of
  any other backend. Real remote stores cannot be reached from this machine and ``tc netem`` is not
  available, so the latency of each fetch is drawn from a seeded model and spent with
  ``time.sleep``:

  * a base round-trip latency, log-normal around ``base_latency_s``;
  * a transfer term ``bytes / bandwidth`` (per connection);
  * rare latency spikes (probability ``spike_prob``, ``spike_latency_s``), as on real stores;
  * congestion episodes in wall-clock time: a two-state (clean / congested) process whose
    durations are exponential with seeded means; while congested every fetch is
    ``congestion_factor`` times slower. Episodes can also be given as an explicit schedule, or
    forced (tests); a `CongestionSwitch` keeps that state, the same one the loopback HTTP store
    of `paragan_jax.http_store` uses;
  * self-congestion: past ``concurrency_knee`` fetches in flight, every fetch slows in proportion
    (a shared link), so unbounded parallelism is not free.

  Every draw comes from ``numpy.random.default_rng([seed, index, attempt])`` or from the seeded
  episode generator, so two runs with one seed see the same latencies for the same fetches.

`FetchStats` keeps the per-fetch latencies measured around the real read (wall clock, including
the emulated delay), which is what the pipeline controller watches.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import numpy as np

__all__ = [
    "CongestionEpisodes",
    "CongestionSwitch",
    "EmulatedRemoteStorage",
    "Example",
    "FetchStats",
    "InMemoryStorage",
    "LocalArrayStorage",
    "Storage",
    "write_local_dataset",
]

Example = dict[str, np.ndarray]


class FetchStats:
    """Thread-safe record of fetch latencies (seconds) and bytes, with a sliding window."""

    def __init__(self, window: int = 512):
        self._lock = threading.Lock()
        self._recent: deque[float] = deque(maxlen=window)
        self.count = 0
        self.total_seconds = 0.0
        self.total_bytes = 0

    def record(self, seconds: float, nbytes: int) -> None:
        with self._lock:
            self._recent.append(seconds)
            self.count += 1
            self.total_seconds += seconds
            self.total_bytes += nbytes

    def recent(self) -> np.ndarray:
        """Latencies of the most recent fetches (up to the window size)."""
        with self._lock:
            return np.array(self._recent, dtype=np.float64)

    def summary(self) -> dict[str, float]:
        """Count, mean, p50 and p95 latency of the recent window, in seconds."""
        lat = self.recent()
        if lat.size == 0:
            return {"count": self.count, "mean_s": 0.0, "p50_s": 0.0, "p95_s": 0.0}
        return {
            "count": self.count,
            "mean_s": float(lat.mean()),
            "p50_s": float(np.percentile(lat, 50)),
            "p95_s": float(np.percentile(lat, 95)),
        }


class Storage(Protocol):
    """What the pipeline reads from."""

    def __len__(self) -> int: ...

    def fetch(self, index: int) -> Example: ...

    @property
    def stats(self) -> FetchStats: ...

    def example_nbytes(self) -> int: ...


def _nbytes(example: Example) -> int:
    return int(sum(v.nbytes for v in example.values()))


def _common_length(arrays: dict[str, np.ndarray], where: str) -> int:
    """The shared number of examples (leading axis) of `arrays`, or a ValueError naming them."""
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{where}: arrays hold different numbers of examples: {lengths}")
    return next(iter(lengths.values()))


class InMemoryStorage:
    """Examples held in host arrays (all arrays share the leading example axis)."""

    def __init__(self, arrays: dict[str, np.ndarray], where: str = "InMemoryStorage"):
        if not arrays:
            raise ValueError(f"{where} needs at least one array")
        self._n = _common_length(arrays, where)
        self._arrays = dict(arrays)
        self._stats = FetchStats()

    def __len__(self) -> int:
        return self._n

    @property
    def stats(self) -> FetchStats:
        return self._stats

    def example_nbytes(self) -> int:
        return int(sum(v[0].nbytes for v in self._arrays.values()))

    def fetch(self, index: int) -> Example:
        if not 0 <= index < self._n:
            raise IndexError(f"example {index} out of range [0, {self._n})")
        t0 = time.perf_counter()
        # np.array copies: out of the caller's arrays, or out of the mmap for local files.
        ex = {k: np.array(v[index]) for k, v in self._arrays.items()}
        self._stats.record(time.perf_counter() - t0, _nbytes(ex))
        return ex


def write_local_dataset(path: str | os.PathLike, arrays: dict[str, np.ndarray]) -> Path:
    """Writes arrays (leading axis = example) as ``<path>/<name>.npy`` for `LocalArrayStorage`."""
    root = Path(path)
    _common_length(arrays, str(root))
    root.mkdir(parents=True, exist_ok=True)
    for name, arr in arrays.items():
        np.save(root / f"{name}.npy", np.ascontiguousarray(arr))
    return root


class LocalArrayStorage(InMemoryStorage):
    """Reads one example at a time from memory-mapped ``.npy`` files in a directory."""

    def __init__(self, path: str | os.PathLike):
        root = Path(path)
        files = sorted(root.glob("*.npy"))
        if not files:
            raise FileNotFoundError(
                f"no .npy files in {str(root)!r}; write them with write_local_dataset"
            )
        super().__init__({f.stem: np.load(f, mmap_mode="r") for f in files}, where=str(root))


@dataclasses.dataclass(frozen=True)
class CongestionEpisodes:
    """Congested intervals ``[(start_s, end_s), ...]`` in seconds since the store was started.

    `CongestionEpisodes.seeded` draws them from a two-state process with exponential durations.
    """

    intervals: tuple[tuple[float, float], ...]

    def __post_init__(self):
        for lo, hi in self.intervals:
            if not 0 <= lo < hi:
                raise ValueError(f"congestion interval ({lo}, {hi}) must satisfy 0 <= start < end")

    @classmethod
    def seeded(
        cls, seed: int, horizon_s: float, mean_clean_s: float, mean_congested_s: float
    ) -> CongestionEpisodes:
        """Alternating clean/congested periods with exponential durations, starting clean."""
        if mean_clean_s <= 0 or mean_congested_s <= 0:
            raise ValueError("mean episode durations must be > 0")
        rng = np.random.default_rng([seed, 7919])
        t, out = 0.0, []
        while t < horizon_s:
            t += rng.exponential(mean_clean_s)
            dur = rng.exponential(mean_congested_s)
            out.append((t, t + dur))
            t += dur
        return cls(tuple(out))

    def congested_at(self, t: float) -> bool:
        return any(lo <= t < hi for lo, hi in self.intervals)

    def congested_fraction(self, horizon_s: float) -> float:
        """Fraction of ``[0, horizon_s)`` that is congested."""
        covered = sum(
            max(0.0, min(hi, horizon_s) - lo) for lo, hi in self.intervals if lo < horizon_s
        )
        return covered / horizon_s if horizon_s > 0 else 0.0


class CongestionSwitch:
    """Whether a store is congested now: its episodes, counted from the last `restart`, unless
    forced. Shared by the emulated store and the loopback HTTP store.

    Args:
      episodes: congested intervals (None: never congested unless forced).
      forced: True or False to force the state from the start (None: follow the episodes).
      clock: time source (monotonic seconds).
    """

    def __init__(
        self,
        episodes: CongestionEpisodes | None = None,
        forced: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.episodes = episodes
        self._forced = forced
        self._clock = clock
        self._t0 = clock()

    def restart(self, episodes: CongestionEpisodes | None = None) -> None:
        """Episodes count from now (optionally new ones)."""
        if episodes is not None:
            self.episodes = episodes
        self._t0 = self._clock()

    def set_congestion(self, congested: bool | None) -> None:
        """Forces congested (True) or clean (False); None returns to the episodes."""
        self._forced = congested

    def congested_now(self) -> bool:
        if self._forced is not None:
            return self._forced
        return self.episodes is not None and self.episodes.congested_at(self._clock() - self._t0)


class EmulatedRemoteStorage:
    """EMULATION of a remote object store: a seeded latency model in front of a real backend.

    Args:
      backend: where the bytes really come from (`LocalArrayStorage`, `InMemoryStorage`).
      seed: seeds every latency draw.
      base_latency_s: median round-trip latency of one fetch when the store is clean.
      latency_sigma: log-normal shape of the round-trip latency.
      bandwidth_bytes_per_s: per-connection transfer rate (adds ``bytes / bandwidth``).
      spike_prob: probability that a fetch hits a latency spike.
      spike_latency_s: extra latency of a spike.
      congestion_factor: latency multiplier while congested.
      episodes: congested intervals in wall-clock seconds since the switch's last restart (None:
        never, unless forced); ``congestion`` (a `CongestionSwitch`) holds them.
      concurrency_knee: fetches in flight the store serves without slowing down; past it every
        fetch is slowed by ``in_flight / knee``.
      clock: time source (monotonic seconds); `sleep`: how the delay is spent. Both injectable.
    """

    def __init__(
        self,
        backend: Storage,
        seed: int = 0,
        base_latency_s: float = 0.004,
        latency_sigma: float = 0.25,
        bandwidth_bytes_per_s: float = 200e6,
        spike_prob: float = 0.002,
        spike_latency_s: float = 0.05,
        congestion_factor: float = 5.0,
        episodes: CongestionEpisodes | None = None,
        concurrency_knee: int = 64,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ):
        for name, value in [
            ("base_latency_s", base_latency_s),
            ("bandwidth_bytes_per_s", bandwidth_bytes_per_s),
            ("congestion_factor", congestion_factor),
        ]:
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if not 0 <= spike_prob <= 1:
            raise ValueError(f"spike_prob must be in [0, 1], got {spike_prob}")
        if concurrency_knee < 1:
            raise ValueError(f"concurrency_knee must be >= 1, got {concurrency_knee}")
        self.backend = backend
        self.seed = seed
        self.base_latency_s = base_latency_s
        self.latency_sigma = latency_sigma
        self.bandwidth = bandwidth_bytes_per_s
        self.spike_prob = spike_prob
        self.spike_latency_s = spike_latency_s
        self.congestion_factor = congestion_factor
        self.congestion = CongestionSwitch(episodes, clock=clock)
        self.concurrency_knee = concurrency_knee
        self._sleep = sleep
        self._lock = threading.Lock()
        self._in_flight = 0
        self._attempts: dict[int, int] = {}
        self._stats = FetchStats()

    def __len__(self) -> int:
        return len(self.backend)

    @property
    def stats(self) -> FetchStats:
        return self._stats

    def example_nbytes(self) -> int:
        return self.backend.example_nbytes()

    def emulated_delay(
        self, index: int, attempt: int, nbytes: int, congested: bool, in_flight: int
    ) -> float:
        """The delay the model assigns to one fetch (deterministic in its arguments)."""
        rng = np.random.default_rng([self.seed, index, attempt])
        delay = self.base_latency_s * math.exp(self.latency_sigma * rng.standard_normal())
        delay += nbytes / self.bandwidth
        if congested:
            delay *= self.congestion_factor
        if in_flight > self.concurrency_knee:
            delay *= in_flight / self.concurrency_knee
        if rng.random() < self.spike_prob:  # a server-side hiccup, independent of load
            delay += self.spike_latency_s
        return delay

    def fetch(self, index: int) -> Example:
        t0 = time.perf_counter()
        with self._lock:
            attempt = self._attempts.get(index, 0)
            self._attempts[index] = attempt + 1
            self._in_flight += 1
            in_flight = self._in_flight
        try:
            nbytes = self.backend.example_nbytes()
            congested = self.congestion.congested_now()
            delay = self.emulated_delay(index, attempt, nbytes, congested, in_flight)
            self._sleep(delay)
            ex = self.backend.fetch(index)
        finally:
            with self._lock:
                self._in_flight -= 1
        self._stats.record(time.perf_counter() - t0, _nbytes(ex))
        return ex
