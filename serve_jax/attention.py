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

Layout. Caches are kept head-major: a page is [KV, bs, D] and the dense cache [B, KV, S, D], so
a sequence's context for one KV head is a run of contiguous [bs, D] tiles. Queries are grouped
per KV head as [B, KV, G*T, D] (the G query heads sharing a KV head and the T query positions
folded into one row axis), and both products are plain batched matmuls with the batch axes
(B, KV) leading on every operand: ``[G*T, D] x [D, S]`` for the scores and ``[G*T, S] x [S, D]``
for the values. XLA:CPU emits each as one batched-GEMM call with no transpose of the context, and
the page gather writes the head-major chunk straight from the pool (no separate transpose copy).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["context_attention", "paged_attention", "gather_pages"]

_MASKED = -1e30


def _group_queries(q: jax.Array, kv: int) -> jax.Array:
    """[B, T, H, D] -> [B, KV, G*T, D] float32, scaled by 1/sqrt(D); row g*T + t."""
    b, t, h, d = q.shape
    if h % kv:
        raise ValueError(f"{h} query heads do not group over {kv} kv heads")
    g = h // kv
    qg = q.astype(jnp.float32).reshape(b, t, kv, g, d) * (d**-0.5)
    return qg.transpose(0, 2, 3, 1, 4).reshape(b, kv, g * t, d)


def _ungroup(out: jax.Array, t: int, dtype) -> jax.Array:
    """[B, KV, G*T, D] -> [B, T, H, D] in ``dtype``."""
    b, kv, gt, d = out.shape
    g = gt // t
    out = out.reshape(b, kv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, kv * g, d).astype(dtype)


def _scores(qg: jax.Array, k: jax.Array) -> jax.Array:
    """[B, KV, R, D] x [B, KV, S, D] -> [B, KV, R, S] (one batched GEMM, float32)."""
    return jnp.einsum("bkrd,bksd->bkrs", qg, k, preferred_element_type=jnp.float32)


def _weighted(p: jax.Array, v: jax.Array) -> jax.Array:
    """[B, KV, R, S] x [B, KV, S, D] -> [B, KV, R, D] (one batched GEMM, float32)."""
    return jnp.einsum("bkrs,bksd->bkrd", p, v, preferred_element_type=jnp.float32)


def context_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    q_positions: jax.Array,
    heads_major: bool = False,
) -> jax.Array:
    """Causal attention of ``q`` over a contiguous context.

    Args:
      q: [B, T, H, D] queries.
      k_ctx: [B, S, KV, D] keys (entry s holds the key of position s), or [B, KV, S, D] with
        ``heads_major`` (the dense cache's layout, read without a transpose).
      v_ctx: values, laid out as ``k_ctx``.
      q_positions: [B, T] position of each query; it sees context positions <= its own.
      heads_major: the context is [B, KV, S, D].

    Returns:
      [B, T, H, D] attention outputs in q's dtype (computed in float32).
    """
    t = q.shape[1]
    if not heads_major:
        k_ctx = k_ctx.transpose(0, 2, 1, 3)
        v_ctx = v_ctx.transpose(0, 2, 1, 3)
    kv, s = k_ctx.shape[1], k_ctx.shape[2]
    qg = _group_queries(q, kv)
    g = qg.shape[2] // t
    scores = _scores(qg, k_ctx.astype(jnp.float32))
    qpos = jnp.tile(q_positions, (1, g))  # [B, G*T], row g*T + t
    mask = jnp.arange(s)[None, None, :] <= qpos[:, :, None]  # [B, G*T, S]
    scores = jnp.where(mask[:, None], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1)
    return _ungroup(_weighted(probs, v_ctx.astype(jnp.float32)), t, q.dtype)


def gather_pages(pool: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Head-major context [B, KV, maxb * bs, D] from a pool [NB, KV, bs, D], tables [B, maxb]."""
    pages = pool[block_tables]  # [B, maxb, KV, bs, D]
    b, m, kv, bs, d = pages.shape
    return pages.transpose(0, 2, 1, 3, 4).reshape(b, kv, m * bs, d)


def paged_attention(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    q_positions: jax.Array,
    chunk_tokens: int = 32,
    layer: int | None = None,
) -> jax.Array:
    """Ragged paged attention: each sequence's queries over the pages of its block table.

    The context is visited in chunks of ``chunk_tokens`` (whole pages) with an online softmax
    (running max and sum, as flash attention does), and the loop stops after the chunk holding
    the batch's largest query position: the cost follows the longest live context, not the
    padded width of the block tables, so one compiled shape serves every context length.

    Args:
      q: [B, T, H, D] queries (padding rows are ignored by the caller).
      k_pool: [NB, KV, bs, D] one layer's key pages (head-major pages).
      v_pool: [NB, KV, bs, D] value pages.
      block_tables: [B, maxb] int32 page ids; entry j holds positions j*bs .. (j+1)*bs-1.
      q_positions: [B, T] positions of the queries (a query sees positions <= its own).
      chunk_tokens: context tokens per loop iteration (rounded to whole pages).
      layer: when given, the pools are [L, NB, KV, bs, D] and this layer's pages are read
        straight from them (slicing the layer out first would copy it every step).

    Returns:
      [B, T, H, D] in q's dtype (computed in float32).
    """
    b, t, h, d = q.shape
    lead = () if layer is None else (layer,)
    kv, bs = k_pool.shape[len(lead) + 1], k_pool.shape[len(lead) + 2]
    m_blocks = block_tables.shape[1]
    pages = max(1, min(m_blocks, chunk_tokens // bs))
    n_total = -(-m_blocks // pages)
    tables = jnp.pad(block_tables, ((0, 0), (0, n_total * pages - m_blocks)))
    width = pages * bs
    n_chunks = jnp.minimum(jnp.max(q_positions) // width + 1, n_total)
    qg = _group_queries(q, kv)  # [B, KV, R, D], R = G*T
    r = qg.shape[2]
    qpos = jnp.tile(q_positions, (1, r // t))  # [B, R]

    def context(pool, tbl):
        x = pool[(*lead, tbl)]  # [B, P, KV, bs, D]
        return x.transpose(0, 2, 1, 3, 4).reshape(b, kv, width, d).astype(jnp.float32)

    def body(c, carry):
        m, denom, acc = carry
        tbl = jax.lax.dynamic_slice_in_dim(tables, c * pages, pages, axis=1)
        s = _scores(qg, context(k_pool, tbl))  # [B, KV, R, W]
        kv_pos = c * width + jnp.arange(width)
        mask = (kv_pos[None, None, :] <= qpos[:, :, None])[:, None]  # [B, 1, R, W]
        s = jnp.where(mask, s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
        corr = jnp.exp(m - m_new)
        denom = denom * corr + jnp.sum(p, axis=-1)
        acc = acc * corr[..., None] + _weighted(p, context(v_pool, tbl))
        return m_new, denom, acc

    init = (
        jnp.full((b, kv, r), _MASKED, jnp.float32),
        jnp.zeros((b, kv, r), jnp.float32),
        jnp.zeros((b, kv, r, d), jnp.float32),
    )
    _, denom, acc = jax.lax.fori_loop(0, n_chunks, body, init)
    out = acc / jnp.maximum(denom, 1e-30)[..., None]
    return _ungroup(out, t, q.dtype)
