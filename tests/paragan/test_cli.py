"""The command line: train -> eval -> sample on a tiny preset, and bad input before training."""

import json

import numpy as np
import pytest
from conftest import RING
from PIL import Image

from paragan_jax import cli


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

    rc = cli.main(["eval", "--workdir", str(work), "--json", str(tmp_path / "m.json")])
    assert rc == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    for key in ("step", "fd", "kid", "classifier_score", "modes_covered", "high_quality_fraction"):
        assert key in metrics
    assert metrics["step"] == 3 and 0 <= metrics["modes_covered"] <= 8

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
    rc = cli.main(
        ["train", "--config", "tiny", "--workdir", str(tmp_path / "w"), "--no-progress", *args]
    )
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert not (tmp_path / "w" / "checkpoints").exists()


def test_unknown_key_in_yaml_names_key_and_file(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("steps: 3\nmodel:\n  depth: 4\n")
    rc = cli.main(["train", "--config", str(cfg), "--workdir", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert rc == 2 and "depth" in err and "bad.yaml" in err


def test_mixed_image_sizes_are_rejected(tmp_path, capsys):
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(folder / "a.png")
    Image.fromarray(np.zeros((9, 9), np.uint8)).save(folder / "b.png")
    rc = cli.main(
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
    assert rc == 2 and "mixed sizes" in capsys.readouterr().err
