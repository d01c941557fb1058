"""One pool of KV blocks: reference counts, an LRU free queue, in-flight copies, cache maps.

`serve_jax.kv_blocks.KVBlockManager` holds two of these (device and host) and the per-request
tables; the module docstring there states the invariants. Pure Python (no JAX).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from itertools import islice

__all__ = ["BlockAccountingError", "BlockPool"]


class BlockAccountingError(RuntimeError):
    """An operation that would break the block invariants (double free, over-allocation, ...)."""


class BlockPool:
    """A fixed set of reference-counted blocks with an LRU free queue and in-flight copies.

    With prefix caching, a full block may be registered under its content hash
    (`serve_jax.block_hash`): it stays findable while it is owned and after it is freed, until
    `allocate` takes it from the front of the free queue (least recently freed first) and
    evicts it. A cached block found again is *touched*: its reference count goes up and it
    leaves the free queue.

    Args:
      num_blocks: number of blocks in the pool (may be 0 for an absent host tier).
      name: ``"device"`` or ``"host"``; used in error messages.
    """

    def __init__(self, num_blocks: int, name: str):
        if num_blocks < 0:
            raise ValueError(f"{name} pool: num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.name = name
        # Insertion-ordered: the front is the next block to allocate (and evict).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs: dict[int, int] = {}
        # block -> number of copies in flight touching it
        self._pins: dict[int, int] = {}
        # blocks freed by their last owner while pinned: returned to the free queue on last unpin
        self._released_when_unpinned: set[int] = set()
        self._hash_of: dict[int, Hashable] = {}
        # hash -> blocks holding that prefix (a restored or recomputed copy may duplicate one)
        self._blocks_of: dict[Hashable, dict[int, None]] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (cached free blocks included)."""
        return len(self._free)

    @property
    def num_in_flight(self) -> int:
        """Blocks with no owner that return to the free queue when their copies complete."""
        return len(self._released_when_unpinned)

    @property
    def num_pinned(self) -> int:
        """Blocks with a copy from or to them in flight."""
        return len(self._pins)

    @property
    def num_cached(self) -> int:
        """Blocks registered under a content hash (owned or free)."""
        return len(self._hash_of)

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (cached, unowned)."""
        free = self._free
        return sum(1 for b in blocks if b in free)

    def is_free(self, block: int) -> bool:
        """Whether ``block`` sits in the free queue."""
        return block in self._free

    def oldest_free(self, n: int) -> list[int]:
        """The first ``n`` blocks of the free queue (the next ones `allocate` takes)."""
        return list(islice(self._free, n))

    def evict_first(self, blocks: Sequence[int]) -> None:
        """Moves free ``blocks`` to the front of the free queue, in order: `allocate` takes (and
        evicts) them before the others."""
        free = self._free
        for b in reversed(blocks):
            free.move_to_end(b, last=False)

    def is_pinned(self, block: int) -> bool:
        """Whether a copy from or to ``block`` is in flight."""
        return self._pins.get(block, 0) > 0

    def ref_count(self, block: int) -> int:
        """How many request tables hold ``block``."""
        return self._refs.get(block, 0)

    def allocate(self, request_id: str, n: int) -> list[int]:
        """Takes ``n`` blocks from the front of the free queue for ``request_id``."""
        free = self._free
        if n > len(free):
            raise BlockAccountingError(
                f"{self.name} pool: asked for {n} blocks for {request_id!r}, only {len(free)} free"
            )
        popitem = free.popitem
        out = [popitem(last=False)[0] for _ in range(n)]
        hash_of = self._hash_of
        if hash_of:
            blocks_of = self._blocks_of
            for b in out:
                h = hash_of.pop(b, None)
                if h is not None:  # evicted from the prefix cache
                    copies = blocks_of[h]
                    del copies[b]
                    if not copies:
                        del blocks_of[h]
        self._refs.update(dict.fromkeys(out, 1))
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Adds a reference to cached ``blocks`` (a prefix-cache hit); free ones leave the queue."""
        refs = self._refs
        for b in blocks:
            count = refs.get(b, 0)
            if count == 0:
                if b in self._free:
                    del self._free[b]
                elif b in self._released_when_unpinned:
                    self._released_when_unpinned.discard(b)  # its copy still runs; now owned
                else:
                    raise BlockAccountingError(f"{self.name} pool: touching unknown block {b}")
            refs[b] = count + 1

    def free(self, request_id: str, blocks: Iterable[int]) -> None:
        """Drops ``request_id``'s reference to ``blocks``; a block nobody holds returns to the
        back of the free queue (pinned ones when their copies end)."""
        refs, pins, free = self._refs, self._pins, self._free
        for b in blocks:
            count = refs.get(b, 0)
            if count <= 0:
                raise BlockAccountingError(
                    f"{self.name} pool: {request_id!r} frees block {b}, which nobody holds"
                )
            if count > 1:
                refs[b] = count - 1
                continue
            del refs[b]
            if pins and pins.get(b, 0) > 0:
                self._released_when_unpinned.add(b)
            else:
                free[b] = None

    def pin(self, blocks: Iterable[int]) -> None:
        """Marks a copy from or to ``blocks`` as in flight."""
        for b in blocks:
            if self._refs.get(b, 0) <= 0:
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
                    self._free[b] = None
            else:
                self._pins[b] = count - 1

    # ---- prefix cache --------------------------------------------------------------------
    def is_cached(self, block: int) -> bool:
        """Whether ``block`` is registered in the prefix cache (its content must be kept)."""
        return block in self._hash_of

    def hash_of(self, block: int) -> Hashable | None:
        """The key ``block`` is registered under (None: not cached)."""
        return self._hash_of.get(block)

    def cached_block(self, block_hash: Hashable) -> int | None:
        """A block registered under ``block_hash`` (the first registered), or None."""
        copies = self._blocks_of.get(block_hash)
        return next(iter(copies)) if copies else None

    def cached_run(self, hashes: Iterable[Hashable], unpinned: bool = False) -> list[int]:
        """Blocks registered under the leading ``hashes``, up to the first one not cached (or,
        with ``unpinned``, whose block has a copy in flight)."""
        out = []
        blocks_of, pins = self._blocks_of, self._pins
        for h in hashes:
            copies = blocks_of.get(h)
            if not copies:
                break
            b = next(iter(copies))
            if unpinned and pins.get(b, 0) > 0:
                break
            out.append(b)
        return out

    def register(self, block: int, block_hash: Hashable) -> None:
        """Registers the full, computed ``block`` under ``block_hash`` (a block keeps its first
        hash; several blocks may hold one prefix, each findable until evicted)."""
        if block in self._hash_of:
            return
        if self._refs.get(block, 0) <= 0:
            raise BlockAccountingError(f"{self.name} pool: registering unowned block {block}")
        self._blocks_of.setdefault(block_hash, {})[block] = None
        self._hash_of[block] = block_hash

    def register_many(self, blocks: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """`register` of each block with its hash (the hot path of `KVBlockManager`)."""
        hash_of, blocks_of, refs = self._hash_of, self._blocks_of, self._refs
        n = len(blocks)
        if n > 4 and n == len(hashes):  # (the checks cost more than a decode's one block)
            held, keys = set(blocks), set(hashes)
            if (
                len(held) == n == len(keys)
                and refs.keys() >= held
                and hash_of.keys().isdisjoint(held)
                and blocks_of.keys().isdisjoint(keys)
            ):
                # The usual case (a prompt's blocks): held, none registered, each a new key.
                blocks_of.update({h: {b: None} for h, b in zip(hashes, blocks)})
                hash_of.update(zip(blocks, hashes))
                return
        for block, block_hash in zip(blocks, hashes):
            if block in hash_of:
                continue
            if refs.get(block, 0) <= 0:
                raise BlockAccountingError(f"{self.name} pool: registering unowned block {block}")
            copies = blocks_of.get(block_hash)
            if copies is None:
                blocks_of[block_hash] = {block: None}
            else:
                copies[block] = None
            hash_of[block] = block_hash

    def check(self, tables: dict[str, list[int]]) -> None:
        """Checks this pool's invariants against the per-request ``tables``."""
        held: dict[int, int] = {}
        for rid, table in tables.items():
            if len(set(table)) != len(table):
                raise BlockAccountingError(f"{self.name} pool: {rid!r} lists a block twice")
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise BlockAccountingError(f"{self.name} pool: {rid!r} holds bad block {b}")
                held[b] = held.get(b, 0) + 1
        if held != self._refs:
            raise BlockAccountingError(
                f"{self.name} pool: reference counts do not match the request tables"
            )
        free_set = set(self._free)
        if free_set & set(held) or free_set & self._released_when_unpinned:
            raise BlockAccountingError(f"{self.name} pool: a free block is also owned/in flight")
        if set(held) & self._released_when_unpinned:
            raise BlockAccountingError(f"{self.name} pool: an owned block is also released")
        for b in self._released_when_unpinned:
            if self._pins.get(b, 0) <= 0:
                raise BlockAccountingError(f"{self.name} pool: released block {b} not pinned")
        for b, h in self._hash_of.items():
            if b not in self._blocks_of.get(h, ()):
                raise BlockAccountingError(f"{self.name} pool: cache maps of block {b} disagree")
        if sum(len(c) for c in self._blocks_of.values()) != len(self._hash_of):
            raise BlockAccountingError(f"{self.name} pool: cache maps differ in size")
        total = len(free_set) + len(held) + len(self._released_when_unpinned)
        if total != self.num_blocks:
            raise BlockAccountingError(
                f"{self.name} pool: {self.num_blocks - total} blocks leaked "
                f"(free {len(free_set)}, owned {len(held)}, "
                f"in flight {len(self._released_when_unpinned)})"
            )
