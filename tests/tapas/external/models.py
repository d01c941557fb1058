"""Training steps of the vendored external transformers, for planning and verification.

Two Gemma implementations nobody here wrote, vendored unchanged but for marked import edits:

- ``gemma_linen``: google-deepmind/gemma at e8075843 (2025-02-14), the Flax Linen Gemma 1/2
  (``gemma/transformer.py``, ``modules.py``, ``layers.py``, ``positional_embeddings.py``);
- ``gemma_nnx``: google/flax at 18f8f311 (2026-07-02), ``examples/gemma``, the Flax NNX Gemma.

Both project with einsum kernels (``BTD,NDH->BTNH``, ``BSD,CKDH->CBSKH``, ...) and use
grouped-query attention when ``num_kv_heads`` is below ``num_heads``. Each entry is a
`tapas_jax.zoo.ZooModel` whose ``fn`` is one SGD step of next-token cross-entropy, so the
planner, `tapas_jax.verification.verify` and the Megatron baseline take them like zoo models.
`megatron_rules` is Megatron-LM's tensor-parallel layout written for Gemma's parameter names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from tapas_jax.zoo import ZooModel

from .gemma_linen import modules as linen_modules, transformer as linen_transformer
from .gemma_nnx import transformer as nnx_transformer, transformer_cfg as nnx_cfg

LEARNING_RATE = 0.1


def _lm_loss(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def _sgd(loss_fn):
    def step(params, tokens, labels):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, labels)
        return jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads), loss

    return step


def _positions_and_mask(tokens):
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    causal = jnp.tril(jnp.ones((length, length), dtype=bool))
    return positions, jnp.broadcast_to(causal, (batch, length, length))


def _inputs(batch, seq_len, vocab):
    def make(seed):
        tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq_len), 0, vocab)
        return tokens, jnp.roll(tokens, -1, axis=1)

    return make


def _config(layers, embed_dim, heads, kv_heads, head_dim, hidden, vocab) -> dict:
    """The `TransformerConfig` fields both Gemmas share (each adds its own attention types)."""
    return dict(
        num_layers=layers,
        num_embed=vocab,
        embed_dim=embed_dim,
        hidden_dim=hidden,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv_heads,
        final_logit_softcap=None,
        use_post_attn_norm=True,
        use_post_ffw_norm=True,
    )


def gemma_linen(
    layers=2,
    embed_dim=64,
    heads=8,
    kv_heads=2,
    head_dim=16,
    hidden=128,
    vocab=256,
    seq_len=16,
    batch=4,
) -> ZooModel:
    """The Linen Gemma (google-deepmind/gemma), tiny, as an SGD training step."""
    config = linen_transformer.TransformerConfig(
        **_config(layers, embed_dim, heads, kv_heads, head_dim, hidden, vocab),
        attention_types=(linen_modules.AttentionType.GLOBAL,) * layers,
        max_cache_length=None,
    )
    model = linen_transformer.Transformer(config)

    def loss_fn(params, tokens, labels):
        positions, mask = _positions_and_mask(tokens)
        logits, _ = model.apply({"params": params}, tokens, positions, None, mask)
        return _lm_loss(logits, labels)

    inputs = _inputs(batch, seq_len, vocab)

    def init(seed):
        tokens, _ = inputs(seed)
        positions, mask = _positions_and_mask(tokens)
        return model.init(jax.random.key(seed), tokens, positions, None, mask)["params"]

    params = jax.eval_shape(init, 0)
    return ZooModel(
        "gemma_linen", _sgd(loss_fn), params, jax.eval_shape(inputs, 0), init, inputs, True
    )


def gemma_nnx(
    layers=2,
    embed_dim=64,
    heads=8,
    kv_heads=2,
    head_dim=16,
    hidden=128,
    vocab=256,
    seq_len=16,
    batch=4,
) -> ZooModel:
    """The NNX Gemma (google/flax examples/gemma), tiny, as an SGD training step."""
    config = nnx_cfg.TransformerConfig(
        **_config(layers, embed_dim, heads, kv_heads, head_dim, hidden, vocab),
        attention_types=(nnx_cfg.AttentionType.GLOBAL,) * layers,
    )

    def make(seed):
        return nnx_transformer.Transformer(config, rngs=nnx.Rngs(seed))

    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: make(0)), nnx.Param, ...)

    def loss_fn(p, tokens, labels):
        positions, mask = _positions_and_mask(tokens)
        logits, _ = nnx.merge(graphdef, p, rest)(tokens, positions, None, mask)
        return _lm_loss(logits, labels)

    def init(seed):
        return nnx.split(make(seed), nnx.Param, ...)[1]

    inputs = _inputs(batch, seq_len, vocab)
    return ZooModel(
        "gemma_nnx", _sgd(loss_fn), params, jax.eval_shape(inputs, 0), init, inputs, True
    )


MODELS = {"gemma_linen": gemma_linen, "gemma_nnx": gemma_nnx}


def megatron_rules(path: str, ndim: int, model_size: int, kv_heads: int):
    """Megatron-LM's tensor-parallel layout of Gemma's params over ``model``; None: no opinion.

    Vocabulary-split embedding (tied, so the logits too); query heads column-split; key/value
    heads split when ``model_size`` divides them and replicated otherwise (Megatron-LM's
    grouped-query attention with fewer groups than tensor-parallel ranks); the attention output
    row-split over heads; the MLP's gate and up projections column-split and the down
    projection row-split over the hidden dimension. Norm scales: no opinion.
    """
    leaf = path.split("/")
    if leaf[-1] == "input_embedding":
        return ("model", None)
    if "q_einsum" in leaf:  # [N, D, H]
        return ("model", None, None)
    if "kv_einsum" in leaf:  # [2, K, D, H]
        return (None, "model" if kv_heads % model_size == 0 else None, None, None)
    if "qkv_einsum" in leaf:  # [3, N, D, H]
        return (None, "model", None, None)
    if "attn_vec_einsum" in leaf:  # [N, H, D]
        return ("model", None, None)
    if "gating_einsum" in leaf:  # Linen [2, F, D]
        return (None, "model", None)
    if "linear" in leaf:  # Linen [F, D]
        return ("model", None)
    if ("gate_proj" in leaf or "up_proj" in leaf) and ndim == 2:  # NNX [D, F]
        return (None, "model")
    if "down_proj" in leaf and ndim == 2:  # NNX [F, D]
        return ("model", None)
    return None
