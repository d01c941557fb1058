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
(finish or recompute preemption) is *demoted* when the retention rule keeps it
(`serve_jax.host_retention`: by default, when blocks freed the same way have been looked up
again often enough; ``host_retention="all"``: always): copied to a host block, both blocks in
flight until the copy lands (`take_demotions` hands the copies to the scheduler); nothing is
demoted when every host block is held. The host evicts a cached block for it: with
``host_retention="all"`` the least recently used one; by default the least valuable of the
least recently used ones (uncached blocks first, then by the reuse estimate of the class the
block was freed as). By default a recompute victim's blocks are demoted only once the plan
that preempted it is made, those still free, and only from the device memory the next step
does not need (they were freed because memory was short; `take_demotions`).

An admission whose device prefix stops where the host cache goes on *promotes*
those blocks (`lookup`, `take_prefix`): fresh device blocks, registered under the same keys,
filled by host -> device copies before the step's compute, instead of recomputed. Offloaded
victims' full blocks are registered in the host cache as well, and stay cached there after their
restore, so one pool serves offloaded victims and cached prefixes; an offload shares the
victim's leading blocks already cached there (its earlier offload, a demotion) instead of
copying them again.

Offload of a request moves its device table to freshly allocated host blocks: the device blocks
become in-flight (released when the copy completes), the host blocks are owned by the request.
Restore is the mirror image: device blocks are allocated to the request, the host blocks become
in-flight until the executor reports the restore complete.

One module past the ~500-line guideline, on purpose: the manager is the one owner of both
pools' tables, and each host-level step (a demotion, a promotion, an offload sharing host-cached
blocks) is interleaved with the device-table change it accompanies; split, the invariants above
would span two classes. Block keys are in `serve_jax.block_hash`, the pools in
`serve_jax.block_pool`, the retention estimate in `serve_jax.host_retention`.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import TYPE_CHECKING

from serve_jax.block_hash import BLOCK_HASHES
from serve_jax.block_pool import BlockAccountingError, BlockPool
from serve_jax.host_retention import RETENTION_MODES, REUSE_CLASSES, ReuseEstimator

if TYPE_CHECKING:
    from serve_jax.interface import Request

EVICTION_WINDOW = 64
"""Guided host eviction looks this many blocks past the ones it needs at the front of the host
free queue (least recently used first) and evicts the least valuable of them."""

_DEMOTING = "<demoting>"
_PROMOTING = "<promoting>"
"""Owners of a host block for the moment of pinning it (a demotion or a promotion copy)."""

