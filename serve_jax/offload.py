"""Host tier of the KV cache: pages copied to ``pinned_host`` memory with asynchronous device_put.

Offload (device -> host) is issued by the executor right after a step's compute has been
dispatched: a jitted gather pulls the victim's pages out of the device pools into a fresh device
buffer and ``jax.device_put`` to a ``pinned_host`` sharding starts the copy, which returns at
once. The copy then overlaps the next step; the executor waits for it (``complete``) only after
that step's compute is dispatched, and reports the (device, host) pairs back to the scheduler,
which only then lets the device blocks be reused.

Restore (host -> device) happens before the compute of the step that resumes the request: the
host pages are put back on the device and scattered into the pools by a jitted update that
donates the pools.

Each offload becomes one host "chunk" (K and V: per-layer arrays [n, KV, bs, D] in host memory);
``_where`` maps a host block id to (chunk, index). The host block accounting (how many host
blocks exist, which are free) is the scheduler's `KVBlockManager`; this class stores the data.
A restore leaves the page where it is: with host-tier prefix caching the host block stays
cached and may be promoted again, until a later offload reuses the block (a chunk is freed
when none of its pages is mapped any more).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

__all__ = ["HostKVTier", "host_memory_kind"]


def host_memory_kind(device) -> str | None:
    """``pinned_host`` if ``device`` has it, else ``unpinned_host``, else None."""
    kinds = {m.kind for m in device.addressable_memories()}
    for kind in ("pinned_host", "unpinned_host"):
        if kind in kinds:
            return kind
    return None


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@jax.jit
def _gather_pages(k_pool, v_pool, idx: jax.Array):
    """Pages ``idx`` of every layer's pool (tuples of per-layer arrays in and out)."""
    return tuple(p[idx] for p in k_pool), tuple(p[idx] for p in v_pool)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _scatter_pages(k_pool, v_pool, k_pages, v_pages, src, dst):
    k_pool = tuple(p.at[dst].set(x[src], mode="drop") for p, x in zip(k_pool, k_pages))
    v_pool = tuple(p.at[dst].set(x[src], mode="drop") for p, x in zip(v_pool, v_pages))
    return k_pool, v_pool


@dataclasses.dataclass
class _Chunk:
    k: tuple[jax.Array, ...]
    """Per-layer [n, KV, bs, D] pages."""
    v: tuple[jax.Array, ...]


class HostKVTier:
    """K/V pages held in host memory, keyed by host block id.

    Args:
      device: the device whose pools are offloaded (with no ``sharding``).
      memory_kind: host memory kind; default `host_memory_kind(device)`.
      sharding: the pools' sharding (pages keep it, in host memory); default ``device``.
    """

    def __init__(self, device, memory_kind: str | None = None, sharding=None):
        self.device = device
        self.memory_kind = memory_kind or host_memory_kind(device)
        if self.memory_kind is None:
            raise ValueError(f"device {device} has no host memory kind for KV offload")
        base = sharding if sharding is not None else SingleDeviceSharding(device)
        self._host = base.with_memory_kind(self.memory_kind)
        self._dev = base.with_memory_kind("device")
        self._where: dict[int, tuple[_Chunk, int]] = {}
        self._in_flight: list[tuple[list[tuple[int, int]], _Chunk]] = []

    @property
    def num_in_flight(self) -> int:
        """Offloads issued and not yet reported complete."""
        return len(self._in_flight)

    def offload(self, k_pool, v_pool, pairs: list[tuple[int, int]]) -> None:
        """Starts copying device blocks to host blocks; returns at once."""
        n = len(pairs)
        idx = np.zeros(_bucket(n), np.int32)
        idx[:n] = [d for d, _ in pairs]
        k_pages, v_pages = _gather_pages(k_pool, v_pool, jnp.asarray(idx))
        chunk = _Chunk(jax.device_put(k_pages, self._host), jax.device_put(v_pages, self._host))
        for i, (_, h) in enumerate(pairs):
            self._where[h] = (chunk, i)
        self._in_flight.append((list(pairs), chunk))

    def complete(self) -> list[tuple[int, int]]:
        """Waits for every offload issued so far; returns their (device, host) pairs."""
        done = []
        for pairs, chunk in self._in_flight:
            jax.block_until_ready((chunk.k, chunk.v))
            done.extend(pairs)
        self._in_flight = []
        return done

    def restore(
        self, k_pool, v_pool, pairs: list[tuple[int, int]]
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Copies host blocks back into device blocks; returns the updated (donated) pools."""
        by_chunk: dict[int, tuple[_Chunk, list[int], list[int]]] = {}
        for h, d in pairs:
            if h not in self._where:
                raise KeyError(f"host block {h} holds no offloaded page")
            chunk, i = self._where[h]  # kept: a host-cached page may be promoted again
            entry = by_chunk.setdefault(id(chunk), (chunk, [], []))
            entry[1].append(i)
            entry[2].append(d)
        num_blocks = k_pool[0].shape[0]
        for chunk, src_list, dst_list in by_chunk.values():
            m = _bucket(len(src_list))
            src = np.zeros(m, np.int32)
            dst = np.full(m, num_blocks, np.int32)  # padding rows are dropped
            src[: len(src_list)] = src_list
            dst[: len(dst_list)] = dst_list
            k_dev = jax.device_put(chunk.k, self._dev)
            v_dev = jax.device_put(chunk.v, self._dev)
            k_pool, v_pool = _scatter_pages(
                k_pool, v_pool, k_dev, v_dev, jnp.asarray(src), jnp.asarray(dst)
            )
        return k_pool, v_pool
