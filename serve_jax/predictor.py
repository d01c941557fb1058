"""Online predictor of a request's remaining output length, and its error bookkeeping.

What it predicts: for a request with prompt length ``p`` that has generated ``g`` tokens so far,
the distribution of the tokens it still has to generate, ``R = L - g`` where ``L`` is its final
output length. The estimate is the residual-life distribution of ``L`` given ``L > g``:

- empirical part: completed requests' output lengths, kept in a sliding window per prompt-length
  bucket (log2 of ``p``) and in one global window. ``E[L - g | L > g]`` and its quantiles come
  from the samples above ``g`` (a sorted list for ranks, a Fenwick tree of sums by length:
  ``O(log)`` per query and per update, exact integer sums).
- parametric part: a log-normal fitted online to the same samples (Welford on ``log L``), which
  starts at a prior (cold start) and answers beyond the largest sample seen (the tail).
- tail: a request older than every completed request is expected to run on for at least
  ``tail_factor`` times its age (it has outlived the data; heavy tails make it likely to go on).
- shrinkage: an estimate backed by ``n`` conditional samples gets weight ``n / (n + k)`` against
  the level above it (bucket -> global -> log-normal), so a bucket with few samples leans on the
  global pool and a fresh predictor on the prior.

The prediction moves with every generated token (it is conditioned on ``g``), and the predictor
learns from every completed request (`observe`). Nothing here reads the request's true length:
the simulator forces output lengths through ``max_tokens``, so a ``cap`` must only be passed
where ``max_tokens`` is a user cap, not the answer.

`predicted_peak_tokens` turns the predictions of a set of requests into the most tokens they
will hold at once (the memory test of `serve_jax.preemption`'s predictive policy).

`PredictionLog` records predictions made while requests run (at admission and then at every
``record_every`` tokens), and when they finish reports MAE and the calibration of the predicted
quantiles (the fraction of outcomes at or below the q-quantile should be close to q).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import operator
from collections import deque
from statistics import NormalDist

import numpy as np

__all__ = ["Prediction", "RemainingLengthPredictor", "PredictionLog", "predicted_peak_tokens"]

_STD_NORMAL = NormalDist()
_SQRT2 = math.sqrt(2.0)  # as `statistics.NormalDist.cdf` divides by it
_INV_CDF = _STD_NORMAL.inv_cdf
_P_MAX = 1.0 - 1e-12  # the highest probability level the quantiles are taken at


@dataclasses.dataclass(frozen=True)
class Prediction:
    """Predicted remaining output tokens of one request at one moment."""

    mean: float
    """Expected remaining tokens."""
    quantiles: dict[float, float]
    """Remaining tokens at each quantile level (e.g. {0.1: ..., 0.5: ..., 0.9: ...})."""


class _Pool:
    """A sliding window of output lengths: sorted (for quantiles by rank), with a Fenwick tree
    of their sums by value (exact integer sums above any length in ``O(log max)``)."""

    def __init__(self, window: int):
        self.window = window
        self.fifo: deque[int] = deque()
        self.sorted: list[int] = []
        self.total = 0
        self._size = 1024  # the tree covers lengths 1 .. _size (doubled when one is longer)
        self._tree = [0] * (self._size + 1)
        # Welford on log(length) for the log-normal fit.
        self.n = 0
        self.mean_log = 0.0
        self.m2_log = 0.0

    def add(self, length: int) -> None:
        self.fifo.append(length)
        bisect.insort(self.sorted, length)
        self._welford(math.log(max(length, 1)), +1)
        self._update(length, length)
        if len(self.fifo) > self.window:
            old = self.fifo.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]
            self._welford(math.log(max(old, 1)), -1)
            self._update(old, -old)

    def _update(self, length: int, delta: int) -> None:
        if length > self._size:
            while self._size < length:
                self._size *= 2
            self._tree = [0] * (self._size + 1)
            for v in self.sorted:  # (``length`` itself is already in ``sorted``)
                self._add_tree(v, v)
            self.total = sum(self.sorted)
            return
        self.total += delta
        self._add_tree(length, delta)

    def _add_tree(self, i: int, delta: int) -> None:
        tree, n = self._tree, self._size
        while i <= n:
            tree[i] += delta
            i += i & -i

    def sum_upto(self, length: int) -> int:
        """Sum of the samples <= ``length``."""
        tree = self._tree
        i = min(length, self._size)
        s = 0
        while i > 0:
            s += tree[i]
            i &= i - 1
        return s

    def _welford(self, x: float, sign: int) -> None:
        if sign > 0:
            self.n += 1
            d = x - self.mean_log
            self.mean_log += d / self.n
            self.m2_log += d * (x - self.mean_log)
        else:
            if self.n <= 1:
                self.n, self.mean_log, self.m2_log = 0, 0.0, 0.0
                return
            d = x - self.mean_log
            self.mean_log -= d / (self.n - 1)
            self.m2_log -= d * (x - self.mean_log)
            self.n -= 1
            self.m2_log = max(self.m2_log, 0.0)


class RemainingLengthPredictor:
    """Online remaining-output-length predictor (see the module docstring).

    Args:
      prior_median: median output length assumed before any request completes.
      prior_sigma: log-space standard deviation of the prior log-normal.
      prior_strength: pseudo-samples the prior counts for in the log-normal fit.
      shrinkage: ``k`` in the ``n / (n + k)`` weight of an empirical estimate.
      window: completed requests kept per pool (older ones are forgotten: drift).
      quantiles: quantile levels reported by `predict`.
      tail_factor: a request older than every completed one is expected to run on for at
        least this fraction of its age.
    """

    def __init__(
        self,
        *,
        prior_median: float = 256.0,
        prior_sigma: float = 1.0,
        prior_strength: float = 8.0,
        shrinkage: float = 16.0,
        window: int = 4096,
        quantiles: tuple[float, ...] = (0.1, 0.5, 0.9),
        tail_factor: float = 0.5,
    ):
        if prior_median <= 0 or prior_sigma <= 0:
            raise ValueError("prior_median and prior_sigma must be positive")
        if shrinkage < 0 or prior_strength < 0 or window <= 0:
            raise ValueError("shrinkage and prior_strength must be >= 0 and window positive")
        if not all(0.0 < q < 1.0 for q in quantiles):
            raise ValueError(f"quantile levels must be in (0, 1), got {quantiles}")
        self.prior_mu = math.log(prior_median)
        self.prior_sigma = prior_sigma
        self.prior_strength = prior_strength
        self.shrinkage = shrinkage
        self.window = window
        self.quantile_levels = tuple(quantiles)
        if tail_factor < 0:
            raise ValueError(f"tail_factor must be >= 0, got {tail_factor}")
        self.tail_factor = tail_factor
        self.global_pool = _Pool(window)
        self.buckets: dict[int, _Pool] = {}
        self.num_observed = 0
        self._fit: tuple[float, float] | None = None  # `_lognormal` until the next observe
        self._fit_mean = 0.0  # the fit's mean, exp(mu + sigma^2 / 2)
        self._unconditional: dict[tuple[float, ...], list[float]] = {}  # its quantiles

    @staticmethod
    def bucket_of(prompt_len: int) -> int:
        """Prompt-length bucket: floor(log2(prompt_len))."""
        return max(int(prompt_len), 1).bit_length() - 1

    def observe(self, prompt_len: int, output_len: int) -> None:
        """Learns from one completed request."""
        if output_len < 0 or prompt_len < 0:
            raise ValueError(f"bad completed request: prompt {prompt_len}, output {output_len}")
        output_len = max(int(output_len), 1)
        self.global_pool.add(output_len)
        b = self.bucket_of(prompt_len)
        if b not in self.buckets:
            self.buckets[b] = _Pool(self.window)
        self.buckets[b].add(output_len)
        self.num_observed += 1
        self._fit = None

    # -- the parametric (log-normal) level -----------------------------------------------------

    def _lognormal(self) -> tuple[float, float]:
        """Log-normal (mu, sigma) of the global pool, shrunk towards the prior."""
        pool, k = self.global_pool, self.prior_strength
        n = pool.n
        mu = (n * pool.mean_log + k * self.prior_mu) / (n + k) if n + k > 0 else self.prior_mu
        var = (pool.m2_log + k * self.prior_sigma**2) / (n + k) if n + k > 0 else 0.0
        return mu, max(math.sqrt(var), 1e-3)

    def _refit(self) -> tuple[float, float]:
        """Sets the fit (`_lognormal`), its mean and an empty cache of its quantiles."""
        mu, sigma = self._fit = self._lognormal()
        self._fit_mean = math.exp(mu + sigma**2 / 2)
        self._unconditional = {}
        return mu, sigma

    # -- prediction --------------------------------------------------------------------------

    def predict(
        self,
        prompt_len: int,
        generated: int,
        *,
        cap: int | None = None,
        levels: tuple[float, ...] | None = None,
    ) -> Prediction:
        """Remaining output tokens of a request.

        Args:
          prompt_len: prompt tokens.
          generated: output tokens generated so far.
          cap: most tokens the request may still generate (``max_tokens - generated``) when that
            is a real user cap; None when unknown.
          levels: quantile levels; default the predictor's.

        Returns:
          A `Prediction` (at least one token remaining; never above ``cap``).
        """
        levels = self.quantile_levels if levels is None else levels
        mean, qs = self.estimate(prompt_len, generated, levels, cap)
        return Prediction(mean, dict(zip(levels, qs)))

    def mean_and_quantile(
        self, prompt_len: int, generated: int, level: float
    ) -> tuple[float, float]:
        """`predict`'s mean and ``level``-quantile, without building a `Prediction` (the
        policies' hot path)."""
        mean, qs = self.estimate(prompt_len, generated, (level,))
        return mean, qs[0]

    def estimate(
        self, prompt_len: int, generated: int, levels: tuple[float, ...], cap: int | None = None
    ) -> tuple[float, list[float]]:
        """The mean and the quantiles at ``levels`` of `predict` (one pass, no objects: the
        policies call this for every running request at every admission step)."""
        if generated < 0 or prompt_len < 0:
            raise ValueError(f"bad request state: prompt {prompt_len}, generated {generated}")
        fit = self._fit
        if fit is None:
            fit = self._refit()
        mu, sigma = fit
        g = generated
        # The log-normal level: residual life of L given L > g. (Plain loops over ``levels``
        # rather than comprehensions: this runs ~10^5 times a simulated hour.)
        if g <= 0:
            qs = self._unconditional.get(levels)
            if qs is None:
                qs = self._unconditional[levels] = [
                    math.exp(mu + sigma * _INV_CDF(q)) for q in levels
                ]
            mean = self._fit_mean
            qs = qs.copy()
        else:
            z = (math.log(g) - mu) / sigma
            below = 0.5 * (1.0 + math.erf(z / _SQRT2))  # the standard normal cdf at z
            surv = 1.0 - below
            if surv < 1e-12:
                # Far beyond the fitted distribution: the residual of the tail is about
                # g * sigma^2 / (log g - mu) (Mills ratio); keep it at least one token.
                mean = max(g * sigma**2 / max(math.log(g) - mu, 1e-6), 1.0)
                qs = [mean * (q / 0.5) for q in levels]
            else:
                # E[L 1{L>g}] / exp(mu + s^2/2) is the cdf at sigma - z.
                partial = 0.5 * (1.0 + math.erf((sigma - z) / _SQRT2))
                mean = self._fit_mean * partial / surv - g
                if 1.0 > mean:
                    mean = 1.0
                qs = []
                for q in levels:
                    p = below + q * surv
                    v = math.exp(mu + sigma * _INV_CDF(_P_MAX if _P_MAX < p else p)) - g
                    qs.append(0.0 if 0.0 > v else v)
        # The empirical levels, global then the prompt's bucket, each shrunk towards the level
        # above by n / (n + k) where n samples lie above g.
        k = self.shrinkage
        pool = self.global_pool
        bucket = self.buckets.get(max(int(prompt_len), 1).bit_length() - 1)  # `bucket_of`
        while pool is not None:
            srt = pool.sorted
            start = bisect.bisect_right(srt, g)
            count = len(srt) - start
            if count:
                w = count / (count + k) if k > 0 else 1.0
                mean = w * (float(pool.total - pool.sum_upto(g)) / count - g) + (1 - w) * mean
                last = len(srt) - 1
                for j in range(len(levels)):
                    pos = start + levels[j] * (count - 1)
                    lo = int(pos)  # (pos >= 0: its floor)
                    frac = pos - lo
                    hi = lo + 1 if lo < last else last
                    v = (1 - frac) * srt[lo] + frac * srt[hi] - g
                    qs[j] = w * v + (1 - w) * qs[j]
            pool, bucket = bucket, None
        top = self.global_pool.sorted
        if top and generated >= top[-1] and self.tail_factor > 0:
            # Older than every completed request: the data says nothing, and a request that
            # has outlived all predictions tends to run on (heavy tails). Expect another
            # ``tail_factor`` of its age rather than the near-zero residual of the fit.
            floor = self.tail_factor * generated
            if mean < floor:
                scale = floor / mean
                mean, qs = floor, [v * scale for v in qs]
        # Clamp to [1, cap] (``max`` and ``min``'s choices, spelled out).
        hi = float(cap) if cap is not None else math.inf
        if 1.0 > hi:
            hi = 1.0
        if 1.0 > mean:
            mean = 1.0
        if mean > hi:
            mean = hi
        for j in range(len(qs)):
            v = qs[j]
            if 1.0 > v:
                v = 1.0
            if v > hi:
                v = hi
            qs[j] = v
        return mean, qs


