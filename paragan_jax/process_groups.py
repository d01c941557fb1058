"""The async scheme with a generator group and a discriminator group of several processes each.

`paragan_jax.distributed.ProcessPairRunner` puts G in one process and D in another. Here the
first ``n`` processes of one runtime (one CPU device each, gloo collectives) split into a G
group (processes ``0 .. n_g - 1``) and a D group (``n_g .. n - 1``), each data parallel over its
own processes (`paragan_jax.async_scheme.build_g_side` / `build_d_side` on the group's mesh), as
ParaGAN's groups are on a pod. The scaling check (`paragan_jax.scaling_check`) measures it at 2,
3 and 4 processes, so the model's async prediction meets groups with their own all-reduces.

Per iteration, `GroupAsyncRunner.run_step`:

1. every process runs its group's step: G updates against its snapshot of D and makes the fakes
   of its new G (its shard of the global batch); D updates on its shard of a real batch and of
   the fakes received in the previous exchange;
2. one exchange over all ``n`` processes: a compiled all-gather of one float32 row per process
   (G rows: the process's fakes and labels; D rows: when a snapshot is due, D's params and
   statistics after this iteration's update, as in `ProcessPairRunner`); each D process takes
   its slice of the fakes, each G process installs the snapshot. The exchange is timed with the
   step (it is part of the iteration here: no buffer lets G run ahead).

The two groups' steps run at the same time in different processes; the exchange is the only
point where they wait for each other.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .async_scheme import build_d_side, build_g_side
from .config import TrainConfig
from .data import device_batch
from .steps import compile_step, stack_batches

__all__ = ["GroupAsyncRunner"]


def _local(x: jax.Array) -> np.ndarray:
    """This process's copy of an array that is replicated (or one shard per process)."""
    return np.asarray(x.addressable_shards[0].data)


