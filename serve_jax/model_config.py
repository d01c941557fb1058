"""The one model registry of serve_jax: `ModelConfig` shapes and their presets, without jax.

The engine builds its `serve_jax.model.Decoder` from a `ModelConfig`, and the simulator prices
the same `ModelConfig` with the roofline of `serve_jax.costmodel`, so a model name means one
shape everywhere (``--model`` of ``simulate``, ``model.preset`` of an engine config).

Presets: ``tiny`` (tests), ``small`` (~24M parameters, the CPU demo), and the Llama shapes
``smollm-135m`` (SmolLM-135M: the CPU comparison with Hugging Face ``generate``),
``llama3.2-1b`` (Llama-3.2-1B: the bf16 one-chip serving presets), ``llama-7b`` (Llama-2-7B),
``llama-13b`` (Llama-2-13B) and ``llama3-8b`` (Llama-3-8B, grouped-query attention) for
planning and simulation (not meant to be instantiated on CPU).
This module imports no jax, so the pure-Python side (simulator, cost model) stays jax-free.
"""

from __future__ import annotations

import dataclasses

__all__ = ["ModelConfig", "RopeScaling", "PRESETS", "DTYPE_BYTES", "get_model_config"]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per element of the parameter dtypes a model may use."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE frequency scaling (``rope_scaling`` of type ``llama3`` in a config.json)."""

    factor: float
    """Long wavelengths are divided by this."""
    low_freq_factor: float
    """Wavelengths above ``original_max_position_embeddings / low_freq_factor`` are scaled."""
    high_freq_factor: float
    """Wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int
    """Context length the model was pre-trained with."""

    def __post_init__(self):
        if self.factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ValueError(
                "rope_scaling: factor and original_max_position_embeddings must be > 0"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"rope_scaling: high_freq_factor ({self.high_freq_factor}) must exceed "
                f"low_freq_factor ({self.low_freq_factor})"
            )


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
    rope_scaling: RopeScaling | None = None
    """Llama 3 frequency scaling of RoPE; None: plain RoPE."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2)."""
    tie_embeddings: bool = False
    """The LM head is the transposed token embedding (no separate lm_head weight)."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    max_seq_len: int = 512
    """Longest context the model serves."""
    dtype: str = "float32"
    """Parameter and activation dtype (float32 on CPU, bfloat16 on accelerators)."""

    def __post_init__(self):
        for f in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                  "ffn_dim", "max_seq_len"):  # fmt: skip
            if getattr(self, f) <= 0:
                raise ValueError(f"ModelConfig.{f} must be positive, got {getattr(self, f)}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {', '.join(DTYPE_BYTES)}")

    @property
    def dtype_bytes(self) -> int:
        """Bytes per parameter and per KV element."""
        return DTYPE_BYTES[self.dtype]

    def num_params(self) -> int:
        """Parameter count from the shapes (norms, biases and the embedding(s) included)."""
        d, h, kv, hd = self.d_model, self.n_heads, self.n_kv_heads, self.head_dim
        attn = d * h * hd * 2 + d * kv * hd * 2
        if self.qkv_bias:
            attn += (h + 2 * kv) * hd
        mlp = 3 * d * self.ffn_dim
        embeddings = (1 if self.tie_embeddings else 2) * self.vocab_size * d
        return self.n_layers * (attn + mlp + 2 * d) + embeddings + d

    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype_bytes


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
    # Llama-2-7B: 32 layers, d=4096, 32 heads (MHA), MLP 11008, vocab 32000 (6.7B params).
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
    # Llama-2-13B: 40 layers, d=5120, 40 heads, MLP 13824.
    "llama-13b": ModelConfig(
        vocab_size=32000,
        d_model=5120,
        n_layers=40,
        n_heads=40,
        n_kv_heads=40,
        head_dim=128,
        ffn_dim=13824,
        max_seq_len=4096,
        dtype="bfloat16",
    ),
    # SmolLM-135M (HuggingFaceTB): a real small Llama, 30 layers, d=576, 9 heads over 3 KV
    # heads of 64, MLP 1536, vocab 49152, tied embeddings (134.5M params); the CPU peer
    # comparison against Hugging Face generate runs at this shape.
    "smollm-135m": ModelConfig(
        vocab_size=49152,
        d_model=576,
        n_layers=30,
        n_heads=9,
        n_kv_heads=3,
        head_dim=64,
        ffn_dim=1536,
        tie_embeddings=True,
        max_seq_len=2048,
    ),
    # Llama-3.2-1B: 16 layers, d=2048, 32 heads over 8 KV heads of 64, MLP 8192, tied
    # embeddings, llama3 RoPE scaling (1.24B params); the bf16 one-chip serving presets use it.
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        d_model=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        head_dim=64,
        ffn_dim=8192,
        rope_theta=500000.0,
        rope_scaling=RopeScaling(32.0, 1.0, 4.0, 8192),
        tie_embeddings=True,
        max_seq_len=131072,
        dtype="bfloat16",
    ),
    # Llama-3-8B: grouped-query attention with 8 KV heads, vocab 128256.
    "llama3-8b": ModelConfig(
        vocab_size=128256,
        d_model=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        head_dim=128,
        ffn_dim=14336,
        rope_theta=500000.0,
        max_seq_len=8192,
        dtype="bfloat16",
    ),
}


def get_model_config(name: str | ModelConfig, **overrides) -> ModelConfig:
    """A preset by name (case-insensitive), with field overrides (``dtype="bfloat16"``).

    A `ModelConfig` passes through (with the overrides applied).

    Raises:
      ValueError: an unknown preset name or a bad override value.
    """
    if isinstance(name, ModelConfig):
        base = name
    else:
        key = str(name).strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
        base = PRESETS[key]
    return dataclasses.replace(base, **overrides) if overrides else base
