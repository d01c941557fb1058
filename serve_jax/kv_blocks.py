"""Block accounting for the paged KV cache: a device pool, a host pool and per-request tables.

Pure Python (no JAX): the scheduler owns one `KVBlockManager`, and the same code runs under the
real JAX executor and under the simulator. Blocks are integers ``0 .. num_blocks-1`` of a pool;
what a block holds (``block_size`` tokens of K and V for every layer) is the executor's business.

Invariants (checked by `KVBlockManager.check_invariants`, exercised by randomized tests):

* every block of a pool is in exactly one state: free (in the free queue), owned by exactly one
  request (and listed exactly once in that request's table), or *in flight*: freed by its owner
  while a copy from or to it is still running, and returned to the free queue only when the
  executor reports the copy complete;
* a block is never handed out while a copy from it is in flight (so an offload never reads a page
  that a new request is already overwriting, and a restore never reads a host page being reused);
* after every request has finished or been aborted and every copy has completed, both pools are
  entirely free (nothing leaked).

Offload of a request moves its device table to freshly allocated host blocks: the device blocks
become in-flight (released when the copy completes), the host blocks are owned by the request.
Restore is the mirror image: device blocks are allocated to the request, the host blocks become
in-flight until the executor reports the restore complete.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

__all__ = ["BlockPool", "KVBlockManager", "BlockAccountingError", "blocks_for_tokens"]


class BlockAccountingError(RuntimeError):
    """An operation that would break the block invariants (double free, over-allocation, ...)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """The number of blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed set of blocks with a FIFO free queue, owners and in-flight copies.

    Args:
      num_blocks: number of blocks in the pool (may be 0 for an absent host tier).
      name: ``"device"`` or ``"host"``; used in error messages.
    """

    def __init__(self, num_blocks: int, name: str):
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.name = name
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}
        # block -> number of copies in flight touching it
        self._pins: dict[int, int] = {}
        # blocks freed by their owner while pinned: returned to the free queue on last unpin
        self._released_when_unpinned: set[int] = set()

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now."""
        return len(self._free)

    @property
    def num_in_flight(self) -> int:
        """Blocks with no owner that return to the free queue when their copies complete."""
        return len(self._released_when_unpinned)

    def is_pinned(self, block: int) -> bool:
        """Whether a copy from or to ``block`` is in flight."""
        return self._pins.get(block, 0) > 0

    def owner(self, block: int) -> str | None:
        """The request owning ``block``, or None."""
        return self._owner.get(block)

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Takes ``n`` blocks from the free queue for ``request_id``."""
        if n > len(self._free):
            raise BlockAccountingError(
                f"{self.name} pool: asked for {n} blocks for {request_id!r}, only "
                f"{len(self._free)} free"
            )
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._owner[b] = request_id
        return out

    def free(self, request_id: str, blocks: Iterable[int]) -> None:
        """Returns ``request_id``'s blocks; pinned ones come back when their copies end."""
        for b in blocks:
            if self._owner.get(b) != request_id:
                raise BlockAccountingError(
                    f"{self.name} pool: {request_id!r} frees block {b} owned by "
                    f"{self._owner.get(b)!r}"
                )
            del self._owner[b]
            if self._pins.get(b, 0) > 0:
                self._released_when_unpinned.add(b)
            else:
                self._free.append(b)

    def pin(self, blocks: Iterable[int]) -> None:
        """Marks a copy from or to ``blocks`` as in flight."""
        for b in blocks:
            if b in self._released_when_unpinned or b not in self._owner:
                raise BlockAccountingError(f"{self.name} pool: pinning unowned block {b}")
            self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, blocks: Iterable[int]) -> None:
        """Marks a copy as complete; a block freed meanwhile returns to the free queue."""
        for b in blocks:
            count = self._pins.get(b, 0)
            if count <= 0:
                raise BlockAccountingError(f"{self.name} pool: unpinning block {b} not in flight")
            if count == 1:
                del self._pins[b]
                if b in self._released_when_unpinned:
                    self._released_when_unpinned.discard(b)
                    self._free.append(b)
            else:
                self._pins[b] = count - 1

    def check(self, tables: dict[str, list[int]]) -> None:
        """Checks this pool's invariants against the per-request ``tables``."""
        seen: dict[int, str] = {}
        for rid, table in tables.items():
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise BlockAccountingError(f"{self.name} pool: {rid!r} holds bad block {b}")
                if b in seen:
                    raise BlockAccountingError(
                        f"{self.name} pool: block {b} owned twice ({seen[b]!r}, {rid!r})"
                    )
                seen[b] = rid
                if self._owner.get(b) != rid:
                    raise BlockAccountingError(
                        f"{self.name} pool: table of {rid!r} lists block {b} owned by "
                        f"{self._owner.get(b)!r}"
                    )
        if len(seen) != len(self._owner):
            raise BlockAccountingError(f"{self.name} pool: owners not matched by any table")
        free = list(self._free)
        if len(set(free)) != len(free):
            raise BlockAccountingError(f"{self.name} pool: a block is twice in the free queue")
        free_set = set(free)
        if free_set & set(seen) or free_set & self._released_when_unpinned:
            raise BlockAccountingError(f"{self.name} pool: a free block is also owned/in flight")
        if set(seen) & self._released_when_unpinned:
            raise BlockAccountingError(f"{self.name} pool: an owned block is also released")
        for b in self._released_when_unpinned:
            if self._pins.get(b, 0) <= 0:
                raise BlockAccountingError(f"{self.name} pool: released block {b} not pinned")
        total = len(free_set) + len(seen) + len(self._released_when_unpinned)
        if total != self.num_blocks:
            raise BlockAccountingError(
                f"{self.name} pool: {self.num_blocks - total} blocks leaked "
                f"(free {len(free_set)}, owned {len(seen)}, "
                f"in flight {len(self._released_when_unpinned)})"
            )


