"""The stores ``bench-pipeline`` runs against, how it congests them, and its fixed-setting sweep.

- `EmulatedStoreControl`: the seeded latency model (`paragan_jax.storage.EmulatedRemoteStorage`);
  a run's congestion episodes are set before its warmup and count from its timed start.
- `serve_shards` + `HttpStoreControl`: the data set written as shards (`paragan_jax.shards`)
  behind the loopback object server (`paragan_jax.http_store`), read through real sockets; the
  server is clean during a run's warmup, then follows the run's episodes from its timed start.
- `fixed_sweep`: the fixed ``(workers, depth)`` settings the HTTP bench tries under the same
  congestion, so that the fixed baseline is the best of a sweep rather than one guess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .http_store import CongestionModel, ObjectServer
from .shards import ShardedStorage, write_shards
from .storage import CongestionEpisodes, EmulatedRemoteStorage

__all__ = ["EmulatedStoreControl", "HttpStoreControl", "fixed_sweep", "serve_shards"]


class EmulatedStoreControl:
    """Congestion of the emulated store for one run: `prepare` before its warmup, `start` when
    its timed part begins (episodes count from there)."""

    def __init__(self, storage: EmulatedRemoteStorage):
        self.storage = storage

    def prepare(self, episodes: CongestionEpisodes | None) -> None:
        self.storage.episodes = episodes

    def start(self) -> None:
        self.storage.start()


class HttpStoreControl:
    """Congestion of the loopback server for one run: clean through the warmup, then the run's
    episodes from `start` (or clean throughout when there are none)."""

    def __init__(self, server: ObjectServer):
        self.server = server
        self._episodes: CongestionEpisodes | None = None

    def prepare(self, episodes: CongestionEpisodes | None) -> None:
        self._episodes = episodes
        self.server.set_congestion(False)

    def start(self) -> None:
        if self._episodes is not None:
            self.server.restart_episodes(self._episodes)
            self.server.set_congestion(None)


def serve_shards(
    directory: str,
    images: np.ndarray,
    labels: np.ndarray,
    model: CongestionModel,
    examples_per_shard: int = 1024,
) -> tuple[ObjectServer, ShardedStorage]:
    """Writes the data set as shards under `directory`, serves it (started; close it after) and
    opens it over HTTP; returns ``(server, storage)``."""
    write_shards(
        directory,
        [(images, labels)],
        len(images),
        images.shape[1:],
        examples_per_shard=examples_per_shard,
    )
    server = ObjectServer(directory, model, congested=False).start()
    return server, ShardedStorage(server.url)


def fixed_sweep(
    base_workers: int,
    multiples: Sequence[float],
    batch_size: int,
    max_workers: int,
    max_depth: int,
) -> list[tuple[int, int]]:
    """Fixed ``(workers, depth)`` settings: each multiple of `base_workers`, at the depth that
    keeps those workers busy (one batch ready besides those being fetched) and at twice it,
    within the bounds (no more threads than the window holds, which would only idle)."""
    out: list[tuple[int, int]] = []
    for m in multiples:
        w = min(max(1, math.ceil(base_workers * m)), max_workers)
        d = min(math.ceil(w / batch_size) + 1, max_depth)
        for depth in (d, min(2 * d, max_depth)):
            setting = (min(w, depth * batch_size), depth)
            if setting not in out:
                out.append(setting)
    return out
