"""What the host cache level keeps: an online estimate of whether a freed prefix comes back.

The host pool as a second prefix-cache level (`serve_jax.kv_blocks`, ``host_caching``) copies
cached device blocks to host memory when their last holder frees them (*demotion*). A demotion
is not free: the device block stays in flight (unusable) until its copy has crossed the host
link, and the link is shared with offloaded preemption victims. On single-turn traffic nothing
demoted is ever looked up again, so every demotion is pure cost (measured on azure-code at 8 GB:
194,156 blocks demoted, 77 of 953 device blocks in flight on average, goodput 2.40 -> 2.09
req/s, with a prefix hit rate of 0).

`ReuseEstimator` decides, for every policy alike, which freed blocks are worth demoting. It
keeps a *shadow* of the keys of the last ``horizon`` cached blocks freed by their last holder,
demoted or not (the horizon is the host pool's size: what an LRU host cache that demoted
everything would still hold), each tagged with its *class*:

* ``preempted``: freed by a recompute preemption (the victim will look its prefix up again);
* ``continued``: freed at the finish of a request whose first admission continued a prefix
  seen before (cached on the device or the host, or recently freed: a later turn of a
  conversation or agent session, whose context may be sent once more), whatever was demoted;
* ``fresh``: freed at the finish of a request that continued nothing (single-turn traffic, or
  a session's first turn).

An admission resolves the shadow: the keys it needs beyond the prefix found on the device,
found in the shadow in one unbroken run, are *reuses* (a host cache holding them would have
served them); a key found on the device again leaves the shadow without a verdict (its
demotion was not needed); a key pushed out of the shadow by newer ones was not reused in time.
The estimate of a class is the share of its resolved keys that were reused, counted from one
miss (nothing is demoted before a reuse has been seen: single-turn traffic is never demoted)
with counts that decay (a traffic mix that changes is followed). Blocks of a class are demoted
when its estimate is at least ``threshold``, and every freed block is demoted while no request
waits for device memory: the blocks a demotion holds in flight then delay nobody, and the rare
reuse of a long context (a session's next turn after the device evicted it) still finds it on
the host. The verdicts do not depend on what was demoted, so a class that stopped being
demoted is still measured and comes back when its blocks are reused again. The same
estimates value the host cache's blocks when it must evict one (`serve_jax.kv_blocks`).
Pure Python (no JAX).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

__all__ = ["RETENTION_MODES", "REUSE_CLASSES", "ReuseEstimator"]

REUSE_CLASSES = ("preempted", "continued", "fresh")
"""Why a block was freed (see the module docstring)."""

RETENTION_MODES = ("predicted", "all")
"""``predicted``: demote the classes `ReuseEstimator` expects back; ``all``: demote every freed
cached block (least recently used host blocks evicted first, the first host-tier design)."""


class ReuseEstimator:
    """Per-class estimate that a freed cached block is looked up again within ``horizon``.

    Args:
      horizon: keys remembered (the host pool's size in blocks).
      threshold: the least estimate at which a class is demoted.
      decay: factor applied to a class's counts at each verdict (1.0: plain counts).
    """

    def __init__(self, horizon: int, threshold: float = 0.2, decay: float = 0.9999):
        if horizon < 0:
            raise ValueError(f"horizon must be >= 0, got {horizon}")
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.horizon = horizon
        self.threshold = threshold
        self.decay = decay
        self._shadow: OrderedDict[Hashable, str] = OrderedDict()
        # class -> [reuses, misses], from one miss (no demotion before a reuse is seen)
        self._counts = {c: [0.0, 1.0] for c in REUSE_CLASSES}
        self.reused = dict.fromkeys(REUSE_CLASSES, 0)
        """Keys of each class found again by an admission that needed them (not decayed)."""
        self.expired = dict.fromkeys(REUSE_CLASSES, 0)
        """Keys of each class pushed out of the shadow unused (not decayed)."""

    def estimate(self, cls: str) -> float:
        """The estimated chance that a block of ``cls`` is needed again from the host."""
        reuses, misses = self._counts[cls]
        return reuses / (reuses + misses)

    def worth_demoting(self, cls: str, contended: bool = True) -> bool:
        """Whether blocks freed as ``cls`` should be copied to the host cache; ``contended``:
        whether a request waits for device memory (if not, a demotion costs nothing)."""
        return not contended or self.estimate(cls) >= self.threshold

    def _verdict(self, cls: str, reused: bool) -> None:
        counts = self._counts[cls]
        counts[0] *= self.decay
        counts[1] *= self.decay
        counts[not reused] += 1.0
        (self.reused if reused else self.expired)[cls] += 1

    def freed(self, keys: Sequence[Hashable], cls: str) -> None:
        """Cached blocks with these keys were freed by their last holder, as ``cls``."""
        if cls not in self._counts:
            raise ValueError(f"unknown reuse class {cls!r}; expected one of {REUSE_CLASSES}")
        shadow = self._shadow
        for key in keys:
            if key in shadow:
                shadow.move_to_end(key)
            shadow[key] = cls
        while len(shadow) > self.horizon:
            _, old = shadow.popitem(last=False)
            self._verdict(old, False)

    def looked_up(self, keys: Sequence[Hashable], on_device: int) -> int:
        """An admission looked up its prefix ``keys`` and found the first ``on_device`` of them
        cached on the device; the rest were needed from the host (or computed). Returns how
        many of those were freed recently enough to count as reused."""
        shadow = self._shadow
        if not shadow:
            return 0
        for key in keys[:on_device]:
            shadow.pop(key, None)
        found = 0
        for key in keys[on_device:]:
            cls = shadow.pop(key, None)
            if cls is None:
                break
            self._verdict(cls, True)
            found += 1
        return found
