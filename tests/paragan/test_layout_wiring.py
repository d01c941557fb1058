"""model.layout in the discriminator, and ``train --adaptive-pipeline`` on the command line."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from paragan_jax import cli
from paragan_jax.__main__ import main as paragan_main
from paragan_jax.config import ModelConfig, load_train_config
from paragan_jax.models import build_models, stem_plan
from tapas_jax.config import ConfigError


def _abstract_d(arch: str, layout: str):
    """D's graph and abstract state (no init compiled: the test fills its own weights)."""
    cfg = ModelConfig(
        arch=arch,
        resolution=16,
        channels=3,
        z_dim=8,
        num_classes=10,
        g_width=4,
        d_width=4,
        shared_dim=4,
        layout=layout,
    )
    return nnx.split(nnx.eval_shape(lambda: build_models(cfg, nnx.Rngs(0))[1]))


@pytest.mark.parametrize("arch", ["dcgan", "biggan"])
def test_space_to_depth_stem_keeps_params_outputs_and_gradients(arch):
    (g_plain, a_plain), (g_s2d, a_s2d) = _abstract_d(arch, "none"), _abstract_d(arch, "tpu")
    stem = nnx.merge(g_s2d, a_s2d)
    stem = stem.convs[0] if arch == "dcgan" else stem.blocks[0].conv1
    assert stem.plan is not None and stem.plan.space_to_depth == 2
    # Same state tree and shapes: checkpoints and tapas plans do not see the layout.
    assert jax.tree.structure(a_plain) == jax.tree.structure(a_s2d)
    assert jax.tree.leaves(jax.tree.map(lambda a: a.shape, a_plain)) == jax.tree.leaves(
        jax.tree.map(lambda a: a.shape, a_s2d)
    )
    rng = np.random.default_rng(0)
    state = jax.tree.map(lambda a: jnp.asarray(rng.normal(0, 0.3, a.shape), a.dtype), a_plain)
    x = jnp.asarray(rng.uniform(-1, 1, (4, 16, 16, 3)), jnp.float32)
    y = jnp.arange(4) % 10
    got, want = _forward_backward(g_s2d, state, x, y), _forward_backward(g_plain, state, x, y)
    for name, a, b in zip(("logits", "param grads", "input grads"), got, want):
        check = partial(np.testing.assert_allclose, atol=1e-4, rtol=1e-4, err_msg=f"{arch} {name}")
        jax.tree.map(check, a, b)


def _forward_backward(graphdef, state, x, y):
    """Logits and the grads of a hinge loss wrt params (through spectral norm) and input."""
    params, rest = nnx.split_state(state, nnx.Param, ...)

    def loss(params, x):
        logits = nnx.merge(graphdef, params, rest)(x, y, False)
        return jnp.mean(jax.nn.relu(1.0 - logits)), logits

    (_, logits), (g_params, g_x) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        params, x
    )
    return logits, g_params, g_x


def test_plan_only_for_rgb_and_cpu_keeps_the_plain_conv():
    assert stem_plan(ModelConfig(channels=1, layout="tpu")) is None  # digits: no space-to-depth
    assert stem_plan(ModelConfig(channels=3, layout="none")) is None
    assert stem_plan(ModelConfig(channels=3, layout="gpu")).space_to_depth == 2
    assert stem_plan(ModelConfig(channels=3, layout="cpu")).space_to_depth == 1
    if jax.default_backend() == "cpu":
        assert stem_plan(ModelConfig(channels=3, layout="auto")).backend == "cpu"


def test_bad_layout_names_the_field_and_the_values():
    with pytest.raises(ConfigError, match=r"model\.layout='nchw'.*'auto'.*'none'"):
        load_train_config("tiny", ["model.layout=nchw"])


def test_train_rgb_tpu_layout_with_adaptive_pipeline_and_emulated_store(tmp_path, capsys):
    """One tiny run covers both: training steps with the space-to-depth stem, and the CLI's
    adaptive pipeline (whose batches equal the default loader's: see test_pipeline), set by the
    config's ``pipeline`` section."""
    work = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--steps", "3", "--workdir", str(work), "--no-progress"]
    pipe = ["--adaptive-pipeline", "--emulate-remote", "--remote-seed", "1"]
    over = ["model.channels=3", "model.layout=tpu", "pipeline.memory_cap_bytes=4194304"]
    rc = cli.main([*argv, *pipe, *over])
    out = capsys.readouterr().out
    assert rc == 0, out
    metrics = next(ln for ln in out.splitlines() if ln.startswith("metrics:"))
    assert "nan" not in metrics and "inf" not in metrics, metrics
    assert (work / "samples_step3.png").is_file()
    assert any((work / "checkpoints").iterdir())
    line = next(ln for ln in out.splitlines() if ln.startswith("input pipeline:"))
    assert "workers" in line and "peak buffer" in line and "over 3 batches" in line
    assert "(cap 4 MiB)" in line  # the override reached the pipeline (default: 256 MiB)


def test_emulate_remote_needs_the_pipeline(tmp_path, capsys):
    rc = paragan_main(["train", "--workdir", str(tmp_path / "w"), "--emulate-remote"])
    assert rc == 2 and "--adaptive-pipeline" in capsys.readouterr().err
