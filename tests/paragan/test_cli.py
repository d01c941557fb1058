"""The command line: train -> eval -> sample on a tiny preset, the --config/key=value convention,
and bad input as one line with exit status 2 (through the dispatcher) before training."""

import json

import numpy as np
import pytest
from conftest import RING
from PIL import Image

from paragan_jax import cli
from paragan_jax.__main__ import main


def _one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"python -m paragan_jax {command}: error: "), err
    return err


def test_train_eval_sample(tmp_path, capsys):
    work = tmp_path / "run"
    rc = cli.main(
        [
            "train",
            "--config",
            "tiny",
            "--steps",
            "3",
            "--workdir",
            str(work),
            "--no-progress",
            *RING,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "sample grid:" in out and (work / "samples_step3.png").is_file()
    assert (work / "tb").is_dir() and any((work / "tb").iterdir())

    rc = cli.main(
        ["eval", "--workdir", str(work), "--json", str(tmp_path / "m.json"), "eval.num_samples=64"]
    )
    assert rc == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    for key in ("step", "fd", "kid", "classifier_score", "modes_covered", "high_quality_fraction"):
        assert key in metrics
    assert metrics["step"] == 3 and 0 <= metrics["modes_covered"] <= 8
    digest = metrics["params_sha256"]
    assert len(digest) == 64 and int(digest, 16) >= 0

    rc = cli.main(["sample", "--workdir", str(work), "--out", str(tmp_path / "g.png")])
    assert rc == 0 and Image.open(tmp_path / "g.png").size[0] > 100


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.widht=3"], "widht"),
        (["data.batch_size=12", "sharding.num_devices=8"], "does not divide"),
        (["data.source=folder", "data.path=/nonexistent/dir"], "not a readable directory"),
        (["model.resolution=12"], "power of two"),
    ],
)
def test_bad_input_is_a_clear_error_before_training(tmp_path, capsys, args, message):
    rc = main(
        ["train", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--no-progress", *args]
    )
    assert rc == 2
    assert message in _one_line_error(capsys, "train")
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_unknown_key_in_yaml_names_key_and_file(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("steps: 3\nmodel:\n  depth: 4\n")
    rc = main(["train", "--config", str(cfg), "--workdir", str(tmp_path / "w")])
    err = _one_line_error(capsys, "train")
    assert rc == 2 and "depth" in err and "bad.yaml" in err


@pytest.mark.parametrize("command", ["train", "bench"])
def test_unwritable_workdir_is_one_line_naming_it(tmp_path, capsys, command):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    workdir = blocker / "run"  # a directory cannot be made under a file
    rc = main([command, "--config", "tiny", "--workdir", str(workdir), *RING])
    err = _one_line_error(capsys, command)
    assert rc == 2 and f"workdir {str(workdir)!r}" in err and "not a writable directory" in err


def test_eval_of_a_directory_that_is_no_run(tmp_path, capsys):
    rc = main(["eval", "--workdir", str(tmp_path)])
    assert rc == 2 and "config.yaml not found" in _one_line_error(capsys, "eval")


@pytest.mark.parametrize("command", ["train", "eval", "sample", "bench"])
def test_help_lists_config_and_overrides(capsys, command):
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0
    assert "--config PRESET" in out and "digits_cpu" in out  # the presets are listed
    for key in ("model.z_dim", "data.batch_size", "async_.staleness", "eval.num_samples"):
        assert key in out


def test_unlisted_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--time-budget", "3"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --time-budget" in capsys.readouterr().err


def test_mixed_image_sizes_are_rejected(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "a.png")
    Image.fromarray(np.zeros((9, 9), np.uint8)).save(folder / "b.png")
    rc = main(
        [
            "train",
            "--config",
            "tiny",
            "--workdir",
            str(tmp_path / "w"),
            "data.source=folder",
            f"data.path={folder}",
        ]
    )
    assert rc == 2 and "mixed sizes" in _one_line_error(capsys, "train")
