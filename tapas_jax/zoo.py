"""Model zoo for tests and benchmarks: small Flax NNX models and their step functions.

Every entry builds a `ZooModel`: a pure function ``fn(params, *inputs)`` (a training step or a
forward pass), the abstract params (`jax.ShapeDtypeStruct` leaves, built with `nnx.eval_shape`, so
nothing is materialised) and abstract inputs, plus ``init(seed)`` and ``example_inputs(seed)`` for
the verifier, which needs real arrays. The params argument is ``nnx.state(model, nnx.Param)``;
the function rebuilds the module with ``nnx.merge(graphdef, params, rest)``, which is how any NNX
model is planned (see `tapas_jax.plan`).

Models: ``gpt`` (unrolled decoder, training step), ``gpt_fwd`` (its forward loss), ``gpt_scan``
(layers stacked and run with `nnx.scan`), ``t5`` (encoder-decoder), ``vit``, ``moe`` (a
top-1-routed mixture-of-experts feed-forward stack) and ``dcgan`` (a convolutional generator and
discriminator trained together).

One module of ~500 lines on purpose: the models share the attention, MLP and block modules and
the entry helpers, and each model is a short definition next to its builder; split by model
family if it grows further.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["ZooModel", "build", "MODELS", "megatron_rules"]

LEARNING_RATE = 1e-2


@dataclasses.dataclass
class ZooModel:
    """A zoo entry ready for planning and verification."""

    name: str
    fn: Callable[..., Any]
    """``fn(params, *inputs)``; pure."""
    params: Any
    """Abstract params pytree (`jax.ShapeDtypeStruct` leaves)."""
    inputs: tuple[Any, ...]
    """Abstract inputs."""
    init: Callable[[int], Any]
    """``init(seed)`` -> real params with the structure of `params`."""
    example_inputs: Callable[[int], tuple[Any, ...]]
    """``example_inputs(seed)`` -> real inputs."""
    train: bool = True
    """Whether `fn` is a training step (it keeps gradients and optimizer state in memory)."""


# ----------------------------------------------------------------------------- GPT


class Attention(nnx.Module):
    """Causal multi-head self-attention with separate query, key and value projections."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs, causal: bool = True, dtype=None):
        if d % heads:
            raise ValueError(f"d_model {d} is not divisible by heads {heads}")
        self.heads, self.causal = heads, causal
        kw = _dtypes(dtype)
        self.query = nnx.Linear(d, d, rngs=rngs, **kw)
        self.key = nnx.Linear(d, d, rngs=rngs, **kw)
        self.value = nnx.Linear(d, d, rngs=rngs, **kw)
        self.out = nnx.Linear(d, d, rngs=rngs, **kw)

    def __call__(self, x, context=None):
        context = x if context is None else context
        b, s, d = x.shape
        t = context.shape[1]
        h = self.heads
        q = self.query(x).reshape(b, s, h, d // h)
        k = self.key(context).reshape(b, t, h, d // h)
        v = self.value(context).reshape(b, t, h, d // h)
        scores = jnp.einsum("bshd,bthd->bhst", q, k) / jnp.sqrt(d // h).astype(x.dtype)
        if self.causal:
            mask = jnp.tril(jnp.ones((s, t), dtype=bool))
            scores = jnp.where(mask, scores, jnp.asarray(-1e9, scores.dtype))
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bhst,bthd->bshd", probs, v).reshape(b, s, d)
        return self.out(y)


class MLP(nnx.Module):
    def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs, dtype=None):
        kw = _dtypes(dtype)
        self.fc1 = nnx.Linear(d, hidden, rngs=rngs, **kw)
        self.fc2 = nnx.Linear(hidden, d, rngs=rngs, **kw)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.fc1(x)))


class Block(nnx.Module):
    """Pre-norm transformer block."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs, causal: bool = True, dtype=None):
        kw = _dtypes(dtype)
        self.ln1 = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.attn = Attention(d, heads, rngs=rngs, causal=causal, dtype=dtype)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.mlp = MLP(d, 4 * d, rngs=rngs, dtype=dtype)

    def __call__(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _dtypes(dtype) -> dict:
    return {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}


def _run_block(block, x):
    return block(x)


class GPT(nnx.Module):
    """Decoder-only transformer with unrolled layers (one Python loop: N copies in the jaxpr)."""

    def __init__(
        self, layers, d, heads, seq_len, vocab, *, rngs: nnx.Rngs, dtype=None, remat=False
    ):
        kw = _dtypes(dtype)
        self.remat = remat
        self.embed = nnx.Embed(vocab, d, rngs=rngs, **kw)
        self.pos = nnx.Param(
            jax.random.normal(rngs.params(), (seq_len, d), dtype or jnp.float32) * 0.02
        )
        self.blocks = nnx.List([Block(d, heads, rngs=rngs, dtype=dtype) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs, **kw)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][None, : tokens.shape[1]]
        for block in self.blocks:
            x = nnx.remat(_run_block)(block, x) if self.remat else block(x)
        return self.head(self.ln_f(x))


class ScanGPT(nnx.Module):
    """The same decoder with stacked layers (leading layer axis) run by `nnx.scan`."""

    def __init__(
        self, layers, d, heads, seq_len, vocab, *, rngs: nnx.Rngs, dtype=None, remat=False
    ):
        kw = _dtypes(dtype)
        self.remat = remat
        self.embed = nnx.Embed(vocab, d, rngs=rngs, **kw)
        self.pos = nnx.Param(
            jax.random.normal(rngs.params(), (seq_len, d), dtype or jnp.float32) * 0.02
        )

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(d, heads, rngs=rngs, dtype=dtype)

        self.blocks = make(rngs)
        self.ln_f = nnx.LayerNorm(d, rngs=rngs, **kw)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs, **kw)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][None, : tokens.shape[1]]
        run = nnx.remat(_run_block) if self.remat else _run_block

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return run(block, x)

        x = body(x, self.blocks)
        return self.head(self.ln_f(x))


def _lm_loss(logits, labels):
    logp = jax.nn.log_softmax(logits, axis=-1)
    onehot = jax.nn.one_hot(labels, logits.shape[-1], dtype=logits.dtype)
    return -jnp.mean(jnp.sum(logp * onehot, axis=-1))


def _sgd_step(loss_fn):
    def step(params, *batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
        new = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
        return new, loss

    return step


def _model_entry(name, make, inputs_fn, loss_of_model, train=True):
    """Builds a ZooModel from ``make(seed) -> module`` and a loss of (module, *inputs)."""
    abstract = nnx.eval_shape(lambda: make(0))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def loss_fn(p, *inputs):
        return loss_of_model(nnx.merge(graphdef, p, rest), *inputs)

    fn = _sgd_step(loss_fn) if train else loss_fn

    def init(seed: int):
        return nnx.split(make(seed), nnx.Param, ...)[1]

    abstract_inputs = jax.eval_shape(lambda: inputs_fn(0))
    return ZooModel(name, fn, params, abstract_inputs, init, inputs_fn, train)


def gpt(
    layers=2,
    d_model=64,
    heads=4,
    seq_len=16,
    batch=4,
    vocab=256,
    dtype="float32",
    remat=False,
    *,
    scan=False,
    train=True,
):
    """A GPT language model; ``fn`` is an SGD training step (or the loss when ``train=False``)."""
    cls = ScanGPT if scan else GPT

    def make(seed):
        return cls(
            layers,
            d_model,
            heads,
            seq_len,
            vocab,
            rngs=nnx.Rngs(seed),
            dtype=jnp.dtype(dtype),
            remat=remat,
        )

    def inputs(seed):
        key = jax.random.key(seed + 1)
        tokens = jax.random.randint(key, (batch, seq_len), 0, vocab)
        return tokens, jnp.roll(tokens, -1, axis=1)

    name = "gpt_scan" if scan else "gpt"
    return _model_entry(name, make, inputs, lambda m, t, y: _lm_loss(m(t), y), train)


# ----------------------------------------------------------------------------- T5, ViT, MoE, DCGAN


class DecoderBlock(nnx.Module):
    """Causal self-attention, cross-attention to the encoder, MLP (pre-norm)."""

    def __init__(self, d: int, heads: int, *, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(d, rngs=rngs)
        self.self_attn = Attention(d, heads, rngs=rngs, causal=True)
        self.ln2 = nnx.LayerNorm(d, rngs=rngs)
        self.cross_attn = Attention(d, heads, rngs=rngs, causal=False)
        self.ln3 = nnx.LayerNorm(d, rngs=rngs)
        self.mlp = MLP(d, 4 * d, rngs=rngs)

    def __call__(self, x, enc):
        x = x + self.self_attn(self.ln1(x))
        x = x + self.cross_attn(self.ln2(x), enc)
        return x + self.mlp(self.ln3(x))


class T5(nnx.Module):
    """T5-style encoder-decoder (learned positions instead of relative buckets)."""

    def __init__(self, layers, d, heads, seq_len, vocab, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq_len, d)) * 0.02)
        self.encoder = nnx.List([Block(d, heads, rngs=rngs, causal=False) for _ in range(layers)])
        self.ln_enc = nnx.LayerNorm(d, rngs=rngs)
        self.decoder = nnx.List([DecoderBlock(d, heads, rngs=rngs) for _ in range(layers)])
        self.ln_dec = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, src, tgt):
        pos = self.pos[...][None]
        x = self.embed(src) + pos[:, : src.shape[1]]
        for block in self.encoder:
            x = block(x)
        enc = self.ln_enc(x)
        y = self.embed(tgt) + pos[:, : tgt.shape[1]]
        for block in self.decoder:
            y = block(y, enc)
        return self.head(self.ln_dec(y))


def t5(layers=2, d_model=64, heads=4, seq_len=16, batch=4, vocab=256, *, train=True):
    """A T5-style encoder-decoder; ``fn`` is an SGD step on next-token loss of the decoder."""

    def make(seed):
        return T5(layers, d_model, heads, seq_len, vocab, rngs=nnx.Rngs(seed))

    def inputs(seed):
        k1, k2 = jax.random.split(jax.random.key(seed + 1))
        src = jax.random.randint(k1, (batch, seq_len), 0, vocab)
        tgt = jax.random.randint(k2, (batch, seq_len), 0, vocab)
        return src, tgt, jnp.roll(tgt, -1, axis=1)

    return _model_entry("t5", make, inputs, lambda m, s, t, y: _lm_loss(m(s, t), y), train)


class ViT(nnx.Module):
    """Vision transformer: patch embedding, bidirectional blocks, mean pooling, class head."""

    def __init__(self, layers, d, heads, image, patch, classes, *, rngs: nnx.Rngs):
        self.patch = patch
        n = (image // patch) ** 2
        self.embed = nnx.Linear(patch * patch * 3, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (n, d)) * 0.02)
        self.blocks = nnx.List([Block(d, heads, rngs=rngs, causal=False) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, classes, rngs=rngs)

    def __call__(self, images):
        b, h, w, c = images.shape
        p = self.patch
        x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
        x = self.embed(x.reshape(b, (h // p) * (w // p), p * p * c)) + self.pos[...][None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x).mean(axis=1))


def vit(layers=2, d_model=64, heads=4, batch=4, image=16, patch=4, classes=16, *, train=True):
    """A ViT classifier; ``fn`` is an SGD step on softmax cross-entropy."""

    def make(seed):
        return ViT(layers, d_model, heads, image, patch, classes, rngs=nnx.Rngs(seed))

    def inputs(seed):
        k1, k2 = jax.random.split(jax.random.key(seed + 1))
        images = jax.random.normal(k1, (batch, image, image, 3))
        return images, jax.random.randint(k2, (batch,), 0, classes)

    return _model_entry("vit", make, inputs, lambda m, x, y: _lm_loss(m(x), y), train)


class MoEFeedForward(nnx.Module):
    """Top-1-routed mixture of experts with dense dispatch (every expert sees a masked batch)."""

    def __init__(self, d: int, hidden: int, experts: int, *, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.router = nnx.Linear(d, experts, use_bias=False, rngs=rngs)
        self.w_in = nnx.Param(init(rngs.params(), (experts, d, hidden)))
        self.w_out = nnx.Param(init(rngs.params(), (experts, hidden, d)))

    def __call__(self, x):
        logits = self.router(x)
        gates = jax.nn.softmax(logits, axis=-1)
        choice = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=x.dtype)
        combine = gates * choice
        h = jax.nn.gelu(jnp.einsum("bsd,edh->bseh", x, self.w_in[...]))
        out = jnp.einsum("bseh,ehd->bsed", h, self.w_out[...])
        return jnp.einsum("bsed,bse->bsd", out, combine)


class MoE(nnx.Module):
    """A language model whose blocks are attention + MoE feed-forward."""

    def __init__(self, layers, d, heads, experts, seq_len, vocab, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq_len, d)) * 0.02)
        self.ln1 = nnx.List([nnx.LayerNorm(d, rngs=rngs) for _ in range(layers)])
        self.attn = nnx.List([Attention(d, heads, rngs=rngs) for _ in range(layers)])
        self.ln2 = nnx.List([nnx.LayerNorm(d, rngs=rngs) for _ in range(layers)])
        self.moe = nnx.List([MoEFeedForward(d, 2 * d, experts, rngs=rngs) for _ in range(layers)])
        self.head = nnx.Linear(d, vocab, use_bias=False, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos[...][None, : tokens.shape[1]]
        for ln1, attn, ln2, moe in zip(self.ln1, self.attn, self.ln2, self.moe):
            x = x + attn(ln1(x))
            x = x + moe(ln2(x))
        return self.head(x)


def moe(layers=2, d_model=64, heads=4, seq_len=16, batch=4, vocab=256, experts=4, *, train=True):
    """An MoE language model; ``fn`` is an SGD step."""

    def make(seed):
        return MoE(layers, d_model, heads, experts, seq_len, vocab, rngs=nnx.Rngs(seed))

    def inputs(seed):
        tokens = jax.random.randint(jax.random.key(seed + 1), (batch, seq_len), 0, vocab)
        return tokens, jnp.roll(tokens, -1, axis=1)

    return _model_entry("moe", make, inputs, lambda m, t, y: _lm_loss(m(t), y), train)


class Generator(nnx.Module):
    """DCGAN generator: dense -> 4x4 maps -> transposed conv x2 -> conv -> tanh image."""

    def __init__(self, latent: int, width: int, *, rngs: nnx.Rngs):
        self.width = width
        self.dense = nnx.Linear(latent, 4 * 4 * 2 * width, rngs=rngs)
        self.up1 = nnx.ConvTranspose(2 * width, width, (4, 4), strides=(2, 2), rngs=rngs)
        self.up2 = nnx.ConvTranspose(width, width, (4, 4), strides=(2, 2), rngs=rngs)
        self.out = nnx.Conv(width, 3, (3, 3), rngs=rngs)

    def __call__(self, z):
        x = jax.nn.relu(self.dense(z)).reshape(z.shape[0], 4, 4, 2 * self.width)
        x = jax.nn.relu(self.up1(x))
        x = jax.nn.relu(self.up2(x))
        return jnp.tanh(self.out(x))


class Discriminator(nnx.Module):
    """DCGAN discriminator: strided convs -> dense logit."""

    def __init__(self, width: int, image: int, *, rngs: nnx.Rngs):
        self.c1 = nnx.Conv(3, width, (4, 4), strides=(2, 2), rngs=rngs)
        self.c2 = nnx.Conv(width, 2 * width, (4, 4), strides=(2, 2), rngs=rngs)
        self.dense = nnx.Linear((image // 4) ** 2 * 2 * width, 1, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.leaky_relu(self.c1(x), 0.2)
        x = jax.nn.leaky_relu(self.c2(x), 0.2)
        return self.dense(x.reshape(x.shape[0], -1))[:, 0]


class GANPair(nnx.Module):
    def __init__(self, latent, width, image, *, rngs: nnx.Rngs):
        self.g = Generator(latent, width, rngs=rngs)
        self.d = Discriminator(width, image, rngs=rngs)


def dcgan(batch=8, d_model=16, latent=32, *, train=True):
    """A convolutional generator/discriminator pair; ``fn`` is one SGD step of both
    (non-saturating GAN losses). ``d_model`` is the base channel width; images are 16x16."""
    image = 16

    def make(seed):
        return GANPair(latent, d_model, image, rngs=nnx.Rngs(seed))

    def inputs(seed):
        k1, k2 = jax.random.split(jax.random.key(seed + 1))
        real = jax.random.uniform(k1, (batch, image, image, 3), minval=-1.0, maxval=1.0)
        return real, jax.random.normal(k2, (batch, latent))

    def losses(pair, real, z):
        fake = pair.g(z)
        d_real, d_fake = pair.d(real), pair.d(jax.lax.stop_gradient(fake))
        d_loss = jnp.mean(jax.nn.softplus(-d_real) + jax.nn.softplus(d_fake))
        g_loss = jnp.mean(jax.nn.softplus(-pair.d(fake)))
        return d_loss, g_loss

    abstract = nnx.eval_shape(lambda: make(0))
    graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)

    def step(p, real, z):
        def d_loss(pd):
            return losses(nnx.merge(graphdef, {"g": p["g"], "d": pd}, rest), real, z)[0]

        def g_loss(pg):
            return losses(nnx.merge(graphdef, {"g": pg, "d": p["d"]}, rest), real, z)[1]

        ld, gd = jax.value_and_grad(d_loss)(p["d"])
        lg, gg = jax.value_and_grad(g_loss)(p["g"])
        new = {
            "g": jax.tree.map(lambda a, g: a - LEARNING_RATE * g, p["g"], gg),
            "d": jax.tree.map(lambda a, g: a - LEARNING_RATE * g, p["d"], gd),
        }
        return new, (ld, lg)

    def forward(p, real, z):
        return losses(nnx.merge(graphdef, p, rest), real, z)

    def init(seed: int):
        return nnx.split(make(seed), nnx.Param, ...)[1]

    abstract_inputs = jax.eval_shape(lambda: inputs(0))
    return ZooModel(
        "dcgan", step if train else forward, params, abstract_inputs, init, inputs, train
    )


MODELS: dict[str, Callable[..., ZooModel]] = {
    "gpt": gpt,
    "gpt_fwd": functools.partial(gpt, train=False),
    "gpt_scan": functools.partial(gpt, scan=True),
    "t5": t5,
    "vit": vit,
    "moe": moe,
    "dcgan": dcgan,
}


def build(name: str, **kwargs) -> ZooModel:
    """Builds zoo model `name`; dimensions it does not use (e.g. vocab for a ViT) are ignored."""
    if name not in MODELS:
        raise ValueError(f"unknown zoo model {name!r}; known: {', '.join(sorted(MODELS))}")
    builder = MODELS[name]
    accepted = inspect.signature(builder).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in accepted.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    return builder(**kwargs)


COLUMN_PARALLEL = ("query", "key", "value", "fc1")
"""Linear layers Megatron-LM splits on the output dimension (``ColumnParallelLinear``)."""
ROW_PARALLEL = ("out", "fc2")
"""Linear layers Megatron-LM splits on the input dimension (``RowParallelLinear``)."""


def megatron_rules(path: str, ndim: int) -> tuple[str | None, ...] | None:
    """Megatron-LM's tensor-parallel specs for the zoo transformers' params; None: no opinion.

    As Megatron-LM lays them out over its tensor-parallel (``model``) axis:

    - the token embedding (``VocabParallelEmbedding``) splits the vocabulary, its first dim;
    - the output head splits its output dimension (the vocabulary of the language models; the
      classes of the ViT, whose head the zoo names alike);
    - query/key/value and the first MLP matmul (column parallel) split the output dimension of
      their kernel and their bias;
    - the attention output and second MLP matmul (row parallel) split the input dimension of
      their kernel; their bias, added after the all-reduce, is replicated.

    Every other parameter (layer norms, position embeddings, routers, experts, patch embeddings)
    returns None: the baseline has no opinion there and the search chooses freely (see
    `tapas_jax.planner.cost_with_param_specs`). The batch goes over ``data`` by the planner's
    batch axis, as in Megatron's data parallelism. Stacked (scanned) params keep their leading
    layer dimension unsplit.
    """
    leaf = path.split("/")
    name = leaf[-1]
    if name == "embedding" and ndim >= 2:
        return (None,) * (ndim - 2) + ("model", None)
    if "head" in leaf and name == "kernel" and ndim >= 2:
        return (None,) * (ndim - 1) + ("model",)
    if any(n in leaf for n in COLUMN_PARALLEL) and name in ("kernel", "bias"):
        return (None,) * (ndim - 1) + ("model",)
    if any(n in leaf for n in ROW_PARALLEL):
        if name == "kernel" and ndim >= 2:
            return (None,) * (ndim - 2) + ("model", None)
        if name == "bias":
            return (None,) * ndim
    return None