__all__ = [
    "BlockPool",
    "KVBlockManager",
    "BlockAccountingError",
    "blocks_for_tokens",
]


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
      block_hash: the key function of full blocks, a name of
        `serve_jax.block_hash.BLOCK_HASHES` (``blake2b``, the
        default, or ``builtin``, the simulator's cheaper one).
      host_caching: the host pool as a second cache level (see the module docstring): cached
        device blocks freed by their last holder are demoted to host blocks, and an admission
        whose prefix continues in the host cache promotes those blocks instead of computing
        them. Needs prefix caching and a host pool.
      host_retention: which freed blocks host caching demotes, a name of `RETENTION_MODES`:
        ``predicted`` (the default: the classes a `ReuseEstimator` expects to be looked up
        again) or ``all``.
    """

    def __init__(
        self,
        num_device_blocks: int,
        num_host_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        block_hash: str = "blake2b",
        host_caching: bool = False,
        host_retention: str = "predicted",
    ):
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if block_hash not in BLOCK_HASHES:
            raise ValueError(f"block_hash must be one of {sorted(BLOCK_HASHES)}: {block_hash!r}")
        if host_retention not in RETENTION_MODES:
            raise ValueError(
                f"host_retention must be one of {', '.join(RETENTION_MODES)}: {host_retention!r}"
            )
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
        self.offload_hit_blocks = 0
        """Blocks of offloaded requests found cached in the host pool (shared, not copied)."""
        self._demotions: list[tuple[int, int]] = []
        self.retention = (
            ReuseEstimator(num_host_blocks)
            if host_caching and host_retention == "predicted"
            else None
        )
        """What host caching demotes (None: every freed cached block)."""
        self.memory_contended = True
        """Whether a request waits for device memory (the scheduler sets it each step)."""
        # Requests whose first admission continued a known prefix (freed as "continued").
        self._continued: set[str] = set()
        # Guided retention: (device block, key, class) freed to be demoted at the plan's end;
        # the reuse class of each cached host block (its value when the host must evict).
        self._to_demote: list[tuple[int, Hashable, str]] = []
        self._host_class: dict[int, str] = {}

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
        # (the memo may be longer: a lookup with fewer tokens must not walk past them)
        return hashes if len(hashes) == num_blocks else hashes[:num_blocks]

    def lookup(
        self, req: Request, max_tokens: int | None = None, host: bool = True
    ) -> tuple[list[int], list[int]]:
        """The cached blocks holding the longest prefix of ``req``'s tokens, in one walk over
        its chained keys: device blocks, then (``host`` and host caching on) the host blocks
        that continue that prefix in the host cache (blocks whose copy is still in flight are
        not used).

        At most ``max_tokens`` tokens (default ``num_tokens - 1``: the last one is computed to
        sample from) are taken from the cache; nothing when caching is off or ``req`` already
        holds device blocks.
        """
        if not self.enable_prefix_caching or self.device_tables.get(req.request_id):
            return [], []
        if max_tokens is None:
            max_tokens = req.num_tokens - 1
        n = max_tokens // self.block_size
        if n <= 0:
            return [], []
        hashes = self.block_hashes(req, n)
        on_device = self.device.cached_run(hashes)
        if host and self.host_caching and len(on_device) < n:
            return on_device, self.host.cached_run(hashes[len(on_device) : n], unpinned=True)
        return on_device, []

    def lookup_prefix(self, req: Request, max_tokens: int | None = None) -> list[int]:
        """The device blocks of `lookup` (a restore shares them instead of copying back)."""
        return self.lookup(req, max_tokens, host=False)[0]

    def take_prefix(
        self, req: Request, blocks: list[int], host_blocks: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """Starts ``req``'s device table with the cached ``blocks``, then one fresh device block
        per host block of ``host_blocks`` (both from `lookup`), registered under the same key
        and filled by a copy; counts the lookup in the hit-rate statistics (and in the
        retention estimate).

        Returns:
          (host block, device block) pairs to copy before the step's compute (promotions); the
          blocks stay in flight until `complete_restore` is called for each pair.
        """
        bs = self.block_size
        if self.enable_prefix_caching:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += (len(blocks) + len(host_blocks)) * bs
            self.host_hits += len(host_blocks) * bs
            if self.retention is not None:
                keys = self.block_hashes(req, (req.num_tokens - 1) // bs)
                seen = self.retention.looked_up(keys, len(blocks))
                if (blocks or host_blocks or seen) and not req.num_preemptions:  # (a later turn)
                    self._continued.add(req.request_id)
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

    def take_demotions(self, keep_free: int = 0) -> list[tuple[int, int]]:
        """(device, host) copies of cached blocks demoted since the last call (the scheduler
        issues them with its next step's offloads, once that step's plan is made).

        With guided retention, the blocks of recompute victims are demoted here, not when the
        preemption frees them (it freed them because the step needs memory): those still free
        and cached once the plan is made (a block the plan took is not held in flight for a
        copy), and only as many as leave ``keep_free`` device blocks free (the scheduler's
        estimate of what its next step needs)."""
        if self._to_demote:
            device = self.device
            chosen = [
                (d, h, cls)
                for d, h, cls in self._to_demote
                if device.is_free(d) and device.hash_of(d) == h
            ]
            self._to_demote = []
            self._copy_to_host(chosen, max(0, device.num_free - keep_free), held=False)
        out, self._demotions = self._demotions, []
        return out

    def _copy_to_host(
        self, blocks: Sequence[tuple[int, Hashable, str | None]], limit: int, held: bool
    ) -> None:
        """Demotes (device block, key, reuse class) triples whose key the host cache lacks, at
        most ``limit`` of them and as many as the host has free blocks for; ``held``: their
        holder frees them next (else they are free, and leave the free queue while copied).
        Both blocks of each copy stay in flight until it completes."""
        device, host = self.device, self.host
        chosen: list[tuple[int, Hashable, str | None]] = []
        seen: set[Hashable] = set()
        for d, h, cls in blocks:
            if h not in seen and host.cached_block(h) is None:
                seen.add(h)
                chosen.append((d, h, cls))
        chosen = chosen[: min(limit, host.num_free)]
        if not chosen:
            return
        hbs = self._host_allocate(_DEMOTING, len(chosen))
        devs = [d for d, _, _ in chosen]
        if not held:
            device.touch(devs)
        device.pin(devs)
        if not held:
            device.free(_DEMOTING, devs)
        host.register_many(hbs, [h for _, h, _ in chosen])
        host.pin(hbs)
        host.free(_DEMOTING, hbs)
        for (d, _, cls), hb in zip(chosen, hbs):
            if cls is not None:
                self._host_class[hb] = cls
            self._demotions.append((d, hb))
        self.demoted_blocks += len(chosen)

    def _host_allocate(self, owner: str, n: int) -> list[int]:
        """``n`` host blocks for ``owner``. With guided retention, the host evicts by value:
        among the ``n + EVICTION_WINDOW`` least recently used free blocks, uncached ones first,
        then cached ones by the reuse estimate of the class their block was freed as (least
        recently used first among equals); otherwise least recently used first."""
        host = self.host
        if self.retention is not None and n and host.num_cached:
            classes = self._host_class
            worth = {cls: self.retention.estimate(cls) for cls in REUSE_CLASSES}

            def value(b: int) -> float:
                if host.hash_of(b) is None:
                    return -1.0
                cls = classes.get(b)
                return worth[cls] if cls is not None else 0.0

            host.evict_first(sorted(host.oldest_free(n + EVICTION_WINDOW), key=value)[:n])
            out = host.allocate(owner, n)
            for b in out:
                classes.pop(b, None)
            return out
        return host.allocate(owner, n)

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
            keys += self.block_hashes(req, full)[done:]
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

    def free_device(self, request_id: str, finished: bool = False) -> list[int]:
        """Frees ``request_id``'s device blocks (recompute preemption, or ``finished``).

        The blocks go to the free queue last block first, so a prefix is evicted from its end;
        registered ones stay findable until evicted. With host caching, those the retention
        rule keeps are demoted first.
        """
        table = self.device_tables.pop(request_id, [])
        self._num_registered.pop(request_id, None)
        order = table[::-1]
        if self.host_caching and self.enable_prefix_caching:
            device = self.device
            freed = [
                (d, h)
                for d in order
                if device.ref_count(d) == 1 and (h := device.hash_of(d)) is not None
            ]
            cls = None
            if self.retention is not None:
                if not finished:
                    cls = "preempted"
                elif request_id in self._continued:
                    cls = "continued"
                else:
                    cls = "fresh"
                self.retention.freed([h for _, h in freed], cls)
            # A recompute victim waits for device memory itself: its blocks are contended
            # whatever the last plan saw.
            contended = self.memory_contended or not finished
            if cls is None or self.retention.worth_demoting(cls, contended):
                demote = [(d, h, cls) for d, h in freed if not device.is_pinned(d)]
                if cls == "preempted":  # (demoted once the plan that needed the memory is made)
                    self._to_demote.extend(demote)
                else:
                    self._copy_to_host(demote, len(demote), held=True)
        self.device.free(request_id, order)
        return table

    def free(self, request_id: str) -> None:
        """Frees everything ``request_id`` holds, device and host (finish or abort)."""
        self.free_device(request_id, finished=True)
        self._continued.discard(request_id)
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

        With host caching, the leading blocks of the request already cached in the host pool
        (an earlier offload of the same request, a demotion, a shared prefix) are shared
        instead of copied again: their device blocks are freed at once. The other device blocks
        stay in flight until `complete_offload` is called for each pair.
        """
        if request_id in self.host_tables:
            raise BlockAccountingError(f"{request_id!r} is already offloaded")
        table = self.device_tables.pop(request_id, [])
        registered = self._num_registered.pop(request_id, 0)
        shared: list[int] = []
        if self.host_caching and registered:
            hashes = self._hashes[request_id][:registered]
            shared = self.host.cached_run(hashes)  # (pinned ones too: a restore waits for them)
            self.host.touch(shared)
            self.offload_hit_blocks += len(shared)
        k = len(shared)
        host = self._host_allocate(request_id, len(table) - k)
        self.host_tables[request_id] = shared + host
        if registered > k and self.host_caching:
            # The victim's full blocks become findable in the host cache too (and stay cached
            # there after its restore frees them, valued as a recompute victim's blocks).
            self.host.register_many(host[: registered - k], hashes[k:])
            if self.retention is not None:
                self._host_class.update(dict.fromkeys(host[: registered - k], "preempted"))
        self.device.pin(table[k:])
        self.host.pin(host)
        self.device.free(request_id, table)
        return list(zip(table[k:], host))

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
        return bool(self.device.num_pinned or self.host.num_pinned)

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
