"""The data side of a `paragan_jax.train.Trainer`: what this process reads, its share of each
global batch, and the real examples the metrics compare against.

Per-process reading. In a multi-process run (a TPU pod slice, or ``python -m paragan_jax train
--num-processes N``) over the sharded format (``data.source=shards``) process ``p`` opens only its
own shards (`paragan_jax.shards.ShardedStorage` with ``process_index=p``: shards ``p, p + N, ...``)
and its loader yields only its share of the global batch, ``B / N`` examples, which
`paragan_jax.data.device_batch` places as this process's rows of the global batch
(``jax.make_array_from_process_local_data``). Host memory then holds one process's labels and
shard indices and its loader's prefetched batches, whatever the data set's size.

Order. Batch ``i`` of process ``p`` is `paragan_jax.data.batch_at` over its own examples, with
batch size ``B / N``, the seed ``process_seed(data.seed, p, N)`` (a seed of its own, so the
processes' orders are not the same permutation of equally sized shards) and an epoch of
``epoch_size`` examples (the smallest process share, so every process has the same batches per
epoch; the permutation changes every epoch, so no example is left out for good). Global batch
``i`` is the processes' batches in the order of the data axis's rows. It is a pure function of
``(data.seed, i, N)``, not of timing, and the data position in checkpoints (the next batch index,
the same on every process) resumes it exactly. One process (``N = 1``) reads exactly what it
always did: all shards, ``batch_at(seed, i)``.

Per-process reading needs the data axis to split the batch into equal, disjoint parts, one per
process. Otherwise (a mesh whose batch rows are repeated across processes, or the async scheme,
whose groups take the whole batch) every process reads the whole global batch, lazily from all
shards, as before; so do the in-memory sources (digits, mixtures, npy, folder), which every
process loads whole anyway.

Metrics reference. FD, KID and the feature classifier need real examples. With shards they are a
fixed sample of ``eval.reference_size`` examples (seed 0, sorted) of the WHOLE data set, read by
process 0 only, at the first evaluation: the metrics then mean the same whatever the number of
processes (process 0's own shards would be a different subset for every N, and a prepared folder
keeps its class order, so a process's shards may miss classes), and host memory stays bounded
(the classifier trains on these examples as float32: ``reference_size * H * W * C * 4`` bytes).
A data set no larger than the sample is used whole, as before. In-memory sources use all theirs.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .config import TrainConfig
from .data import Dataset, load_dataset
from .shards import ShardedStorage

__all__ = [
    "TrainData",
    "load_train_data",
    "process_rows",
    "process_seed",
    "reference_dataset",
]

REFERENCE_SEED = 0
_READ_CHUNK = 256  # examples per read of the reference sample


def process_seed(seed: int, process_index: int, process_count: int) -> int:
    """The loader seed of one process: `seed` itself with one process, else one of its own."""
    if process_count == 1:
        return seed
    return int(np.random.SeedSequence([seed, process_index, process_count]).generate_state(1)[0])


def process_rows(mesh: Mesh, batch_size: int) -> dict[int, np.ndarray]:
    """The rows of a ``(batch_size, ...)`` batch split over the mesh's ``data`` axis that each
    process's devices hold, sorted (process index -> rows)."""
    sharding = NamedSharding(mesh, P("data"))
    rows: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        rows.setdefault(device.process_index, set()).update(range(*index[0].indices(batch_size)))
    return {p: np.array(sorted(r)) for p, r in sorted(rows.items())}


def _splits_over_processes(mesh: Mesh, batch_size: int, process_count: int) -> bool:
    """Whether each process holds its own ``batch_size // process_count`` rows and together they
    hold every row (so `process_count` divides `batch_size`). The mesh's data axis must divide
    `batch_size` (`paragan_jax.state.check_batch_divides`)."""
    rows = process_rows(mesh, batch_size)
    share = batch_size // process_count
    if len(rows) != process_count or any(len(r) != share for r in rows.values()):
        return False
    return len(np.unique(np.concatenate(list(rows.values())))) == batch_size


@dataclasses.dataclass(frozen=True)
class TrainData:
    """What one process of a run reads.

    Attributes:
      dataset: the examples this process's loader reads (its own shards, or the whole set).
      batch_size: examples per loader batch: this process's share of ``data.batch_size``, or
        all of it.
      seed: the loader's seed (`process_seed`).
      local: the loader batches are this process's share of the global batch (place them with
        ``device_batch(..., local=True)``); otherwise every process holds the whole batch.
    """

    dataset: Dataset
    batch_size: int
    seed: int
    local: bool


def load_train_data(
    config: TrainConfig, mesh: Mesh, process_index: int, process_count: int, sync: bool
) -> TrainData:
    """This process's data for a run on `mesh` (see the module docstring for when it is local).

    Args:
      config: the run config.
      mesh: the run's mesh (its ``data`` axis splits the batch).
      process_index, process_count: this process and how many there are.
      sync: the sync scheme (one batch sharding over the whole mesh); the async groups always
        get the whole batch.

    Raises:
      paragan_jax.data.DataError: data that cannot be read or is too small for a batch share.
    """
    d = config.data
    local = (
        d.source == "shards"
        and process_count > 1
        and sync
        and _splits_over_processes(mesh, d.batch_size, process_count)
    )
    if not local:
        return TrainData(load_dataset(config), d.batch_size, d.seed, False)
    dataset = load_dataset(config, process_index, process_count)
    seed = process_seed(d.seed, process_index, process_count)
    return TrainData(dataset, d.batch_size // process_count, seed, True)


def reference_dataset(config: TrainConfig, dataset: Dataset) -> Dataset:
    """The real examples the metrics compare against: `dataset` for in-memory sources; with
    shards a fixed sample of ``eval.reference_size`` examples of the whole set, read now."""
    if config.data.source != "shards":
        return dataset
    storage = ShardedStorage(config.data.path)  # every shard: the reference spans the set
    n = len(storage)
    k = min(n, config.eval.reference_size)
    if k == n:
        idx = np.arange(n)
    else:
        idx = np.sort(np.random.default_rng(REFERENCE_SEED).choice(n, k, replace=False))
    images = np.concatenate(
        [storage.read(idx[i : i + _READ_CHUNK])["image"] for i in range(0, k, _READ_CHUNK)]
    )
    return Dataset(dataset.name, images, storage.labels[idx], dataset.num_classes)
