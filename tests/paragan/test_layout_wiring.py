"""``train --adaptive-pipeline`` on the command line, and the layout option that was removed.

``model.layout`` (a space-to-depth stem in D) is gone: over the whole training step it did not
lower the TPU tile model's padding (BENCHMARKS.md, layout); `paragan_jax.layout` keeps the
functions and the ``layout`` benchmark.
"""

import pytest

from paragan_jax import cli
from paragan_jax.__main__ import main as paragan_main
from paragan_jax.config import ModelConfig, load_train_config
from tapas_jax.config import ConfigError


def test_the_removed_layout_key_is_an_unknown_key():
    assert "layout" not in ModelConfig.__dataclass_fields__
    with pytest.raises(ConfigError, match=r"model\.layout"):
        load_train_config("tiny", ["model.layout=tpu"])


def test_train_rgb_with_adaptive_pipeline_and_emulated_store(tmp_path, capsys):
    """Training steps on RGB images through the CLI's adaptive pipeline (whose batches equal the
    default loader's: see test_pipeline), set by the config's ``pipeline`` section."""
    work = tmp_path / "run"
    argv = ["train", "--config", "tiny", "--steps", "3", "--workdir", str(work), "--no-progress"]
    pipe = ["--adaptive-pipeline", "--emulate-remote", "--remote-seed", "1"]
    over = ["model.channels=3", "pipeline.memory_cap_bytes=4194304"]
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
