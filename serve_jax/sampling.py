"""Sampling parameters and the on-device sampler (greedy, temperature, top-p), batched.

Randomness is explicit and reproducible: the key of request r's n-th output token is
``fold_in(key(seed_r), n)``, so a request samples the same tokens whatever batch it lands in and
however often it is preempted and recomputed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

__all__ = ["SamplingParams", "sample_tokens"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output.

    Raises ValueError, naming the field, for values out of range.
    """

    max_tokens: int = 16
    """Most output tokens."""
    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it)."""
    seed: int = 0
    """Seed of this request's sampling keys."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks force output lengths)."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        checks = [
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, ">= 1"),
            ("temperature", 0.0 <= float(self.temperature) <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < float(self.top_p) <= 1.0, "in (0, 1]"),
            ("seed", isinstance(self.seed, int) and 0 <= self.seed < 2**31, "in [0, 2**31)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
) -> jax.Array:
    """Samples one token per row.

    Args:
      logits: [B, V] float32.
      temperature: [B]; rows with 0 take the argmax.
      top_p: [B] in (0, 1].
      seeds: [B] int32 per-request seeds.
      counters: [B] int32 index of the token being sampled (output tokens so far).

    Returns:
      [B] int32 token ids.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # An all-greedy batch (the common serving case) skips the vocabulary sort and the noise;
    # rows sample the same tokens either way, so a request's output does not depend on its batch.
    return jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: _sample(logits, temperature, top_p, seeds, counters, greedy),
        lambda: greedy,
    )


def _sample(logits, temperature, top_p, seeds, counters, greedy):
    """Temperature and top-p (nucleus) sampling per row; greedy rows keep the argmax."""
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum = jnp.cumsum(probs, axis=-1)
    keep = (cum - probs) < top_p[:, None]  # always keeps the top token
    masked = jnp.where(keep, sorted_logits, -jnp.inf)

    def one(seed, counter, row):
        key = jax.random.fold_in(jax.random.key(seed), counter)
        return jax.random.categorical(key, row)

    picked = jax.vmap(one)(seeds, counters, masked)
    sampled = jnp.take_along_axis(order, picked[:, None], axis=-1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
