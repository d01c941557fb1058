"""Generators and discriminators in Flax NNX, built from a `ModelConfig`.

Three families, chosen by ``model.arch``:

- ``biggan``: BigGAN (Brock et al., 2019). G: latent -> 4x4 map -> residual up blocks with
  class-conditional batch norm (conditioning = shared class embedding ++ latent) -> BN, ReLU,
  3x3 conv, tanh. D: residual down blocks (the first without pre-activation), ReLU, sum pooling,
  linear output plus the projection term ``<embed(y), h>``. Spectral norm on every weight of G
  and D, orthogonal init, one self-attention block at ``model.attn_resolution`` in each. Sized by
  config from 8x8 (one up block) to 1024x1024 (eight).
- ``dcgan``: a small conv net for CPU runs: nearest-upsample + 3x3 conv + (conditional) BN + ReLU
  stages in G, strided 3x3 convs with leaky ReLU (spectral norm optional) and projection in D.
- ``mlp``: fully connected G and D for 2-D Gaussian mixtures (ring of 8, grid of 25).

Activations are NHWC everywhere (channels on the minor, tiled dimension of a TPU). A
space-to-depth stem (`paragan_jax.layout`) is not wired in: over the whole training step it does
not lower the TPU tile model's padding (BENCHMARKS.md, layout).

Interface shared by all (this is what `paragan_jax.train` relies on):

- ``G(z, labels, train) -> samples``: ``z`` is ``(B, z_dim)``, ``labels`` ``(B,)`` int32 (ignored
  when unconditional), samples ``(B, H, W, C)`` in [-1, 1] (``(B, 2)`` for ``mlp``). ``train=True``
  uses batch statistics and updates BN running averages and spectral-norm vectors.
- ``D(x, labels, update_stats) -> logits (B,)``; ``update_stats`` advances the spectral-norm power
  iteration (True only in D's own step).

Public entry point: ``build_models(config: ModelConfig, rngs: nnx.Rngs) -> (G, D)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig
from .layers import ConditionalBatchNorm, SelfAttention, SNConv, SNEmbed, SNLinear

__all__ = [
    "BigGANDiscriminator",
    "BigGANGenerator",
    "DCGANDiscriminator",
    "DCGANGenerator",
    "MLPDiscriminator",
    "MLPGenerator",
    "build_models",
    "default_channel_mults",
]


def default_channel_mults(resolution: int) -> tuple[list[int], list[int]]:
    """BigGAN's channel multipliers for a resolution: G from 4x4 up, D from full size down.

    For 128 this gives G ``[16, 16, 8, 4, 2, 1]`` and D ``[1, 2, 4, 8, 16, 16]``, as in the paper.
    """
    n_up = int(math.log2(resolution)) - 2
    g = [min(16, 2 ** (n_up - i)) for i in range(n_up + 1)]
    return g, list(reversed(g))


def _upsample(x: jax.Array) -> jax.Array:
    return jnp.repeat(jnp.repeat(x, 2, axis=1), 2, axis=2)


def _avgpool(x: jax.Array) -> jax.Array:
    b, h, w, c = x.shape
    return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))


def _dtype(name: str):
    return jnp.bfloat16 if name == "bfloat16" else jnp.float32


class GBlock(nnx.Module):
    """BigGAN up block: CBN-ReLU-up-conv3-CBN-ReLU-conv3, plus up-conv1 shortcut."""

    def __init__(self, cin: int, cout: int, cond_dim: int, cfg: ModelConfig, rngs: nnx.Rngs):
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        self.bn1 = ConditionalBatchNorm(cin, cond_dim, momentum=cfg.bn_momentum, **sn, rngs=rngs)
        self.conv1 = SNConv(cin, cout, 3, **sn, rngs=rngs)
        self.bn2 = ConditionalBatchNorm(cout, cond_dim, momentum=cfg.bn_momentum, **sn, rngs=rngs)
        self.conv2 = SNConv(cout, cout, 3, **sn, rngs=rngs)
        self.skip = SNConv(cin, cout, 1, **sn, rngs=rngs)

    def __call__(self, x, cond, train: bool):
        h = _upsample(jax.nn.relu(self.bn1(x, cond, train)))
        h = self.conv1(h, train)
        h = self.conv2(jax.nn.relu(self.bn2(h, cond, train)), train)
        return h + self.skip(_upsample(x), train)


class DBlock(nnx.Module):
    """BigGAN down block: (ReLU)-conv3-ReLU-conv3-avgpool, plus conv1-avgpool shortcut."""

    def __init__(
        self,
        cin: int,
        cout: int,
        down: bool,
        preact: bool,
        cfg: ModelConfig,
        rngs: nnx.Rngs,
    ):
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        self.down, self.preact = down, preact
        self.conv1 = SNConv(cin, cout, 3, **sn, rngs=rngs)
        self.conv2 = SNConv(cout, cout, 3, **sn, rngs=rngs)
        self.skip = SNConv(cin, cout, 1, **sn, rngs=rngs) if (cin != cout or down) else None

    def __call__(self, x, update_stats: bool):
        h = jax.nn.relu(x) if self.preact else x
        h = self.conv2(jax.nn.relu(self.conv1(h, update_stats)), update_stats)
        s = x
        if self.preact:
            if self.skip is not None:
                s = self.skip(s, update_stats)
            if self.down:
                h, s = _avgpool(h), _avgpool(s)
        else:  # first block: pool before the shortcut conv, as BigGAN does
            if self.down:
                h, s = _avgpool(h), _avgpool(s)
            if self.skip is not None:
                s = self.skip(s, update_stats)
        return h + s


class BigGANGenerator(nnx.Module):
    """BigGAN generator; see the module docstring."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype_name = cfg.dtype
        mults = cfg.g_channel_mult or default_channel_mults(cfg.resolution)[0]
        chans = [cfg.g_width * m for m in mults]
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        self.shared = (
            nnx.Embed(cfg.num_classes, cfg.shared_dim, rngs=rngs) if cfg.num_classes else None
        )
        cond_dim = cfg.z_dim + (cfg.shared_dim if cfg.num_classes else 0)
        self.linear = SNLinear(cfg.z_dim, 4 * 4 * chans[0], **sn, rngs=rngs)
        blocks, attn = [], []
        res = 4
        for i in range(len(chans) - 1):
            blocks.append(GBlock(chans[i], chans[i + 1], cond_dim, cfg, rngs))
            res *= 2
            attn.append(
                SelfAttention(chans[i + 1], **sn, rngs=rngs) if cfg.attn_resolution == res else None
            )
        self.blocks = nnx.List(blocks)
        self.attn = nnx.List(attn)
        self.out_bn = ConditionalBatchNorm(chans[-1], 0, momentum=cfg.bn_momentum, **sn, rngs=rngs)
        self.out_conv = SNConv(chans[-1], cfg.channels, 3, **sn, rngs=rngs)
        self.c0 = chans[0]

    def __call__(self, z: jax.Array, labels: jax.Array, train: bool) -> jax.Array:
        dt = _dtype(self.dtype_name)
        z = z.astype(dt)
        cond = z
        if self.shared is not None:
            cond = jnp.concatenate([self.shared(labels).astype(dt), z], axis=-1)
        h = self.linear(z, train).reshape(z.shape[0], 4, 4, self.c0)
        for block, attn in zip(self.blocks, self.attn):
            h = block(h, cond, train)
            if attn is not None:
                h = attn(h, train)
        h = jax.nn.relu(self.out_bn(h, None, train))
        return jnp.tanh(self.out_conv(h, train)).astype(jnp.float32)


