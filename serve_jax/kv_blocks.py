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

Host cache level (``host_caching``, off by default): the host pool is a second level of the
same cache, keyed by the same chained hashes. A cached device block freed by its last holder
(finish or recompute preemption) is *demoted*: copied to a host block (the host's least recently
used cached block is evicted for it; nothing is demoted when every host block is held), both
blocks in flight until the copy lands (`take_demotions` hands the copies to the scheduler). An
admission whose device prefix stops where the host cache goes on *promotes* those blocks
(`lookup_host`, `take_prefix`): fresh device blocks, registered under the same keys, filled by
host -> device copies before the step's compute, instead of recomputed. Offloaded victims' full
blocks are registered in the host cache as well, and stay cached there after their restore, so
one pool serves offloaded victims and cached prefixes.

Offload of a request moves its device table to freshly allocated host blocks: the device blocks
become in-flight (released when the copy completes), the host blocks are owned by the request.
Restore is the mirror image: device blocks are allocated to the request, the host blocks become
in-flight until the executor reports the restore complete.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from serve_jax.block_pool import BlockAccountingError, BlockPool

if TYPE_CHECKING:
    from serve_jax.interface import Request

_DEMOTING = "<demoting>"
_PROMOTING = "<promoting>"
"""Owners of a host block for the moment of pinning it (a demotion or a promotion copy)."""

