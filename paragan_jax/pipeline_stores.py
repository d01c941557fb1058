"""The stores ``bench-pipeline`` runs against, how it congests them, and its fixed-setting sweep.

- `RunCongestion`: congestion of either store for one run (the seeded latency model of
  `paragan_jax.storage.EmulatedRemoteStorage`, or the loopback server below; both keep it in a
  `paragan_jax.storage.CongestionSwitch`): clean during the run's warmup, then the run's
  episodes from its timed start.
- `serve_shards`: the data set written as shards (`paragan_jax.shards`) behind the loopback
  object server (`paragan_jax.http_store`, in a process of its own), read through real sockets.
- `fixed_sweep`: the fixed ``(workers, depth)`` settings the HTTP bench tries under the same
  congestion, so that the fixed baseline is the best of a sweep rather than one guess.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .http_store import CongestionModel, ServerProcess
from .shards import ShardedStorage, write_shards
from .storage import CongestionEpisodes, CongestionSwitch

__all__ = ["RunCongestion", "fixed_sweep", "serve_shards"]


class RunCongestion:
    """Congestion of a store (its `CongestionSwitch`) for one run: `prepare` before the warmup
    (clean through it), `start` when the timed part begins (the run's episodes count from there;
    clean throughout when there are none)."""

    def __init__(self, switch: CongestionSwitch):
        self.switch = switch
        self._episodes: CongestionEpisodes | None = None

    def prepare(self, episodes: CongestionEpisodes | None) -> None:
        self._episodes = episodes
        self.switch.set_congestion(False)

    def start(self) -> None:
        if self._episodes is not None:
            self.switch.restart(self._episodes)
            self.switch.set_congestion(None)


def serve_shards(
    directory: str,
    images: np.ndarray,
    labels: np.ndarray,
    model: CongestionModel,
    examples_per_shard: int = 1024,
) -> tuple[ServerProcess, ShardedStorage]:
    """Writes the data set as shards under `directory`, serves it from a process of its own
    (`paragan_jax.http_store.ServerProcess`: started; close it after) and opens it over HTTP;
    returns ``(server, storage)``."""
    write_shards(
        directory,
        [(images, labels)],
        len(images),
        images.shape[1:],
        examples_per_shard=examples_per_shard,
    )
    server = ServerProcess(directory, model, congested=False)
    try:
        return server, ShardedStorage(server.url)
    except BaseException:
        server.close()
        raise


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
