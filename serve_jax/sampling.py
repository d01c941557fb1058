"""Sampling parameters and the on-device sampler, batched.

Two samplers share one random draw:

* `sample_tokens` (greedy, temperature, top-p): the plain path every step takes when no row of
  the batch asks for more;
* `sample_full`: vLLM's sampler (``vllm/v1/sample/sampler.py``) in its order. Logprobs are
  taken from the raw logits (vLLM's default ``raw_logprobs``); then the stop tokens of rows
  still short of ``min_tokens`` are banned; then `apply_penalties` (repetition, frequency,
  presence, exactly vLLM's ``apply_penalties``); then greedy rows take the argmax, and
  sampled rows divide by the temperature and apply ``min_p``, ``top_k`` and ``top_p``.

Randomness is explicit and reproducible: the key of request r's n-th output token is
``fold_in(key(seed_r), n)``, so a request samples the same tokens whatever batch it lands in,
whichever of the two paths its batch takes, and however often it is preempted and recomputed.

The host side (`full_sampler_arrays`) builds the extra arrays of `sample_full` from each row's
`SequenceSampling`: the token history (prompt, then output) that penalties count, padded with
the vocabulary size (an index the scatter drops, as vLLM pads), and the banned stop ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_LOGPROBS",
    "SamplingParams",
    "SequenceSampling",
    "apply_penalties",
    "full_sampler_arrays",
    "sample_full",
    "sample_tokens",
]

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for (vLLM's default ``max_logprobs``, OpenAI's cap)."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's output (vLLM's `SamplingParams` fields and meanings).

    Raises ValueError, naming the field, for values out of range.
    """

    max_tokens: int = 16
    """Most output tokens."""
    temperature: float = 0.0
    """0 is greedy; otherwise logits are divided by it."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 keeps all."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token already in the output."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it is in the output."""
    repetition_penalty: float = 1.0
    """Tokens in the prompt or output: positive logits divided by it, negative multiplied."""
    stop: tuple[str, ...] = ()
    """Strings that end the output (not included in it)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the output (besides EOS; kept in the ids, not in the text)."""
    seed: int = 0
    """Seed of this request's sampling keys."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks force output lengths)."""
    min_tokens: int = 0
    """Output tokens before EOS, ``stop_token_ids`` or a stop string may end the request."""
    logprobs: int | None = None
    """Return the sampled token's logprob and this many top logprobs per token (None: none)."""
    n: int = 1
    """Samples of the prompt (they share its KV pages; sample i uses ``seed + i``)."""

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)

        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        checks = [
            ("max_tokens", is_int(self.max_tokens) and self.max_tokens >= 1, ">= 1"),
            ("temperature", 0.0 <= float(self.temperature) <= 100.0, "in [0, 100]"),
            ("top_p", 0.0 < float(self.top_p) <= 1.0, "in (0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "-1, 0 (all) or >= 1"),
            ("min_p", 0.0 <= float(self.min_p) <= 1.0, "in [0, 1]"),
            ("presence_penalty", -2.0 <= float(self.presence_penalty) <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= float(self.frequency_penalty) <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < float(self.repetition_penalty) <= 100.0, "in (0, 100]"),
            ("seed", is_int(self.seed) and 0 <= self.seed < 2**31, "in [0, 2**31)"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "non-empty strings"),
            (
                "stop_token_ids",
                all(is_int(t) and t >= 0 for t in self.stop_token_ids),
                "token ids >= 0",
            ),
            (
                "min_tokens",
                is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
                "in [0, max_tokens]",
            ),
            (
                "logprobs",
                self.logprobs is None
                or (is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"in [0, {MAX_LOGPROBS}]",
            ),
            ("n", is_int(self.n) and self.n >= 1, ">= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"{name} must be {want}, got {getattr(self, name)!r}")

    @property
    def has_penalties(self) -> bool:
        """Whether any of the three penalties changes the logits."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def needs_full_sampler(self) -> bool:
        """Whether this request needs `sample_full` (anything beyond temperature and top-p)."""
        return bool(
            self.has_penalties
            or self.top_k
            or self.min_p
            or self.min_tokens
            or self.logprobs is not None
        )


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceSampling:
    """What the executor needs to sample one sequence: its parameters and live token history.

    The engine puts one in each `serve_jax.interface.Request.sampling`; ``output_token_ids`` is
    the request's own (growing) list, read at each step up to the chunk's output count.
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    stop_token_ids: frozenset[int] = frozenset()
    """EOS (unless ``ignore_eos``) and ``stop_token_ids``: banned before ``min_tokens``."""


def sample_tokens(
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    counters: jax.Array,
) -> jax.Array:
    """Samples one token per row (greedy, temperature, top-p).

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


def _sample(logits, temperature, top_p, seeds, counters, greedy, top_k=None, min_p=None):
    """Temperature, min-p, top-k and top-p sampling per row; greedy rows keep ``greedy``."""
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = logits / safe_t[:, None]
    if min_p is not None:
        probs = jax.nn.softmax(scaled, axis=-1)
        floor = min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        scaled = jnp.where(probs < floor, -jnp.inf, scaled)
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    if top_k is not None:
        rank = jnp.arange(sorted_logits.shape[-1])[None, :]
        cut = (top_k[:, None] > 0) & (rank >= top_k[:, None])
        sorted_logits = jnp.where(cut, -jnp.inf, sorted_logits)
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


def apply_penalties(logits, history, num_prompt, presence, frequency, repetition):
    """vLLM's ``apply_penalties`` on a batch.

    Args:
      logits: [B, V] float32.
      history: [B, H] int32: each row's prompt ids, then its output ids, padded with V.
      num_prompt: [B] int32: how many leading ``history`` entries are the prompt.
      presence, frequency, repetition: [B] penalties (0, 0, 1 change nothing).

    Returns:
      [B, V]: for tokens in the prompt or output, positive logits divided by the repetition
      penalty and negative ones multiplied; then ``frequency * count_in_output`` and
      ``presence * (count_in_output > 0)`` subtracted.
    """
    b, v = logits.shape
    rows = jnp.arange(b)[:, None]
    is_output = jnp.arange(history.shape[1])[None, :] >= num_prompt[:, None]
    counts = (
        jnp.zeros((b, v), jnp.int32).at[rows, history].add(is_output.astype(jnp.int32), mode="drop")
    )
    prompt_ids = jnp.where(is_output, v, history)
    in_prompt = jnp.zeros((b, v), bool).at[rows, prompt_ids].set(True, mode="drop")
    in_output = counts > 0
    rep = jnp.where(in_prompt | in_output, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * in_output


def sample_full(logits, temperature, top_p, seeds, counters, extras: dict):
    """vLLM's sampler (see the module docstring) for one token per row.

    ``extras`` holds [B] arrays ``top_k``, ``min_p``, ``presence``, ``frequency``,
    ``repetition``, ``num_prompt``, and ``history`` [B, H] and ``banned`` [B, K] padded with V.

    Returns:
      ``(tokens [B], (token_logprob [B], top_ids [B, MAX_LOGPROBS], top_logprobs [B, ...]))``,
      logprobs of the raw logits.
    """
    b, v = logits.shape
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    top_lp, top_ids = jax.lax.top_k(logprobs, min(MAX_LOGPROBS, v))
    rows = jnp.arange(b)[:, None]
    banned = jnp.zeros((b, v), bool).at[rows, extras["banned"]].set(True, mode="drop")
    logits = jnp.where(banned, -jnp.inf, logits)
    logits = apply_penalties(
        logits,
        extras["history"],
        extras["num_prompt"],
        extras["presence"],
        extras["frequency"],
        extras["repetition"],
    )
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jax.lax.cond(
        jnp.any(temperature > 0),
        lambda: _sample(
            logits,
            temperature,
            top_p,
            seeds,
            counters,
            greedy,
            top_k=extras["top_k"],
            min_p=extras["min_p"],
        ),
        lambda: greedy,
    )
    token_lp = jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]
    return tokens, (token_lp, top_ids.astype(jnp.int32), top_lp)


def full_sampler_arrays(
    rows: Sequence[tuple[SequenceSampling | None, int]], batch: int, vocab_size: int
) -> dict[str, np.ndarray]:
    """The ``extras`` of `sample_full` for a padded batch of ``batch`` rows.

    Args:
      rows: per real row, its `SequenceSampling` (None: plain) and its output-token count
        (the index of the token being sampled: history and ``min_tokens`` are as of then).
      batch: padded batch size.
      vocab_size: V, the padding id.

    The history is as wide as the longest one among rows with penalties (1 when none), padded
    to a power of two >= 256 so that few shapes compile; ``banned`` to a multiple of 8 (>= 8).
    """
    f32 = np.float32
    out = {
        "top_k": np.zeros(batch, np.int32),
        "min_p": np.zeros(batch, f32),
        "presence": np.zeros(batch, f32),
        "frequency": np.zeros(batch, f32),
        "repetition": np.ones(batch, f32),
        "num_prompt": np.zeros(batch, np.int32),
    }
    histories, bans = {}, {}
    for i, (seq, num_output) in enumerate(rows):
        if seq is None:
            continue
        p = seq.params
        out["top_k"][i], out["min_p"][i] = p.top_k, p.min_p
        if p.has_penalties:
            out["presence"][i] = p.presence_penalty
            out["frequency"][i] = p.frequency_penalty
            out["repetition"][i] = p.repetition_penalty
            out["num_prompt"][i] = len(seq.prompt_token_ids)
            histories[i] = [*seq.prompt_token_ids, *seq.output_token_ids[:num_output]]
        if num_output < p.min_tokens and seq.stop_token_ids:
            bans[i] = sorted(seq.stop_token_ids)
    width = max((len(h) for h in histories.values()), default=0)
    width = 1 << max(8, (width - 1).bit_length()) if width else 1
    history = np.full((batch, width), vocab_size, np.int32)
    for i, h in histories.items():
        history[i, : len(h)] = h
    width = max((len(x) for x in bans.values()), default=0)
    banned = np.full((batch, max(8, -(-width // 8) * 8)), vocab_size, np.int32)
    for i, ids in bans.items():
        banned[i, : len(ids)] = ids
    out["history"], out["banned"] = history, banned
    return out
