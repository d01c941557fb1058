"""Attention over a KV context: dense, and ragged paged (pure JAX, runs on any backend).

`paged_attention` is the serving kernel: queries of several sequences, each with its own length
(padded per sequence to a common T; padding is masked by position), attend over the pages their
block tables name in a shared page pool. It gathers each sequence's pages into a contiguous
context and applies the same masked softmax as `context_attention`, so the paged engine and the
dense reference agree to float rounding. Grouped-query attention: ``n_heads`` query heads share
``n_kv_heads`` K/V heads. On TPU, Pallas' ``ragged_paged_attention`` would replace the gather
(it does not run on CPU, so the pure-JAX path is the one tested here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["context_attention", "paged_attention", "gather_pages"]

_MASKED = -1e30


def context_attention(
    q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array, q_positions: jax.Array
) -> jax.Array:
    """Causal attention of ``q`` over a contiguous context.

    Args:
      q: [B, T, H, D] queries.
      k_ctx: [B, S, KV, D] keys; entry s holds the key of position s.
      v_ctx: [B, S, KV, D] values.
      q_positions: [B, T] position of each query; it sees context positions <= its own.

    Returns:
      [B, T, H, D] attention outputs in q's dtype (computed in float32).
    """
    b, t, h, d = q.shape
    s, kv = k_ctx.shape[1], k_ctx.shape[2]
    if h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} kv heads")
    qg = q.astype(jnp.float32).reshape(b, t, kv, h // kv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k_ctx.astype(jnp.float32)) * (d**-0.5)
    mask = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_ctx.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def gather_pages(pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Contiguous context [B, maxb * bs, KV, D] from a pool [NB, bs, KV, D] and tables [B, maxb]."""
    pages = pool[block_tables]  # [B, maxb, bs, KV, D]
    b, m, bs = pages.shape[:3]
    return pages.reshape(b, m * bs, *pages.shape[3:])


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
) -> jax.Array:
    """Ragged paged attention: each sequence's queries over the pages of its block table.

    Args:
      q: [B, T, H, D] queries (sequence b's padding rows are ignored by the caller).
      k_pool: [NB, bs, KV, D] one layer's key pages.
      v_pool: [NB, bs, KV, D] value pages.
      block_tables: [B, maxb] int32 page ids; entry j holds positions j*bs .. (j+1)*bs-1.
      q_positions: [B, T] positions of the queries.

    Returns:
      [B, T, H, D].
    """
    return context_attention(
        q, gather_pages(k_pool, block_tables), gather_pages(v_pool, block_tables), q_positions
    )
