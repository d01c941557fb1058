"""Llama-style decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model never owns a KV cache. Each attention layer computes q, k, v (RoPE applied) and hands
them to a cache view (`serve_jax.kv_cache.PagedKVView` for serving, `DenseKVView` for the unpaged
reference), which writes k and v where they belong and returns the attention output. So one set of
weights and one forward serve the paged engine and the dense reference alike.

Presets: ``tiny`` (tests), ``small`` (~24M parameters, the CPU demo) and ``llama-7b`` (shapes for
planning and simulation; not meant to be instantiated on CPU). Weights come from random init
(`init_model`) or a safetensors file on disk (`load_safetensors`); nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "ModelConfig",
    "PRESETS",
    "get_model_config",
    "Decoder",
    "init_model",
    "count_params",
    "load_safetensors",
    "save_safetensors",
    "apply_rope",
]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes of a Llama-style decoder."""

    vocab_size: int = 512
    """Vocabulary size (the byte tokenizer needs at least 259)."""
    d_model: int = 64
    """Hidden width."""
    n_layers: int = 2
    """Decoder blocks."""
    n_heads: int = 4
    """Query heads."""
    n_kv_heads: int = 2
    """Key/value heads (grouped-query attention); divides n_heads."""
    head_dim: int = 16
    """Width of one head."""
    ffn_dim: int = 128
    """SwiGLU hidden width."""
    rope_theta: float = 10000.0
    """RoPE base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_seq_len: int = 512
    """Longest context the model serves."""
    dtype: str = "float32"
    """Parameter and activation dtype (float32 on CPU, bfloat16 on accelerators)."""

    def __post_init__(self):
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def jnp_dtype(self):
        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        """Parameter count from the shapes."""
        d, h, kv, hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        mlp = 3 * d * self.ffn_dim
        return self.n_layers * (attn + mlp + 2 * d) + 2 * self.vocab_size * d + d

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.jnp_dtype.itemsize


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(),
    "small": ModelConfig(
        vocab_size=512,
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        head_dim=64,
        ffn_dim=1408,
        max_seq_len=2048,
    ),
    "llama-7b": ModelConfig(
        vocab_size=32000,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        head_dim=128,
        ffn_dim=11008,
        max_seq_len=4096,
        dtype="bfloat16",
    ),
}


def get_model_config(name: str, **overrides) -> ModelConfig:
    """A preset by name, with field overrides (``dtype="bfloat16"``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return dataclasses.replace(PRESETS[name], **overrides)


class KVView(Protocol):
    """What an attention layer needs from a cache: write k/v, attend over the context."""

    def attend(self, layer: int, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array: ...


def apply_rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (half-split layout). x: [B, T, H, D]; positions: [B, T]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
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


def _linear(din: int, dout: int, cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=False,
        dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_dtype,
        kernel_init=nnx.initializers.normal(stddev=din**-0.5),
        rngs=rngs,
    )


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layer = layer
        self.q_proj = _linear(cfg.d_model, cfg.n_heads * cfg.head_dim, cfg, rngs)
        self.k_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs)
        self.v_proj = _linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, cfg, rngs)
        self.o_proj = _linear(cfg.n_heads * cfg.head_dim, cfg.d_model, cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).reshape(b, t, c.n_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, t, c.n_kv_heads, c.head_dim)
        q = apply_rope(q, positions, c.rope_theta)
        k = apply_rope(k, positions, c.rope_theta)
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
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.jnp_dtype)
        self.attn = Attention(cfg, layer, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.jnp_dtype)
        self.mlp = SwiGLU(cfg, rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        x = x + self.attn(self.attn_norm(x), positions, kv)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
    """The language model: embed, blocks, final norm, untied LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(
            cfg.vocab_size,
            cfg.d_model,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_dtype,
            embedding_init=nnx.initializers.normal(stddev=1.0),
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, i, rngs) for i in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.jnp_dtype)
        self.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg, rngs)

    def hidden(self, tokens: jax.Array, positions: jax.Array, kv: KVView) -> jax.Array:
        """Final hidden states [B, T, D] of ``tokens`` [B, T] at ``positions`` [B, T]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, kv)
        return self.final_norm(x)

    def logits(self, h: jax.Array) -> jax.Array:
        """LM-head logits in float32."""
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
    import numpy as np
    from safetensors.numpy import save_file

    save_file({k: np.asarray(v) for k, v in _flat_params(model).items()}, path)


def load_safetensors(model: nnx.Module, path: str) -> None:
    """Loads parameters saved by `save_safetensors` into ``model`` in place.

    Raises:
      ValueError: a missing or unexpected tensor, or a shape mismatch, naming the tensor.
    """
    from safetensors.numpy import load_file

    tensors = load_file(path)
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
