"""Attention over a KV context: dense, and ragged paged (pure JAX, runs on any backend).

`paged_attention` is the serving kernel: queries of several sequences, each with its own length
(padded per sequence to a common T; padding is masked by position), attend over the pages their
block tables name in a shared page pool. It walks the context a chunk of pages at a time with an
online softmax and stops at the longest live context, so its cost tracks the real context and a
single compiled shape serves all lengths; `context_attention` is the plain masked softmax over a
contiguous cache (the dense reference), and the two agree to float rounding. Grouped-query
attention: ``n_heads`` query heads share ``n_kv_heads`` K/V heads. On TPU, Pallas'
``ragged_paged_attention`` could replace this loop (it does not run on CPU, so the pure-JAX
path is the one used and tested here).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["context_attention", "paged_attention", "gather_pages"]

_MASKED = -1e30


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """[B, T, KV, G, D] x [B, S, KV, D] -> [B, KV, G, T, S].

    With one query per sequence (decode) a broadcast multiply-and-sum, which XLA fuses into
    one loop; a batched dot of [G, D] x [D, S] per (sequence, head) costs a library call each
    on CPU and was 4x slower end to end.
    """
    if qg.shape[1] == 1:
        prod = qg[:, 0, :, :, None, :] * k.transpose(0, 2, 1, 3)[:, :, None, :, :]
        return jnp.sum(prod, axis=-1)[:, :, :, None, :]
    return jnp.einsum("btkgd,bskd->bkgts", qg, k)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """[B, KV, G, T, S] x [B, S, KV, D] -> [B, KV, G, T, D] (see `_scores`)."""
    if p.shape[3] == 1:
        vt = v.transpose(0, 2, 1, 3)[:, :, None, :, :]  # [B, KV, 1, S, D]
        return jnp.sum(p[:, :, :, 0, :, None] * vt, axis=3)[:, :, :, None, :]
    return jnp.einsum("bkgts,bskd->bkgtd", p, v)


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
    scores = _scores(qg, k_ctx.astype(jnp.float32)) * (d**-0.5)
    mask = jnp.arange(s)[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    out = _weighted(probs, v_ctx.astype(jnp.float32)).transpose(0, 3, 1, 2, 4)
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
    chunk_tokens: int = 128,
    layer: int | None = None,
) -> jax.Array:
    """Ragged paged attention: each sequence's queries over the pages of its block table.

    The context is visited in chunks of ``chunk_tokens`` (whole pages) with an online softmax
    (running max and sum, as flash attention does), and the loop stops after the chunk holding
    the batch's largest query position: the cost follows the longest live context, not the
    padded width of the block tables, so one compiled shape serves every context length.

    Args:
      q: [B, T, H, D] queries (padding rows are ignored by the caller).
      k_pool: [NB, bs, KV, D] one layer's key pages.
      v_pool: [NB, bs, KV, D] value pages.
      block_tables: [B, maxb] int32 page ids; entry j holds positions j*bs .. (j+1)*bs-1.
      q_positions: [B, T] positions of the queries (a query sees positions <= its own).
      chunk_tokens: context tokens per loop iteration (rounded to whole pages).
      layer: when given, the pools are [L, NB, bs, KV, D] and this layer's pages are read
        straight from them (slicing the layer out first would copy it every step).

    Returns:
      [B, T, H, D] in q's dtype (computed in float32).
    """
    b, t, h, d = q.shape
    lead = () if layer is None else (layer,)
    bs, kv = k_pool.shape[len(lead) + 1], k_pool.shape[len(lead) + 2]
    g = h // kv
    m_blocks = block_tables.shape[1]
    pages = max(1, min(m_blocks, chunk_tokens // bs))
    n_total = -(-m_blocks // pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, n_total * pages - m_blocks)))
    width = pages * bs
    n_chunks = jnp.minimum(jnp.max(q_positions) // width + 1, n_total)
    qg = q.astype(jnp.float32).reshape(b, t, kv, g, d) * (d**-0.5)

    def body(c, carry):
        m, denom, acc = carry
        tbl = jax.lax.dynamic_slice_in_dim(tables, c * pages, pages, axis=1)
        k = k_pool[(*lead, tbl)].reshape(b, width, kv, d).astype(jnp.float32)
        v = v_pool[(*lead, tbl)].reshape(b, width, kv, d).astype(jnp.float32)
        s = _scores(qg, k)
        kv_pos = c * width + jnp.arange(width)
        mask = (kv_pos[None, None, :] <= q_positions[:, :, None])[:, None, None]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        denom = denom * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + _weighted(p, v)
        return m_new, denom, acc

    init = (
        jnp.full((b, kv, g, t), _MASKED, jnp.float32),
        jnp.zeros((b, kv, g, t), jnp.float32),
        jnp.zeros((b, kv, g, t, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]  # [B, KV, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d).astype(q.dtype)