class BigGANDiscriminator(nnx.Module):
    """BigGAN projection discriminator; see the module docstring."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype_name = cfg.dtype
        mults = cfg.d_channel_mult or default_channel_mults(cfg.resolution)[1]
        chans = [cfg.d_width * m for m in mults]
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        blocks, attn = [], []
        res, cin = cfg.resolution, cfg.channels
        for i, cout in enumerate(chans):
            down = i < len(chans) - 1
            blocks.append(DBlock(cin, cout, down, preact=i > 0, cfg=cfg, rngs=rngs))
            res = res // 2 if down else res
            attn.append(
                SelfAttention(cout, **sn, rngs=rngs)
                if cfg.attn_resolution == res and down
                else None
            )
            cin = cout
        self.blocks = nnx.List(blocks)
        self.attn = nnx.List(attn)
        self.linear = SNLinear(cin, 1, **sn, rngs=rngs)
        self.embed = SNEmbed(cfg.num_classes, cin, **sn, rngs=rngs) if cfg.num_classes else None

    def __call__(self, x: jax.Array, labels: jax.Array, update_stats: bool) -> jax.Array:
        h = x.astype(_dtype(self.dtype_name))
        for block, attn in zip(self.blocks, self.attn):
            h = block(h, update_stats)
            if attn is not None:
                h = attn(h, update_stats)
        h = jnp.sum(jax.nn.relu(h), axis=(1, 2))
        out = self.linear(h, update_stats)[:, 0]
        if self.embed is not None:
            out = out + jnp.sum(self.embed(labels, update_stats) * h, axis=-1)
        return out.astype(jnp.float32)


class DCGANGenerator(nnx.Module):
    """Small conditional DCGAN generator for CPU runs."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype_name = cfg.dtype
        n_up = int(math.log2(cfg.resolution)) - 2
        chans = [cfg.g_width * 2 ** (n_up - i) for i in range(n_up + 1)]
        self.shared = (
            nnx.Embed(cfg.num_classes, cfg.shared_dim, rngs=rngs) if cfg.num_classes else None
        )
        cond_dim = cfg.shared_dim if cfg.num_classes else 0
        self.linear = SNLinear(cfg.z_dim, 4 * 4 * chans[0], use_sn=False, rngs=rngs)
        self.bn0 = ConditionalBatchNorm(
            chans[0], cond_dim, momentum=cfg.bn_momentum, use_sn=False, rngs=rngs
        )
        self.convs = nnx.List(
            [SNConv(chans[i], chans[i + 1], 3, use_sn=False, rngs=rngs) for i in range(n_up)]
        )
        self.bns = nnx.List(
            [
                ConditionalBatchNorm(
                    chans[i + 1], cond_dim, momentum=cfg.bn_momentum, use_sn=False, rngs=rngs
                )
                for i in range(n_up)
            ]
        )
        self.out_conv = SNConv(chans[-1], cfg.channels, 3, use_sn=False, rngs=rngs)
        self.c0 = chans[0]

    def __call__(self, z: jax.Array, labels: jax.Array, train: bool) -> jax.Array:
        dt = _dtype(self.dtype_name)
        z = z.astype(dt)
        cond = self.shared(labels).astype(dt) if self.shared is not None else None
        h = self.linear(z).reshape(z.shape[0], 4, 4, self.c0)
        h = jax.nn.relu(self.bn0(h, cond, train))
        for conv, bn in zip(self.convs, self.bns):
            h = jax.nn.relu(bn(conv(_upsample(h)), cond, train))
        return jnp.tanh(self.out_conv(h)).astype(jnp.float32)