class GroupAsyncRunner:
    """One process of the async scheme with groups of several processes, as a runner of
    `paragan_jax.loop.run_steps`.

    Args:
      config: the run config; ``data.batch_size`` is the global batch (each group splits it over
        its processes), ``async_.staleness`` k >= 1 (a snapshot every k iterations).
      devices: the ``n`` devices taking part, one per process, in process order.
      g_processes: ``n_g``, the size of the G group (the first ``n_g`` processes).
      image_shape: one example's shape.
    """

    scheme = "async"

    def __init__(
        self,
        config: TrainConfig,
        devices: list[Any],
        g_processes: int,
        image_shape: tuple[int, ...],
    ):
        n = len(devices)
        if len({d.process_index for d in devices}) != n:
            raise ValueError("GroupAsyncRunner needs one device per process")
        if not 0 < g_processes < n:
            raise ValueError(f"g_processes={g_processes}: must be between 1 and {n - 1}")
        self.k = config.async_.staleness
        if self.k < 1:
            raise ValueError("GroupAsyncRunner runs staleness k >= 1 (k = 0 is the sync order)")
        if config.sharding.params != "replicated":
            raise ValueError("GroupAsyncRunner sends whole replicated D params (sharding.params)")
        b = config.data.batch_size
        n_d = n - g_processes
        if b % g_processes or b % n_d:
            raise ValueError(
                f"data.batch_size={b} does not divide the groups ({g_processes} G, {n_d} D)"
            )
        self.config, self.n, self.n_g, self.n_d = config, n, g_processes, n_d
        rank = [d.process_index for d in devices].index(jax.process_index())
        self.is_g = rank < g_processes
        self.rank = rank if self.is_g else rank - g_processes  # index inside the group
        all_mesh = Mesh(np.array(devices), ("data",))
        self._rows = NamedSharding(all_mesh, P("data"))
        self._gather = jax.jit(lambda x: x, out_shardings=NamedSharding(all_mesh, P()))
        n_disc, shape = config.n_disc, tuple(image_shape)
        self._fake_shape = (n_disc, b // g_processes, *shape)
        self._fake_size = math.prod(self._fake_shape)
        self._label_size = n_disc * (b // g_processes)
        if self.is_g:
            mesh = Mesh(np.array(devices[:g_processes]), ("data",))
            self.state, self.side = build_g_side(config, mesh)
            self.side.step = compile_step(self.side.step, self.state, name="group_g_step")
            fakes, labels = self.side.produce(self.state)
            snap = (self.state["d_snap_params"], self.state["d_snap_stats"])
        else:
            mesh = Mesh(np.array(devices[g_processes:]), ("data",))
            self.state, self.side = build_d_side(config, mesh)
            img = jax.ShapeDtypeStruct((n_disc, b, *shape), jnp.float32)
            lab = jax.ShapeDtypeStruct((n_disc, b), jnp.int32)
            sh = self.side.batch_sharding
            img, lab = (jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh) for s in (img, lab))
            self.side.step = compile_step(
                self.side.step,
                self.state,
                {"image": img, "label": lab},
                img,
                lab,
                name="group_d_step",
            )
            fakes = labels = None
            snap = (self.state["d_params"], self.state["d_stats"])
        leaves, self._snap_def = jax.tree.flatten(snap)
        self._snap_shapes = [(x.shape, x.dtype) for x in leaves]
        self._snap_size = sum(math.prod(s) for s, _ in self._snap_shapes)
        self.t = 0
        self.exchanges: dict[bool, Any] = {}  # with snapshot -> compiled exchange
        # Initial exchange: fakes of G_0 to D (the snapshot is the initial D on both sides).
        self._exchange(fakes, labels, with_snapshot=False)

    @property
    def step(self) -> int:
        return self.t

    def _row(self, fakes, labels, with_snapshot: bool) -> np.ndarray:
        width = self._fake_size + self._label_size + (self._snap_size if with_snapshot else 0)
        row = np.zeros((1, width), np.float32)
        if self.is_g:
            row[0, : self._fake_size] = _local(fakes).ravel()
            row[0, self._fake_size : self._fake_size + self._label_size] = _local(labels).ravel()
        elif with_snapshot:
            snap = jax.tree.leaves((self.state["d_params"], self.state["d_stats"]))
            start = self._fake_size + self._label_size
            row[0, start:] = np.concatenate([_local(x).ravel() for x in snap])
        return row

    def _exchange(self, fakes, labels, with_snapshot: bool) -> None:
        """The all-gather of every process's row; D keeps its fakes, G installs the snapshot."""
        row = self._row(fakes, labels, with_snapshot)
        x = jax.make_array_from_process_local_data(self._rows, row, (self.n, row.shape[1]))
        if with_snapshot not in self.exchanges:
            self.exchanges[with_snapshot] = self._gather.lower(x).compile()
        rows = _local(self.exchanges[with_snapshot](x))
        if self.is_g:
            if with_snapshot:
                self._install_snapshot(rows[self.n_g, self._fake_size + self._label_size :])
            return
        f, lab = self._fake_size, self._label_size
        fakes = rows[: self.n_g, :f].reshape(self.n_g, *self._fake_shape)
        labels = rows[: self.n_g, f : f + lab].reshape(self.n_g, *self._fake_shape[:2])
        # G process i holds batch rows [i B/n_g, (i+1) B/n_g): concatenate, take this D's share.
        fakes = np.concatenate(list(fakes), axis=1)
        labels = np.concatenate(list(labels), axis=1)
        per = fakes.shape[1] // self.n_d
        part = slice(self.rank * per, (self.rank + 1) * per)
        sh = self.side.batch_sharding
        self.fakes = jax.make_array_from_process_local_data(sh, fakes[:, part])
        self.labels = jax.make_array_from_process_local_data(sh, labels[:, part].astype(np.int32))

    def _install_snapshot(self, flat: np.ndarray) -> None:
        leaves, at = [], 0
        for shape, dtype in self._snap_shapes:
            size = math.prod(shape)
            leaves.append(flat[at : at + size].reshape(shape).astype(dtype))
            at += size
        params, stats = jax.tree.unflatten(self._snap_def, leaves)
        sh = self.side.shardings
        self.state["d_snap_params"] = jax.tree.map(
            lambda v, s: jax.make_array_from_process_local_data(s, v), params, sh["d_snap_params"]
        )
        self.state["d_snap_stats"] = jax.tree.map(
            lambda v, s: jax.make_array_from_process_local_data(s, v), stats, sh["d_snap_stats"]
        )

    def run_step(self, batches: list[dict[str, np.ndarray]]) -> dict[str, jax.Array]:
        """This group's step, then the exchange (G: no data; D: its share of the real batch)."""
        snapshot = (self.t + 1) % self.k == 0  # D after this iteration's update, for G's next
        if self.is_g:
            self.state, fakes, labels, metrics = self.side.step(self.state)
            self._exchange(fakes, labels, snapshot)
        else:
            batch = device_batch(stack_batches(batches), self.side.batch_sharding, local=True)
            self.state, metrics = self.side.step(self.state, batch, self.fakes, self.labels)
            self._exchange(None, None, snapshot)
        self.t += 1
        return metrics

    def end_step(self, stop: bool) -> bool:
        """Every process runs the same number of steps (the check's fixed counts)."""
        return stop
