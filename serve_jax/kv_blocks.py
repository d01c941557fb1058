"""Block accounting for the paged KV cache: a device pool, a host pool and per-request tables.

Pure Python (no JAX): the scheduler owns one `KVBlockManager`, and the same code runs under the
real JAX executor and under the simulator. Blocks are integers ``0 .. num_blocks-1`` of a pool;
what a block holds (``block_size`` tokens of K and V for every layer) is the executor's business.

Invariants (checked by `KVBlockManager.check_invariants`, exercised by randomized tests):

* every block of a pool is in exactly one state: free (in the free queue), held by one or more
  requests (its reference count is the number of request tables listing it, each at most once),
  or *in flight*: freed by its last holder while a copy from or to it is still running, and
  returned to the free queue only when the executor reports the copy complete;
* a block is never handed out while a copy from it is in flight (so an offload never reads a page
  that a new request is already overwriting, and a restore never reads a host page being reused);
* after every request has finished or been aborted and every copy has completed, both pools are
  entirely free (nothing leaked).

Automatic prefix caching (vLLM V1's design, on by default): a device block becomes *cached*
once it is full and its KV computed; its key is a chained hash of (the previous block's key,
its token ids, extra keys: the request's ``cache_salt`` on the first block), so a key names a
whole prefix. Cached blocks stay findable while held and after they are freed; the free queue
is least-recently-freed first (a request's blocks are freed last block first), and allocating
a cached free block evicts it. An admission (first, after a recompute preemption, or a new turn
that re-sends a context) takes the longest run of cached blocks at the start of its tokens,
touching them (shared, reference-counted) and skipping their prefill. Shared blocks are never
written: a request writes only positions past its computed tokens, which lie in blocks of its
own.

Offload of a request moves its device table to freshly allocated host blocks: the device blocks
become in-flight (released when the copy completes), the host blocks are owned by the request.
Restore is the mirror image: device blocks are allocated to the request, the host blocks become
in-flight until the executor reports the restore complete.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from serve_jax.interface import Request

__all__ = [
    "BlockPool",
    "KVBlockManager",
    "BlockAccountingError",
    "blocks_for_tokens",
    "hash_block_tokens",
    "builtin_block_hash",
    "BLOCK_HASHES",
]


class BlockAccountingError(RuntimeError):
    """An operation that would break the block invariants (double free, over-allocation, ...)."""


def hash_block_tokens(
    parent: bytes | None, token_ids: Sequence[int], extra: object = None
) -> bytes:
    """The prefix-cache key of one full block: a 128-bit BLAKE2 digest of (parent block's key,
    the block's token ids, extra keys such as a cache salt), so equal keys mean equal prefixes.
    """
    h = hashlib.blake2b(b"\x00" if parent is None else b"\x01" + parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra is not None:
        h.update(repr(extra).encode())
    return h.digest()


def builtin_block_hash(parent: object, token_ids: Sequence[int], extra: object = None) -> int:
    """A cheap prefix-cache key: Python's 64-bit ``hash`` of (parent key, token ids, extra).

    About 5x cheaper than `hash_block_tokens`, for the simulator (no adversary; a collision,
    about n^2 / 2^65 for n blocks, would only bend one result); the engine keeps BLAKE2, since
    ints hash predictably and a crafted collision would share KV across requests.
    """
    return hash((parent, tuple(token_ids), extra))


BLOCK_HASHES = {"blake2b": hash_block_tokens, "builtin": builtin_block_hash}
"""The prefix-cache key functions by name (``KVBlockManager(block_hash=...)``)."""


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """The number of blocks of ``block_size`` tokens needed to hold ``num_tokens`` tokens."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return -(-num_tokens // block_size)


class BlockPool:
    """A fixed set of reference-counted blocks with an LRU free queue and in-flight copies.

    With prefix caching, a full block may be registered under its content hash
    (`hash_block_tokens`): it stays findable while it is owned and after it is freed, until
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
    def num_cached(self) -> int:
        """Blocks registered under a content hash (owned or free)."""
        return len(self._hash_of)

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
                f"{self.name} pool: asked for {n} blocks for {request_id!r}, only "
                f"{len(free)} free"
            )
        out = []
        refs, hash_of = self._refs, self._hash_of
        for _ in range(n):
            b = free.popitem(last=False)[0]
            if hash_of:
                h = hash_of.pop(b, None)
                if h is not None:  # evicted from the prefix cache
                    copies = self._blocks_of[h]
                    del copies[b]
                    if not copies:
                        del self._blocks_of[h]
            refs[b] = 1
            out.append(b)
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
        refs = self._refs
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
            if self._pins.get(b, 0) > 0:
                self._released_when_unpinned.add(b)
            else:
                self._free[b] = None

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

    def cached_block(self, block_hash: Hashable) -> int | None:
        """A block registered under ``block_hash`` (the first registered), or None."""
        copies = self._blocks_of.get(block_hash)
        return next(iter(copies)) if copies else None

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


class KVBlockManager:
    """Per-request device and host block tables over two `BlockPool` s, with prefix caching.

    Args:
      num_device_blocks: blocks in the device (HBM) pool.
      num_host_blocks: blocks in the host (pinned memory) pool; 0 disables offload.
      block_size: tokens per block.
      enable_prefix_caching: keep full device blocks findable by content (see the module
        docstring); off, every admission computes its whole context.
      block_hash: the key function of full blocks, a name of `BLOCK_HASHES` (``blake2b``, the
        default, or ``builtin``, the simulator's cheaper one).
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        block_hash: str = "blake2b",
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if block_hash not in BLOCK_HASHES:
            raise ValueError(f"block_hash must be one of {sorted(BLOCK_HASHES)}: {block_hash!r}")
        self._hash_fn = BLOCK_HASHES[block_hash]
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.device = BlockPool(num_device_blocks, "device")
        self.host = BlockPool(num_host_blocks, "host")
        self.device_tables: dict[str, list[int]] = {}
        self.host_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[Hashable]] = {}
        # Leading blocks of each device table already registered in the prefix cache.
        self._num_registered: dict[str, int] = {}
        self.prefix_queries = 0
        """Tokens of the admissions that looked up the prefix cache."""
        self.prefix_hits = 0
        """Of those, tokens found cached (not computed again)."""
        self.restore_hit_blocks = 0
        """Blocks of offloaded requests found cached on the device at their restore (not
        copied back from the host)."""

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

    @property
    def prefix_hit_rate(self) -> float:
        """Cached tokens over looked-up tokens (0.0 before any lookup)."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---- prefix cache --------------------------------------------------------------------
    def block_hashes(self, req: Request, num_blocks: int) -> list[Hashable]:
        """The chained hashes of ``req``'s first ``num_blocks`` full blocks (memoized)."""
        hashes = self._hashes.setdefault(req.request_id, [])
        bs = self.block_size
        if len(hashes) < num_blocks:
            prompt, output = req.prompt_token_ids, req.output_token_ids
            num_prompt = len(prompt)
            parent = hashes[-1] if hashes else None
            hash_fn = self._hash_fn
            for k in range(len(hashes), num_blocks):
                lo, hi = k * bs, (k + 1) * bs
                if hi <= num_prompt:
                    tokens = prompt[lo:hi]
                elif lo >= num_prompt:
                    tokens = output[lo - num_prompt : hi - num_prompt]
                else:
                    tokens = list(prompt[lo:]) + list(output[: hi - num_prompt])
                parent = hash_fn(parent, tokens, req.cache_salt if k == 0 else None)
                hashes.append(parent)
        return hashes

    def lookup_prefix(self, req: Request, max_tokens: int | None = None) -> list[int]:
        """Cached device blocks holding the longest prefix of ``req``'s tokens.

        At most ``max_tokens`` tokens (default ``num_tokens - 1``: the last one is computed to
        sample from) are taken from the cache; empty when caching is off or ``req`` already
        holds device blocks.
        """
        if not self.enable_prefix_caching or self.device_tables.get(req.request_id):
            return []
        if max_tokens is None:
            max_tokens = req.num_tokens - 1
        n = max_tokens // self.block_size
        if n <= 0:
            return []
        out = []
        cached = self.device.cached_block
        for h in self.block_hashes(req, n):
            b = cached(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them uses up a free block)."""
        free = self.device._free
        return sum(1 for b in blocks if b in free)

    def take_prefix(self, req: Request, blocks: list[int]) -> None:
        """Starts ``req``'s device table with the cached ``blocks`` (from `lookup_prefix`) and
        counts the lookup in the hit-rate statistics."""
        if self.enable_prefix_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(blocks) * self.block_size
        if not blocks:
            return
        rid = req.request_id
        if self.device_tables.get(rid):
            raise BlockAccountingError(f"{rid!r} takes a cached prefix while holding blocks")
        self.device.touch(blocks)
        self.device_tables[rid] = list(blocks)
        self._num_registered[rid] = len(blocks)

    def cache_computed(self, req: Request) -> None:
        """Registers ``req``'s full device blocks whose KV is computed (after each step)."""
        rid = req.request_id
        table = self.device_tables.get(rid)
        if not table or not self.enable_prefix_caching:
            return
        done = self._num_registered.get(rid, 0)
        full = min(req.num_computed_tokens // self.block_size, len(table))
        if full <= done:
            return
        hashes = self.block_hashes(req, full)
        self.device.register_many(table[done:full], hashes[done:full])
        self._num_registered[rid] = full

    # ---- device allocation ---------------------------------------------------------------
    def grow(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocates device blocks so ``request_id`` holds ``num_tokens`` tokens; returns them."""
        extra = self.extra_blocks_needed(request_id, num_tokens)
        new = self.device.allocate(request_id, extra)
        self.device_tables.setdefault(request_id, []).extend(new)
        return new

    def free_device(self, request_id: str) -> list[int]:
        """Frees ``request_id``'s device blocks (recompute preemption, finish).

        The blocks go to the free queue last block first, so a prefix is evicted from its end;
        registered ones stay findable until evicted.
        """
        table = self.device_tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        self.device.free(request_id, reversed(table))
        return table

    def free(self, request_id: str) -> None:
        """Frees everything ``request_id`` holds, device and host (finish or abort)."""
        self.free_device(request_id)
        self._hashes.pop(request_id, None)
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
        self._num_registered.pop(request_id, None)
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

    def begin_restore(self, request_id: str, hits: list[int] = ()) -> list[tuple[int, int]]:
        """Moves ``request_id`` back to device blocks; returns (host, device) pairs to copy.

        ``hits``: device blocks still cached with the request's first ``len(hits)`` blocks
        (`lookup_prefix` over its computed tokens); they are shared instead of copied back, and
        their host copies are freed at once. The other host blocks stay in flight until
        `complete_restore` is called for each pair.
        """
        if request_id in self.device_tables and self.device_tables[request_id]:
            raise BlockAccountingError(f"{request_id!r} restored while holding device blocks")
        host = self.host_tables.pop(request_id, [])
        k = len(hits)
        if k > len(host):
            raise BlockAccountingError(f"{request_id!r}: {k} cached blocks for {len(host)} held")
        self.device.touch(hits)
        dev = self.device.allocate(request_id, len(host) - k)
        self.device_tables[request_id] = [*hits, *dev]
        self._num_registered[request_id] = k
        self.restore_hit_blocks += k
        self.host.pin(host[k:])
        self.device.pin(dev)
        self.host.free(request_id, host)
        return list(zip(host[k:], dev))

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