class KVBlockManager:
    """Per-request device and host block tables over two `BlockPool` s.

    Args:
      num_device_blocks: blocks in the device (HBM) pool.
      num_host_blocks: blocks in the host (pinned memory) pool; 0 disables offload.
      block_size: tokens per block.
    """

    def __init__(self, num_device_blocks: int, num_host_blocks: int, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.device = BlockPool(num_device_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host")
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}

    # ---- queries -------------------------------------------------------------------------
    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed for ``num_tokens`` tokens."""
        return blocks_for_tokens(num_tokens, self.block_size)

    def device_table(self, request_id: str) -> list[int]:
        """The device blocks of ``request_id`` (empty if none)."""
        return self.device_tables.get(request_id, [])

    def extra_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Device blocks to add so that ``request_id`` can hold ``num_tokens`` tokens."""
        have = len(self.device_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    # ---- device allocation ---------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocates device blocks so ``request_id`` holds ``num_tokens`` tokens; returns them."""
        extra = self.extra_blocks_needed(request_id, num_tokens)
        new = self.device.allocate(request_id, extra)
        self.device_tables.setdefault(request_id, []).extend(new)
        return new

    def free_device(self, request_id: str) -> list[int]:
        """Frees ``request_id``'s device blocks (recompute preemption, finish)."""
        table = self.device_tables.pop(request_id, [])
        self.device.free(request_id, table)
        return table

    def free(self, request_id: str) -> None:
        """Frees everything ``request_id`` holds, device and host (finish or abort)."""
        self.free_device(request_id)
        self.host.free(request_id, self.host_tables.pop(request_id, []))

    # ---- offload and restore ------------------------------------------------------------
    def can_offload(self, request_id: str) -> bool:
        """Whether the host pool has room for ``request_id``'s device blocks."""
        return len(self.device_tables.get(request_id, ())) <= self.host.num_free

    def offload_in_flight(self, request_id: str) -> bool:
        """Whether the copy of ``request_id``'s pages to the host has not completed yet."""
        return any(self.host.is_pinned(b) for b in self.host_tables.get(request_id, ()))

    def begin_offload(self, request_id: str) -> list[tuple[int, int]]:
        """Moves ``request_id`` to host blocks; returns (device, host) pairs to copy.

        The device blocks stay in flight until `complete_offload` is called for each pair.
        """
        if request_id in self.host_tables:
            raise BlockAccountingError(f"{request_id!r} is already offloaded")
        table = self.device_tables.pop(request_id, [])
        host = self.host.allocate(request_id, len(table))
        self.host_tables[request_id] = host
        self.device.pin(table)
        self.host.pin(host)
        self.device.free(request_id, table)
        return list(zip(table, host))

    def complete_offload(self, pairs: Iterable[tuple[int, int]]) -> None:
        """The executor finished copying these (device, host) pairs."""
        pairs = list(pairs)
        self.device.unpin(d for d, _ in pairs)
        self.host.unpin(h for _, h in pairs)

    def begin_restore(self, request_id: str) -> list[tuple[int, int]]:
        """Moves ``request_id`` back to device blocks; returns (host, device) pairs to copy.

        The host blocks stay in flight until `complete_restore` is called for each pair.
        """
        if request_id in self.device_tables and self.device_tables[request_id]:
            raise BlockAccountingError(f"{request_id!r} restored while holding device blocks")
        host = self.host_tables.pop(request_id, [])
        dev = self.device.allocate(request_id, len(host))
        self.device_tables[request_id] = dev
        self.host.pin(host)
        self.device.pin(dev)
        self.host.free(request_id, host)
        return list(zip(host, dev))

    def complete_restore(self, pairs: Iterable[tuple[int, int]]) -> None:
        """The executor finished copying these (host, device) pairs."""
        pairs = list(pairs)
        self.host.unpin(h for h, _ in pairs)
        self.device.unpin(d for _, d in pairs)

    def has_copies_in_flight(self) -> bool:
        """Whether any offload or restore has not been reported complete."""
        return bool(self.device._pins or self.host._pins)

    # ---- checks --------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raises `BlockAccountingError` if a block is owned twice, leaked or misfiled."""
        self.device.check(self.device_tables)
        self.host.check(self.host_tables)

    def assert_all_free(self) -> None:
        """Raises unless both pools are entirely free (after all requests and copies ended)."""
        self.check_invariants()
        for pool in (self.device, self.host):
            if pool.num_free != pool.num_blocks:
                raise BlockAccountingError(
                    f"{pool.name} pool: {pool.num_blocks - pool.num_free} blocks not returned"
                )
