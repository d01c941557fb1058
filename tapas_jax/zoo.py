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


MODELS: dict[str, Callable[..., ZooModel]] = {
    "gpt": gpt,
    "gpt_fwd": functools.partial(gpt, train=False),
    "gpt_scan": functools.partial(gpt, scan=True),
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


def megatron_rules(path: str, ndim: int) -> tuple[str | None, ...] | None:
    """Megatron-LM's hand-written specs for the zoo transformers' params (None: no opinion).

    Query/key/value and the first MLP matmul split their output dimension over ``model``; the
    attention output and second MLP matmul split their input dimension; everything else is
    replicated.
    """
    leaf = path.split("/")
    if "kernel" in leaf[-1] and ndim >= 2:
        if any(n in leaf for n in ("query", "key", "value", "fc1")):
            return (None,) * (ndim - 1) + ("model",)
        if any(n in leaf for n in ("out", "fc2")):
            return (None,) * (ndim - 2) + ("model", None)
    if leaf[-1] == "bias" and any(n in leaf for n in ("query", "key", "value", "fc1")):
        return (None,) * (ndim - 1) + ("model",)
    return (None,) * ndim
