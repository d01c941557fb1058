"""KV caches as views handed to the model: paged pools (serving) and a dense cache (reference).

A view is a small Python object living inside one traced step: each attention layer calls
``view.attend(layer, q, k, v)``, which writes the new k/v and returns the attention output; the
updated arrays are read back from the view when the forward ends. The jitted step donates the
pools, so XLA updates them in place.

Paged layout: ``k_pool`` and ``v_pool`` are tuples of ``n_layers`` arrays [num_blocks,
n_kv_heads, block_size, head_dim] (head-major pages, which `serve_jax.attention` reads without a
transpose). One array per layer, not one stacked [n_layers, ...] array: XLA:CPU turned each
layer's small scatter into the stacked array into a copy of the whole cache (16 per step), while a
donated per-layer array is updated in place. A sequence's
block table maps position p to page ``table[p // block_size]``, slot ``p % block_size``.
Padded query rows (``valid == False``) write nowhere (their page index is out of range and the
scatter drops it).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from serve_jax.attention import context_attention, paged_attention
from serve_jax.model_config import ModelConfig

__all__ = [
    "PagedKVView",
    "DenseKVView",
    "make_kv_pools",
    "pool_shape",
    "dense_greedy_generate",
    "dense_step",
]


def pool_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """Shape of one layer's K (or V) page pool."""
    return (num_blocks, cfg.n_kv_heads, block_size, cfg.head_dim)


def make_kv_pools(
    cfg: ModelConfig, num_blocks: int, block_size: int, device=None, sharding=None
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """Zeroed K and V page pools, one array per layer, with ``sharding`` (or on ``device``)."""
    shape = pool_shape(cfg, num_blocks, block_size)
    where = sharding if sharding is not None else (device or jax.devices()[0])

    def one():
        return jax.device_put(jnp.zeros(shape, jnp.dtype(cfg.dtype)), where)

    k = tuple(one() for _ in range(cfg.n_layers))
    v = tuple(one() for _ in range(cfg.n_layers))
    return k, v


def _replace(arrays: tuple[jax.Array, ...], i: int, x: jax.Array) -> tuple[jax.Array, ...]:
    return (*arrays[:i], x, *arrays[i + 1 :])


@dataclasses.dataclass
class PagedKVView:
    """Paged pools plus the step's block tables and query positions (inside a traced step)."""

    k_pool: tuple[jax.Array, ...]
    """Per-layer [NB, KV, bs, D] key pages."""
    v_pool: tuple[jax.Array, ...]
    block_tables: jax.Array
    """[B, maxb] int32."""
    positions: jax.Array
    """[B, T] int32 position of each token."""
    valid: jax.Array
    """[B, T] bool: False for padding."""

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        num_blocks, bs = self.k_pool[layer].shape[0], self.k_pool[layer].shape[2]
        page = jnp.take_along_axis(self.block_tables, self.positions // bs, axis=1)
        page = jnp.where(self.valid, page, num_blocks)  # out of range: dropped
        slot = self.positions % bs
        # Advanced indices split by the head slice: the update is [B, T, KV, D], as k is.
        kp = (
            self.k_pool[layer]
            .at[page, :, slot]
            .set(k.astype(self.k_pool[layer].dtype), mode="drop")
        )
        vp = (
            self.v_pool[layer]
            .at[page, :, slot]
            .set(v.astype(self.v_pool[layer].dtype), mode="drop")
        )
        self.k_pool = _replace(self.k_pool, layer, kp)
        self.v_pool = _replace(self.v_pool, layer, vp)
        return paged_attention(q, kp, vp, self.block_tables, self.positions)


@dataclasses.dataclass
class DenseKVView:
    """An unpaged head-major cache, per layer [B, KV, max_len, D]: position p of row b at p."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    positions: jax.Array
    valid: jax.Array

    @classmethod
    def zeros(
        cls, cfg: ModelConfig, batch: int, max_len: int
    ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        """Zeroed K and V caches, one [batch, KV, max_len, D] array per layer."""
        shape = (batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        k = tuple(jnp.zeros(shape, jnp.dtype(cfg.dtype)) for _ in range(cfg.n_layers))
        v = tuple(jnp.zeros(shape, jnp.dtype(cfg.dtype)) for _ in range(cfg.n_layers))
        return k, v

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        b, t = self.positions.shape
        max_len = self.k[layer].shape[2]
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        pos = jnp.where(self.valid, self.positions, max_len)
        kc = self.k[layer].at[rows, :, pos].set(k.astype(self.k[layer].dtype), mode="drop")
        vc = self.v[layer].at[rows, :, pos].set(v.astype(self.v[layer].dtype), mode="drop")
        self.k = _replace(self.k, layer, kc)
        self.v = _replace(self.v, layer, vc)
        return context_attention(q, kc, vc, self.positions, heads_major=True)


def dense_greedy_generate(
    model,
    prompt_ids: list[int],
    max_tokens: int,
    max_len: int | None = None,
    min_prefill: int = 1,
) -> list[int]:
    """Greedy generation with a dense, unpaged cache: the reference the paged engine must match.

    The prompt is prefilled in one forward pass (padded to a power of two, padding masked), then
    tokens are decoded one at a time. ``max_len`` fixes the cache length and ``min_prefill`` the
    smallest padded prompt length (both only to compile fewer shapes).
    """
    cfg = model.cfg
    n = len(prompt_ids)
    max_len = max_len or n + max_tokens
    if n + max_tokens > max_len:
        raise ValueError(f"prompt {n} + max_tokens {max_tokens} exceeds max_len {max_len}")
    graphdef, params = nnx.split(model)
    k, v = DenseKVView.zeros(cfg, 1, max_len)
    t = 1 << (max(n, min_prefill) - 1).bit_length()
    tokens = jnp.zeros((1, t), jnp.int32).at[0, :n].set(jnp.asarray(prompt_ids))
    valid = jnp.arange(t)[None] < n
    logits, k, v = dense_step(graphdef, params, k, v, tokens, jnp.arange(t)[None], valid)
    tok = jnp.argmax(logits[:, n - 1], axis=-1)
    out = [int(tok[0])]
    one = jnp.ones((1, 1), bool)
    for pos in range(n, n + max_tokens - 1):
        pos_arr = jnp.full((1, 1), pos)
        logits, k, v = dense_step(graphdef, params, k, v, tok[:, None], pos_arr, one)
        tok = jnp.argmax(logits[:, -1], axis=-1)
        out.append(int(tok[0]))
    return out


@functools.partial(jax.jit, static_argnums=(0,), donate_argnums=(2, 3))
def dense_step(graphdef, params, k, v, tokens, positions, valid):
    """Forward of ``tokens`` [B, T] at ``positions`` with a dense cache; returns logits, k, v."""
    m = nnx.merge(graphdef, params)
    view = DenseKVView(k, v, positions, valid)
    logits = m(tokens, positions, view)
    return logits, view.k, view.v
