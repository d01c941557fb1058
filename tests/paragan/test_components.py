"""Layers, models, losses, data and metrics: small checks a user relies on."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paragan_jax.config import ModelConfig, load_train_config
from paragan_jax.data import DataError, PrefetchLoader, batch_at, gaussian_mixture, load_dataset
from paragan_jax.layers import ConditionalBatchNorm, spectral_normalize
from paragan_jax.losses import d_loss, g_loss, r1_penalty
from paragan_jax.metrics import (
    classifier_score,
    frechet_distance,
    kernel_inception_distance,
    mode_statistics,
)
from paragan_jax.models import build_models, default_channel_mults


def test_spectral_norm_power_iteration_converges_to_unit_norm():
    w = jax.random.normal(jax.random.PRNGKey(0), (3, 3, 4, 8))
    u = jnp.ones((8,)) / jnp.sqrt(8.0)
    u = jax.lax.fori_loop(0, 100, lambda _, u: spectral_normalize(w, u)[1], u)
    wn, _ = spectral_normalize(w, u)
    top = np.linalg.svd(np.asarray(wn).reshape(-1, 8), compute_uv=False)[0]
    assert abs(top - 1.0) < 1e-4


def test_conditional_batch_norm_uses_condition():
    cbn = ConditionalBatchNorm(4, 3, use_sn=False, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.PRNGKey(1), (6, 2, 2, 4)) * 3 + 2
    apply = nnx.jit(lambda m, x, c: m(x, c, train=True))
    zero = apply(cbn, x, jnp.zeros((6, 3)))
    np.testing.assert_allclose(np.asarray(zero.mean(axis=(0, 1, 2))), 0.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(zero.var(axis=(0, 1, 2))), 1.0, atol=1e-3)
    other = apply(cbn, x, jnp.ones((6, 3)))
    assert float(jnp.max(jnp.abs(other - zero))) > 1e-3


def test_biggan_channel_mults_match_the_paper():
    assert default_channel_mults(128) == ([16, 16, 8, 4, 2, 1], [1, 2, 4, 8, 16, 16])


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param(
            ModelConfig(
                arch="biggan",
                resolution=8,
                channels=3,
                g_width=2,
                d_width=2,
                z_dim=4,
                shared_dim=4,
                attn_resolution=8,
                num_classes=3,
            ),
            marks=pytest.mark.slow,
        ),
        ModelConfig(arch="dcgan", resolution=8, z_dim=4, g_width=2, d_width=2, shared_dim=2),
        ModelConfig(arch="mlp", z_dim=4, g_width=8, d_width=8, num_classes=0),
    ],
    ids=["biggan", "dcgan", "mlp"],
)
def test_models_shapes_and_range(cfg):
    @nnx.jit
    def forward(z, y):
        g, d = build_models(cfg, nnx.Rngs(0))
        x = g(z, y, train=True)
        return x, d(x, y, update_stats=True)

    x, logits = forward(jnp.ones((2, cfg.z_dim)), jnp.array([0, 1]))
    expect = (2, 2) if cfg.arch == "mlp" else (2, cfg.resolution, cfg.resolution, cfg.channels)
    assert x.shape == expect and logits.shape == (2,)
    assert bool(jnp.all(jnp.isfinite(logits)))
    if cfg.arch != "mlp":
        assert float(jnp.max(jnp.abs(x))) <= 1.0


def test_biggan_has_attention_and_projection():
    cfg = ModelConfig(
        arch="biggan",
        resolution=16,
        g_width=2,
        d_width=2,
        attn_resolution=8,
        num_classes=5,
        z_dim=4,
        shared_dim=4,
    )
    g, d = nnx.eval_shape(lambda: build_models(cfg, nnx.Rngs(0)))
    assert sum(a is not None for a in g.attn) == 1 and sum(a is not None for a in d.attn) == 1
    assert d.embed is not None and g.shared is not None


def test_losses_by_hand():
    real, fake = jnp.array([2.0, 0.5]), jnp.array([-2.0, 0.0])
    assert float(d_loss("hinge", real, fake)) == pytest.approx((0 + 0.5) / 2 + (0 + 1) / 2)
    assert float(g_loss("hinge", fake)) == pytest.approx(1.0)
    sp = np.log1p(np.exp([-2.0, -0.5])).mean() + np.log1p(np.exp([-2.0, 0.0])).mean()
    assert float(d_loss("ns", real, fake)) == pytest.approx(sp, rel=1e-5)
    w = jnp.array([3.0, 4.0])
    assert float(r1_penalty(lambda x: x @ w, jnp.ones((5, 2)))) == pytest.approx(25.0)


def test_digits_and_mixtures():
    cfg = load_train_config("tiny")
    ds = load_dataset(cfg)
    assert ds.images.shape == (1797, 8, 8, 1) and ds.num_classes == 10
    assert ds.images.min() >= -1.0 and ds.images.max() <= 1.0
    ring = gaussian_mixture("ring8", 4000, 0.02, 0)
    stats = mode_statistics(ring.images, ring.modes, 0.02)
    assert stats["modes_covered"] == 8 and stats["high_quality_fraction"] > 0.98


def test_loader_is_deterministic_and_resumable():
    ds = gaussian_mixture("ring8", 100, 0.02, 0)
    loader = PrefetchLoader(ds, 32, seed=3, start=0)
    first = [next(loader) for _ in range(5)]
    loader.close()
    resumed = PrefetchLoader(ds, 32, seed=3, start=3)
    np.testing.assert_array_equal(next(resumed)["image"], first[3]["image"])
    assert resumed.position == 4
    resumed.close()
    np.testing.assert_array_equal(batch_at(ds, 32, 3, 4)["image"], first[4]["image"])
    # Within an epoch (3 batches of 32 out of 100), no sample repeats.
    idx = np.concatenate([b["image"][:, 0] for b in first[:3]])
    assert len(np.unique(idx)) == 96


def test_npy_shards(tmp_path):
    rng = np.random.default_rng(0)
    np.savez(
        tmp_path / "a.npz",
        images=rng.integers(0, 255, (20, 8, 8, 1), dtype=np.uint8),
        labels=np.arange(20) % 2,
    )
    np.savez(
        tmp_path / "b.npz",
        images=rng.integers(0, 255, (12, 8, 8, 1), dtype=np.uint8),
        labels=np.arange(12) % 2,
    )
    cfg = load_train_config(
        "tiny", ["data.source=npy", f"data.path={tmp_path}", "model.num_classes=2"]
    )
    ds = load_dataset(cfg)
    assert ds.images.shape == (32, 8, 8, 1) and ds.num_classes == 2
    np.save(tmp_path / "c.npy", np.zeros((4, 16, 16, 1), np.uint8))
    with pytest.raises(DataError, match="mixed image sizes"):
        load_dataset(cfg)


def test_metric_formulas():
    rng = np.random.default_rng(0)
    a = rng.normal(size=(2000, 3))
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-6)
    shifted = a + np.array([1.0, 0.0, 0.0])
    assert frechet_distance(a, shifted) == pytest.approx(1.0, abs=1e-6)
    assert abs(kernel_inception_distance(a, rng.normal(size=(2000, 3)))) < 0.01
    assert kernel_inception_distance(a, shifted) > 0.1
    onehot = np.eye(10)[np.arange(1000) % 10]
    assert classifier_score(onehot) == pytest.approx(10.0, rel=1e-6)
    assert classifier_score(np.full((100, 10), 0.1)) == pytest.approx(1.0)
