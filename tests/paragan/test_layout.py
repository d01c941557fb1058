"""Hardware-aware layout: exact space-to-depth convolutions, channel padding, measured waste."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paragan_jax import layout as L
from paragan_jax.layout_bench import main as layout_main, train_step_waste


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


@pytest.mark.parametrize(
    "size,k,stride,padding",
    [
        (8, 3, 1, "SAME"),  # BigGAN discriminator's first conv
        (8, 3, 2, "SAME"),  # DCGAN discriminator's first conv
        (8, 4, 2, ((1, 1), (1, 1))),
        (12, 7, 2, "SAME"),  # ResNet-style stem
        (8, 5, 1, ((2, 1), (0, 3))),
        (8, 3, 1, "VALID"),
    ],
)
def test_s2d_conv_equals_direct_conv(size, k, stride, padding):
    x, w = _rand((2, size, size, 3), 0), _rand((k, k, 3, 5), 1)
    ref = L.conv_nhwc(x, w, stride, padding)
    got = L.conv_s2d(L.space_to_depth(x, 2), w, 2, stride, padding)
    assert got.shape == ref.shape
    np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)


def test_s2d_gradients_reach_the_original_kernel():
    x, w = _rand((2, 8, 8, 3), 2), _rand((3, 3, 3, 4), 3)
    xs = jnp.asarray(L.host_space_to_depth(np.asarray(x), 2))
    g_ref = jax.grad(lambda w: jnp.sum(jnp.tanh(L.conv_nhwc(x, w))))(w)
    plan = L.choose_layout("tpu")
    g_s2d = jax.grad(lambda w: jnp.sum(jnp.tanh(L.stem_conv(xs, w, plan, input_is_s2d=True))))(w)
    np.testing.assert_allclose(g_s2d, g_ref, atol=1e-5, rtol=1e-5)


def test_space_to_depth_roundtrip_and_host_version():
    x = _rand((2, 6, 4, 3), 4)
    xs = L.space_to_depth(x, 2)
    assert xs.shape == (2, 3, 2, 12)
    np.testing.assert_array_equal(L.depth_to_space(xs, 2), x)
    np.testing.assert_array_equal(L.host_space_to_depth(np.asarray(x), 2), xs)
    with pytest.raises(ValueError, match="not divisible"):
        L.space_to_depth(x, 4)


def test_channel_padding_keeps_the_function():
    x = _rand((2, 8, 8, 3), 5)
    w1, b1, w2 = _rand((3, 3, 3, 6), 6), _rand((6,), 7), _rand((3, 3, 6, 5), 8)
    ref = L.conv_nhwc(jax.nn.relu(L.conv_nhwc(x, w1) + b1), w2)
    p1, pb1 = L.pad_conv_channels(w1, b1, 3, 8)
    p2, _ = L.pad_conv_channels(w2, None, 8, 8)
    got = L.conv_nhwc(jax.nn.relu(L.conv_nhwc(x, p1) + pb1), p2)
    assert got.shape[-1] == 8
    np.testing.assert_allclose(got[..., :5], ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got[..., 5:], 0.0)
    with pytest.raises(ValueError, match="smaller"):
        L.pad_conv_channels(w1, b1, 2, 8)


def test_layout_choice_per_backend():
    tpu, gpu, cpu = L.choose_layout("tpu-v3"), L.choose_layout("h100"), L.choose_layout("cpu")
    assert (tpu.data_format, tpu.channel_multiple, tpu.space_to_depth) == ("NHWC", 128, 2)
    assert (gpu.channel_multiple, gpu.space_to_depth) == (8, 2)
    assert cpu.space_to_depth == 1
    assert L.tile_friendly_width(96, tpu) == 128 and L.tile_friendly_width(96, gpu) == 96
    with pytest.raises(ValueError, match="unknown hardware"):
        L.choose_layout("abacus")


def test_tile_model_prices_minor_dims():
    tpu = L.TILES["tpu"]
    assert tpu.padded_elements([3, 32, 32, 8], 4) == 128 * 32 * 32 * 8
    assert tpu.padded_elements([128, 5], 4) == 128 * 8
    assert tpu.padded_elements([128, 5], 2) == 128 * 16  # bf16 packs 16 sublanes


def test_hlo_shapes_are_read_with_layouts():
    text = jax.jit(lambda a: (a * 2, a.T)).lower(jnp.zeros((4, 3))).compile().as_text()
    shapes = L.hlo_array_shapes(text)
    assert ("f32", (4, 3), (1, 0)) in shapes
    assert any(dims == (3, 4) for _, dims, _ in shapes)


def test_space_to_depth_lowers_padding_waste_on_the_tpu_tile_model():
    x = jax.ShapeDtypeStruct((8, 32, 32, 3), jnp.float32)
    xs = jax.ShapeDtypeStruct((8, 16, 16, 12), jnp.float32)
    w = jax.ShapeDtypeStruct((3, 3, 3, 128), jnp.float32)
    x_nchw = jax.ShapeDtypeStruct((8, 3, 32, 32), jnp.float32)
    w_oihw = jax.ShapeDtypeStruct((128, 3, 3, 3), jnp.float32)
    nchw = L.padding_waste(
        lambda x, w: jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        ),
        x_nchw,
        w_oihw,
    )
    nhwc = L.padding_waste(L.conv_nhwc, x, w)
    s2d = L.padding_waste(lambda xs, w: L.conv_s2d(xs, w, 2), xs, w)
    assert s2d["waste"] < nhwc["waste"] <= nchw["waste"]
    # A stride-2 stem (DCGAN) needs no depth-to-space copy: fewer tiled bytes outright.
    nhwc2 = L.padding_waste(lambda x, w: L.conv_nhwc(x, w, 2), x, w)
    s2d2 = L.padding_waste(lambda xs, w: L.conv_s2d(xs, w, 2, 2), xs, w)
    assert s2d2["waste"] < nhwc2["waste"] and s2d2["tiled_bytes"] < nhwc2["tiled_bytes"]
    cpu = L.padding_waste(L.conv_nhwc, x, w, tile="cpu")
    assert cpu["waste"] == 0.0


def test_layout_benchmark_command(tmp_path):
    import json

    out = tmp_path / "layout.json"
    assert layout_main(["layout", "--batch", "4", "--reps", "1", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 12
    for case in {r["case"] for r in rows}:
        f32 = {r["layout"]: r for r in rows if r["case"] == case and r["dtype"] == "float32"}
        assert f32["NHWC+s2d"]["tpu_waste"] < f32["NHWC"]["tpu_waste"]
        assert f32["NHWC+s2d"]["grad_max_rel_err"] < 1e-4


def test_train_step_waste_counts_the_thin_image_arrays():
    over = ["model.z_dim=8", "data.batch_size=8"]
    res = train_step_waste("tiny", over)  # 8x8 RGB DCGAN: real/fake images and their gradients
    assert res["arrays"] > 50 and res["thin_arrays"] >= 3
    assert 0 < res["thin_share"] < 1 and 0 < res["waste"] < 1
    # (N, 8, 8, 3) -> (N, 4, 4, 12): 128 lanes either way, 32 sublane-padded rows instead of 64.
    assert 0 < res["s2d_bound_saving"] < res["thin_share"]
    assert res["s2d_bound_mib"] < res["tiled_mib"]