__all__ = [
    "BlockPool",
    "KVBlockManager",
    "BlockAccountingError",
    "blocks_for_tokens",
    "hash_block_tokens",
    "builtin_block_hash",
    "BLOCK_HASHES",
]


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
      host_caching: the host pool as a second cache level (see the module docstring): cached
        device blocks freed by their last holder are demoted to host blocks, and an admission
        whose prefix continues in the host cache promotes those blocks instead of computing
        them. Needs prefix caching and a host pool.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        block_hash: str = "blake2b",
        host_caching: bool = False,
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
        self.host_caching = host_caching
        """Demote freed cached device blocks to the host pool and promote them back."""
        self.host_hits = 0
        """Of ``prefix_hits``, tokens found in the host cache (promoted, not computed)."""
        self.demoted_blocks = 0
        """Cached device blocks copied to the host cache when freed."""
        self._demotions: list[tuple[int, int]] = []

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
        done = len(hashes)
        if done < num_blocks:
            bs = self.block_size
            prompt, output = req.prompt_token_ids, req.output_token_ids
            num_prompt = len(prompt)
            hash_fn = self._hash_fn
            append = hashes.append
            parent = hashes[-1] if hashes else None
            extra = req.cache_salt if done == 0 else None  # (the first block's extra key)
            # Blocks inside the prompt, then the one across its end and output blocks.
            in_prompt = min(num_blocks, num_prompt // bs)
            for lo in range(done * bs, in_prompt * bs, bs):
                parent = hash_fn(parent, prompt[lo : lo + bs], extra)
                extra = None
                append(parent)
            for k in range(max(done, in_prompt), num_blocks):
                lo, hi = k * bs, (k + 1) * bs
                if lo >= num_prompt:
                    tokens = output[lo - num_prompt : hi - num_prompt]
                else:
                    tokens = list(prompt[lo:]) + list(output[: hi - num_prompt])
                parent = hash_fn(parent, tokens, req.cache_salt if k == 0 else None)
                append(parent)
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

    def lookup_host(self, req: Request, start: int, max_tokens: int | None = None) -> list[int]:
        """Host blocks holding ``req``'s prefix blocks ``start, start + 1, ...`` (after the
        ``start`` blocks `lookup_prefix` found on the device), up to ``max_tokens`` tokens as
        there; empty unless host caching is on. Blocks whose copy is still in flight are not
        used."""
        if not (self.host_caching and self.enable_prefix_caching):
            return []
        if self.device_tables.get(req.request_id):
            return []
        if max_tokens is None:
            max_tokens = req.num_tokens - 1
        n = max_tokens // self.block_size
        if n <= start:
            return []
        host = self.host
        out = []
        for h in self.block_hashes(req, n)[start:]:
            b = host.cached_block(h)
            if b is None or host.is_pinned(b):
                break
            out.append(b)
        return out

    def num_free_among(self, blocks: Iterable[int]) -> int:
        """How many of ``blocks`` sit in the free queue (a hit on them uses up a free block)."""
        free = self.device._free
        return sum(1 for b in blocks if b in free)

    def take_prefix(
        self, req: Request, blocks: list[int], host_blocks: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """Starts ``req``'s device table with the cached ``blocks`` (from `lookup_prefix`),
        then one fresh device block per host block of ``host_blocks`` (from `lookup_host`),
        registered under the same key and filled by a copy; counts the lookup in the hit-rate
        statistics.

        Returns:
          (host block, device block) pairs to copy before the step's compute (promotions); the
          blocks stay in flight until `complete_restore` is called for each pair.
        """
        bs = self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += (len(blocks) + len(host_blocks)) * bs
            self.host_hits += len(host_blocks) * bs
        if not blocks and not host_blocks:
            return []
        rid = req.request_id
        if self.device_tables.get(rid):
            raise BlockAccountingError(f"{rid!r} takes a cached prefix while holding blocks")
        self.device.touch(blocks)
        table = list(blocks)
        pairs: list[tuple[int, int]] = []
        if host_blocks:
            hashes = self.block_hashes(req, len(blocks) + len(host_blocks))[len(blocks) :]
            dev = self.device.allocate(rid, len(host_blocks))
            self.device.register_many(dev, hashes)
            self.device.pin(dev)
            # The host copies stay cached (and move to the back of the host LRU queue).
            self.host.touch(host_blocks)
            self.host.pin(host_blocks)
            self.host.free(_PROMOTING, host_blocks)
            table += dev
            pairs = list(zip(host_blocks, dev))
        self.device_tables[rid] = table
        self._num_registered[rid] = len(table)
        return pairs

    def take_demotions(self) -> list[tuple[int, int]]:
        """(device, host) copies of cached blocks demoted since the last call (the scheduler
        issues them with its next step's offloads)."""
        out, self._demotions = self._demotions, []
        return out

    def _demote(self, blocks: Sequence[int]) -> None:
        """Copies each of ``blocks`` that its holder is about to free for the last time, that is
        cached and that the host cache lacks, to a host block (evicting the host's least
        recently used cached block); both stay in flight until the copy completes."""
        device, host = self.device, self.host
        for d in blocks:
            if device.ref_count(d) != 1 or device.is_pinned(d):
                continue
            h = device.hash_of(d)
            if h is None or host.cached_block(h) is not None:
                continue
            if not host.num_free:
                return
            (hb,) = host.allocate(_DEMOTING, 1)
            host.register(hb, h)
            host.pin([hb])
            host.free(_DEMOTING, [hb])
            device.pin([d])
            self._demotions.append((d, hb))
            self.demoted_blocks += 1

    def cache_computed(self, req: Request) -> None:
        """Registers ``req``'s full device blocks whose KV is computed (after each step)."""
        self.cache_computed_upto(((req, req.num_computed_tokens),))

    def cache_computed_upto(self, items: Iterable[tuple[Request, int]]) -> None:
        """For each ``(req, n)`` in order: `cache_computed` as if ``req`` had ``n`` tokens
        computed (the simulator's decode runs register a run's blocks in one call)."""
        if not self.enable_prefix_caching:
            return
        tables, registered, bs = self.device_tables, self._num_registered, self.block_size
        blocks: list[int] = []
        keys: list[Hashable] = []
        for req, n in items:
            rid = req.request_id
            table = tables.get(rid)
            if not table:
                continue
            done = registered.get(rid, 0)
            full = min(n // bs, len(table))
            if full <= done:
                continue
            blocks += table[done:full]
            keys += self.block_hashes(req, full)[done:full]
            registered[rid] = full
        if blocks:  # (in order: as one call per request would register them)
            self.device.register_many(blocks, keys)

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
        order = table[::-1]
        if self.host_caching and self.enable_prefix_caching:
            self._demote(order)
        self.device.free(request_id, order)
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
        registered = self._num_registered.pop(request_id, 0)
        host = self.host.allocate(request_id, len(table))
        self.host_tables[request_id] = host
        if self.host_caching and registered:
            # The victim's full blocks become findable in the host cache too (and stay cached
            # there after its restore frees them).
            self.host.register_many(host[:registered], self._hashes[request_id][:registered])
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
