"""Building blocks of BigGAN-style models in Flax NNX.

- `SNLinear`, `SNConv`, `SNEmbed`: layers whose weight is divided by its largest singular value,
  estimated by one step of power iteration per training forward (Miyato et al., 2018). The
  left singular vector estimate ``u`` is an `nnx.BatchStat`: it is state, not a parameter, it is
  updated only when the caller says ``update_stats=True`` (the discriminator's own step), and it
  is checkpointed with the batch-norm statistics.
- `ConditionalBatchNorm`: batch norm without affine params whose scale and shift come from a
  conditioning vector (shared class embedding and latent), as in BigGAN's generator.
- `SelfAttention`: SAGAN attention (theta/phi/g 1x1 convs, 2x2 max-pool on phi and g, learned
  residual gain initialised at zero).
- `ortho_init`: the orthogonal initialiser BigGAN uses for every weight.

Batch-norm statistics over a batch sharded on the ``data`` axis are global (jit sees the whole
logical batch, XLA inserts the all-reduce), so a sharded run equals a one-device run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "ConditionalBatchNorm",
    "SNConv",
    "SNEmbed",
    "SNLinear",
    "SelfAttention",
    "ortho_init",
    "spectral_normalize",
]

ortho_init = nnx.initializers.orthogonal()


def _l2n(x: jax.Array, eps: float) -> jax.Array:
    return x / (jnp.sqrt(jnp.sum(x * x)) + eps)


def spectral_normalize(
    w: jax.Array, u: jax.Array, eps: float = 1e-6
) -> tuple[jax.Array, jax.Array]:
    """Divides `w` by its spectral norm estimated with one power-iteration step.

    Args:
      w: weight of any rank; the last axis is the output axis (flattened to ``(-1, out)``).
      u: current estimate of the left singular vector, shape ``(out,)``.
      eps: numerical guard of the normalisation.

    Returns:
      ``(w / sigma, u_new)``; ``u_new`` carries no gradient.
    """
    mat = w.reshape(-1, w.shape[-1])  # (in, out)
    u = jax.lax.stop_gradient(u)
    v = _l2n(mat @ u, eps)  # (in,)
    u_new = jax.lax.stop_gradient(_l2n(mat.T @ v, eps))  # (out,)
    v = jax.lax.stop_gradient(v)
    sigma = v @ mat @ u_new
    return w / sigma, u_new


class _SNMixin:
    def _sn_kernel(self, kernel: jax.Array, update_stats: bool) -> jax.Array:
        if not self.use_sn:
            return kernel
        w, u_new = spectral_normalize(kernel, self.sn_u[...], self.sn_eps)
        if update_stats:
            self.sn_u[...] = u_new
        return w


def _init_u(out: int, rngs: nnx.Rngs) -> nnx.BatchStat:
    return nnx.BatchStat(_l2n(jax.random.normal(rngs.params(), (out,)), 1e-12))


class SNLinear(_SNMixin, nnx.Module):
    """Dense layer with optional spectral norm and orthogonal init."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_sn: bool = True,
        use_bias: bool = True,
        sn_eps: float = 1e-6,
        rngs: nnx.Rngs,
    ):
        self.use_sn, self.sn_eps, self.use_bias = use_sn, sn_eps, use_bias
        self.kernel = nnx.Param(ortho_init(rngs.params(), (in_features, out_features)))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
        self.sn_u = _init_u(out_features, rngs) if use_sn else None

    def __call__(self, x: jax.Array, update_stats: bool = False) -> jax.Array:
        w = self._sn_kernel(self.kernel[...], update_stats).astype(x.dtype)
        y = x @ w
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class SNConv(_SNMixin, nnx.Module):
    """2-D convolution (NHWC, SAME padding) with optional spectral norm and orthogonal init."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        kernel_size: int = 3,
        *,
        stride: int = 1,
        use_sn: bool = True,
        use_bias: bool = True,
        sn_eps: float = 1e-6,
        rngs: nnx.Rngs,
    ):
        self.use_sn, self.sn_eps, self.stride = use_sn, sn_eps, stride
        shape = (kernel_size, kernel_size, in_features, out_features)
        self.kernel = nnx.Param(ortho_init(rngs.params(), shape))
        self.bias = nnx.Param(jnp.zeros((out_features,))) if use_bias else None
        self.sn_u = _init_u(out_features, rngs) if use_sn else None

    def __call__(self, x: jax.Array, update_stats: bool = False) -> jax.Array:
        w = self._sn_kernel(self.kernel[...], update_stats).astype(x.dtype)
        y = jax.lax.conv_general_dilated(
            x,
            w,
            window_strides=(self.stride, self.stride),
            padding="SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(x.dtype)
        return y


class SNEmbed(_SNMixin, nnx.Module):
    """Class embedding with optional spectral norm (the projection discriminator's ``embed``)."""

    def __init__(
        self,
        num: int,
        features: int,
        *,
        use_sn: bool = True,
        sn_eps: float = 1e-6,
        rngs: nnx.Rngs,
    ):
        self.use_sn, self.sn_eps = use_sn, sn_eps
        self.kernel = nnx.Param(ortho_init(rngs.params(), (num, features)))
        self.sn_u = _init_u(features, rngs) if use_sn else None

    def __call__(self, labels: jax.Array, update_stats: bool = False) -> jax.Array:
        return jnp.take(self._sn_kernel(self.kernel[...], update_stats), labels, axis=0)


class ConditionalBatchNorm(nnx.Module):
    """Batch norm whose per-channel scale ``1 + gain(c)`` and shift ``bias(c)`` come from `c`."""

    def __init__(
        self,
        features: int,
        cond_dim: int,
        *,
        momentum: float = 0.9,
        use_sn: bool = True,
        sn_eps: float = 1e-6,
        rngs: nnx.Rngs,
    ):
        self.bn = nnx.BatchNorm(
            features,
            use_scale=False,
            use_bias=False,
            momentum=momentum,
            epsilon=1e-5,
            rngs=rngs,
        )
        self.cond_dim = cond_dim
        if cond_dim:
            self.gain = SNLinear(
                cond_dim, features, use_sn=use_sn, use_bias=False, sn_eps=sn_eps, rngs=rngs
            )
            self.shift = SNLinear(
                cond_dim, features, use_sn=use_sn, use_bias=False, sn_eps=sn_eps, rngs=rngs
            )
        else:
            self.scale = nnx.Param(jnp.ones((features,)))
            self.offset = nnx.Param(jnp.zeros((features,)))

    def __call__(self, x: jax.Array, cond: jax.Array | None, train: bool) -> jax.Array:
        h = self.bn(x, use_running_average=not train)
        if self.cond_dim:
            g = 1.0 + self.gain(cond, update_stats=train)
            b = self.shift(cond, update_stats=train)
            return h * g[:, None, None, :].astype(h.dtype) + b[:, None, None, :].astype(h.dtype)
        return h * self.scale[...].astype(h.dtype) + self.offset[...].astype(h.dtype)


class SelfAttention(nnx.Module):
    """SAGAN self-attention over the spatial positions of an NHWC map."""

    def __init__(self, ch: int, *, use_sn: bool = True, sn_eps: float = 1e-6, rngs: nnx.Rngs):
        kw = dict(use_sn=use_sn, use_bias=False, sn_eps=sn_eps, rngs=rngs)
        self.theta = SNConv(ch, max(ch // 8, 1), 1, **kw)
        self.phi = SNConv(ch, max(ch // 8, 1), 1, **kw)
        self.g = SNConv(ch, max(ch // 2, 1), 1, **kw)
        self.o = SNConv(max(ch // 2, 1), ch, 1, **kw)
        self.gamma = nnx.Param(jnp.zeros(()))

    def __call__(self, x: jax.Array, update_stats: bool = False) -> jax.Array:
        b, h, w, c = x.shape
        theta = self.theta(x, update_stats).reshape(b, h * w, -1)
        phi = self.phi(x, update_stats)
        g = self.g(x, update_stats)
        if h >= 2 and w >= 2:
            phi = nnx.max_pool(phi, (2, 2), (2, 2))
            g = nnx.max_pool(g, (2, 2), (2, 2))
        phi = phi.reshape(b, phi.shape[1] * phi.shape[2], -1)
        g = g.reshape(b, g.shape[1] * g.shape[2], -1)
        beta = jax.nn.softmax(jnp.einsum("bqc,bkc->bqk", theta, phi), axis=-1)
        o = jnp.einsum("bqk,bkc->bqc", beta, g).reshape(b, h, w, -1)
        return x + self.gamma[...].astype(x.dtype) * self.o(o, update_stats)