class PredictionLog:
    """Records predictions while requests run; scores them when the requests finish.

    Args:
      predictor: the predictor being scored.
      record_every: record a prediction at admission and then every this many tokens.
    """

    def __init__(self, predictor: RemainingLengthPredictor, record_every: int = 64):
        if record_every <= 0:
            raise ValueError(f"record_every must be positive, got {record_every}")
        self.predictor = predictor
        self.record_every = record_every
        self._open: dict[str, list[tuple[int, Prediction]]] = {}
        self.abs_errors: list[float] = []
        self.rel_errors: list[float] = []
        self.covered: dict[float, int] = {q: 0 for q in predictor.quantile_levels}
        self.num_scored = 0

    def maybe_record(self, request_id: str, prompt_len: int, generated: int) -> None:
        """Records a prediction if ``generated`` is on the recording grid."""
        if generated % self.record_every:
            return
        rows = self._open.setdefault(request_id, [])
        if not rows or rows[-1][0] != generated:
            rows.append((generated, self.predictor.predict(prompt_len, generated)))

    def finish(self, request_id: str, output_len: int) -> None:
        """Scores the recorded predictions of a finished request against its true length."""
        for generated, pred in self._open.pop(request_id, []):
            actual = output_len - generated
            if actual <= 0:
                continue
            err = abs(pred.mean - actual)
            self.abs_errors.append(err)
            self.rel_errors.append(err / actual)
            for q, v in pred.quantiles.items():
                self.covered[q] += int(actual <= v)
            self.num_scored += 1

    def summary(self) -> dict[str, float]:
        """MAE (tokens), mean relative error, and observed coverage of each quantile."""
        n = self.num_scored
        out: dict[str, float] = {
            "predictions_scored": float(n),
            "mae_tokens": float(np.mean(self.abs_errors)) if n else float("nan"),
            "mean_relative_error": float(np.mean(self.rel_errors)) if n else float("nan"),
        }
        for q, c in self.covered.items():
            out[f"coverage_q{int(round(q * 100)):02d}"] = c / n if n else float("nan")
        return out


_HELD = operator.itemgetter(0)
_REMAINING = operator.itemgetter(1)


def predicted_peak_tokens(items: list[tuple[float, float]]) -> float:
    """Peak of ``sum_{i: r_i >= h} (c_i + h)`` over horizons ``h >= 0``.

    Args:
      items: ``(c_i, r_i)``: tokens held now and predicted remaining tokens of each request.

    Returns:
      The predicted peak number of tokens held at once (requests free their memory when done).
    """
    if not items:
        return 0.0
    best, prefix_c = 0.0, 0.0
    k = 0
    for c, r in sorted(items, key=_REMAINING, reverse=True):  # (stable, as key -r)
        prefix_c += c
        k += 1
        # Just before the request with the k-th longest remaining length finishes, the k
        # requests with r >= r_k are all alive and each has grown by r_k tokens.
        v = prefix_c + k * r
        if v > best:  # (``max``, spelled out: the gate asks this every admission step)
            best = v
    total = sum(map(_HELD, items))
    return total if total > best else best