class DCGANDiscriminator(nnx.Module):
    """Small DCGAN discriminator (strided convs, leaky ReLU) with a projection head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.dtype_name = cfg.dtype
        n_down = int(math.log2(cfg.resolution)) - 2
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        chans = [cfg.channels] + [cfg.d_width * 2**i for i in range(n_down)]
        self.convs = nnx.List(
            [SNConv(chans[i], chans[i + 1], 3, stride=2, **sn, rngs=rngs) for i in range(n_down)]
        )
        feat = chans[-1] * 16
        self.linear = SNLinear(feat, 1, **sn, rngs=rngs)
        self.embed = SNEmbed(cfg.num_classes, feat, **sn, rngs=rngs) if cfg.num_classes else None

    def __call__(self, x: jax.Array, labels: jax.Array, update_stats: bool) -> jax.Array:
        h = x.astype(_dtype(self.dtype_name))
        for conv in self.convs:
            h = jax.nn.leaky_relu(conv(h, update_stats), 0.2)
        h = h.reshape(h.shape[0], -1)
        out = self.linear(h, update_stats)[:, 0]
        if self.embed is not None:
            out = out + jnp.sum(self.embed(labels, update_stats) * h, axis=-1)
        return out.astype(jnp.float32)


class MLPGenerator(nnx.Module):
    """Fully connected generator of 2-D points."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dims = [cfg.z_dim] + [cfg.g_width] * cfg.mlp_layers
        self.layers = nnx.List(
            [SNLinear(a, b, use_sn=False, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])]
        )
        self.out = SNLinear(dims[-1], 2, use_sn=False, rngs=rngs)

    def __call__(self, z: jax.Array, labels: jax.Array, train: bool) -> jax.Array:
        h = z
        for layer in self.layers:
            h = jax.nn.relu(layer(h))
        return self.out(h)


class MLPDiscriminator(nnx.Module):
    """Fully connected discriminator of 2-D points."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        sn = dict(use_sn=cfg.spectral_norm, sn_eps=cfg.sn_eps)
        dims = [2] + [cfg.d_width] * cfg.mlp_layers
        self.layers = nnx.List(
            [SNLinear(a, b, **sn, rngs=rngs) for a, b in zip(dims[:-1], dims[1:])]
        )
        self.out = SNLinear(dims[-1], 1, **sn, rngs=rngs)

    def __call__(self, x: jax.Array, labels: jax.Array, update_stats: bool) -> jax.Array:
        h = x
        for layer in self.layers:
            h = jax.nn.leaky_relu(layer(h, update_stats), 0.2)
        return self.out(h, update_stats)[:, 0]


_FAMILIES = {
    "biggan": (BigGANGenerator, BigGANDiscriminator),
    "dcgan": (DCGANGenerator, DCGANDiscriminator),
    "mlp": (MLPGenerator, MLPDiscriminator),
}


def build_models(config: ModelConfig, rngs: nnx.Rngs) -> tuple[nnx.Module, nnx.Module]:
    """Builds ``(generator, discriminator)`` for ``config.arch``.

    Args:
      config: the model section of a `TrainConfig`.
      rngs: NNX RNG streams; only ``params`` is used (for weights and spectral-norm vectors).

    Returns:
      Two NNX modules with the interface given in the module docstring.
    """
    if config.arch not in _FAMILIES:
        raise ValueError(f"model.arch={config.arch!r}: expected one of {sorted(_FAMILIES)}")
    g_cls, d_cls = _FAMILIES[config.arch]
    return g_cls(config, rngs), d_cls(config, rngs)
