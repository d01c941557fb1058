"""GAN losses: hinge and non-saturating, and the R1 gradient penalty.

All take discriminator logits (``(B,)`` float32) and return scalar means, so that a batch sharded
over the ``data`` axis gives the same value as the unsharded batch.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["d_loss", "g_loss", "r1_penalty"]


def d_loss(kind: str, real_logits: jax.Array, fake_logits: jax.Array) -> jax.Array:
    """Discriminator loss.

    Args:
      kind: ``hinge`` (``relu(1 - D(x)) + relu(1 + D(G(z)))``) or ``ns``
        (``softplus(-D(x)) + softplus(D(G(z)))``, the logistic loss).
      real_logits: D on real samples.
      fake_logits: D on generated samples.
    """
    if kind == "hinge":
        return jnp.mean(jax.nn.relu(1.0 - real_logits)) + jnp.mean(jax.nn.relu(1.0 + fake_logits))
    if kind == "ns":
        return jnp.mean(jax.nn.softplus(-real_logits)) + jnp.mean(jax.nn.softplus(fake_logits))
    raise ValueError(f"loss={kind!r}: expected 'hinge' or 'ns'")


def g_loss(kind: str, fake_logits: jax.Array) -> jax.Array:
    """Generator loss: ``-D(G(z))`` for hinge, ``softplus(-D(G(z)))`` (non-saturating) for ns."""
    if kind == "hinge":
        return -jnp.mean(fake_logits)
    if kind == "ns":
        return jnp.mean(jax.nn.softplus(-fake_logits))
    raise ValueError(f"loss={kind!r}: expected 'hinge' or 'ns'")


def r1_penalty(d_fn: Callable[[jax.Array], jax.Array], real: jax.Array) -> jax.Array:
    """R1 (Mescheder et al., 2018): mean over the batch of ``||grad_x D(x)||^2`` on real data.

    Args:
      d_fn: maps a batch of real samples to logits ``(B,)``.
      real: the real batch.

    Returns:
      The unweighted penalty; the caller multiplies by ``gamma / 2``.
    """
    grads = jax.grad(lambda x: jnp.sum(d_fn(x)))(real)
    return jnp.mean(jnp.sum(jnp.square(grads).reshape(real.shape[0], -1), axis=-1))
