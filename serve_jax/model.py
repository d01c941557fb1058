"""Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

One module serves Llama 2/3, Mistral and Qwen2 checkpoints: optional q/k/v biases (Qwen2), an LM
head tied to the embedding or not, and RoPE with Llama 3's frequency scaling
(`rope_inv_freq`). Hugging Face checkpoints are read by `serve_jax.hf_checkpoint`.

The model never owns a KV cache. Each attention layer computes q, k, v (RoPE applied) and hands
them to a cache view (`serve_jax.kv_cache.PagedKVView` for serving, `DenseKVView` for the unpaged
reference), which writes k and v where they belong and returns the attention output. So one set of
weights and one forward serve the paged engine and the dense reference alike.

Shapes and their presets (``tiny``, ``small``, ``llama-7b``, ...) live in the jax-free
`serve_jax.model_config`. Weights come from random init (`init_model`) or a safetensors file on
disk (`load_safetensors`); nothing is downloaded.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

from serve_jax.model_config import ModelConfig

__all__ = [
    "Decoder",
    "init_model",
    "count_params",
    "load_safetensors",
    "save_safetensors",
    "apply_rope",
    "rope_inv_freq",
]


class KVView(Protocol):
    """What an attention layer needs from a cache: write k/v, attend over the context."""

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array: ...


@functools.cache
def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [head_dim / 2] (float32), with Llama 3 scaling when configured.

    The same arithmetic, in float32, as transformers' default and ``llama3`` rope types.
    """
    d = cfg.head_dim
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = np.float32(1.0) / np.power(np.float32(cfg.rope_theta), exponent)
    rs = cfg.rope_scaling
    if rs is None:
        return inv_freq.astype(np.float32)
    f = np.float32
    low_wavelen = f(rs.original_max_position_embeddings / rs.low_freq_factor)
    high_wavelen = f(rs.original_max_position_embeddings / rs.high_freq_factor)
    wavelen = f(2 * np.pi) / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / f(rs.factor), inv_freq)
    smooth = (f(rs.original_max_position_embeddings) / wavelen - f(rs.low_freq_factor)) / (
        f(rs.high_freq_factor) - f(rs.low_freq_factor)
    )
    smoothed = (1 - smooth) * scaled / f(rs.factor) + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding (half-split layout). x: [B, T, H, D]; positions: [B, T]; inv_freq [D/2]."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype):
        self.scale = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _linear(
    din: int, dout: int, cfg: ModelConfig, rngs: nnx.Rngs, bias: bool = False
) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.dtype(cfg.dtype),
        kernel_init=nnx.initializers.normal(stddev=din**-0.5),
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layer = layer
        bias = cfg.qkv_bias
        self.q_proj = _linear(cfg.d_model, cfg.n_heads * cfg.head_dim, cfg, rngs, bias)
        self.k_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs, bias)
        self.v_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs, bias)
        self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).reshape(b, t, c.n_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        inv_freq = rope_inv_freq(c)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        out = kv.attend(self.layer, q, k, v)
        return self.o_proj(out.reshape(b, t, c.n_heads * c.head_dim))


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.gate = _linear(cfg.d_model, cfg.ffn_dim, cfg, rngs)
        self.up = _linear(cfg.d_model, cfg.ffn_dim, cfg, rngs)
        self.down = _linear(cfg.ffn_dim, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, jnp.dtype(cfg.dtype))
        self.attn = Attention(cfg, layer, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, jnp.dtype(cfg.dtype))
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, kv)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    """The language model: embed, blocks, final norm, LM head (or the tied embedding)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=jnp.dtype(cfg.dtype),
            param_dtype=jnp.dtype(cfg.dtype),
            embedding_init=nnx.initializers.normal(stddev=1.0),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, jnp.dtype(cfg.dtype))
        self.lm_head = (
            None if cfg.tie_embeddings else _linear(cfg.d_model, cfg.vocab_size, cfg, rngs)
        )

    def hidden(self, tokens: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        """Final hidden states [B, T, D] of ``tokens`` [B, T] at ``positions`` [B, T]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, kv)
        return self.final_norm(x)

    def logits(self, h: jax.Array) -> jax.Array:
        """LM-head logits in float32."""
        if self.lm_head is None:
            return self.embed.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def __call__(self, tokens: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        return self.logits(self.hidden(tokens, positions, kv))


def init_model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """A randomly initialised `Decoder` (deterministic in ``seed``)."""
    return Decoder(cfg, nnx.Rngs(params=seed))


def count_params(model: nnx.Module) -> int:
    """Number of parameters of an NNX module."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(str(p) for p in path): v[...] for path, v in flat}


def save_safetensors(model: nnx.Module, path: str) -> None:
    """Writes the parameters to a safetensors file (names are dotted NNX paths)."""
    save_file({k: np.asarray(v) for k, v in _flat_params(model).items()}, path)


def load_safetensors(model: nnx.Module, path: str) -> None:
    """Loads parameters saved by `save_safetensors` into ``model`` in place.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a file that is not a safetensors checkpoint (its contents are not echoed), a
        missing or unexpected tensor, or a shape mismatch, naming the tensor.
    """
    if not Path(path).is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist or is not a file")
    try:
        tensors = load_file(path)
    except SafetensorError:
        raise ValueError(f"{str(path)!r} is not a safetensors checkpoint") from None
    state = nnx.state(model, nnx.Param)
    flat = nnx.to_flat_state(state)
    names = set()
    for p, var in flat:
        name = ".".join(str(x) for x in p)
        names.add(name)
        if name not in tensors:
            raise ValueError(f"{path}: tensor {name!r} missing")
        arr = tensors[name]
        if tuple(arr.shape) != tuple(var.shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {arr.shape}, model expects {var.shape}"
            )
        var[...] = jnp.asarray(arr, dtype=var.dtype)
    extra = set(tensors) - names
    if extra:
        raise ValueError(f"{path}: unexpected tensors {sorted(extra)[:5]}")
    nnx.update(model, nnx.from_flat_state(flat))
