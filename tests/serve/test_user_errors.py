"""User errors of serve_jax raise one clear exception naming the problem, never file contents."""

from __future__ import annotations

import pytest

from serve_jax.__main__ import main as serve_jax_main
from serve_jax.model import init_model, load_safetensors
from serve_jax.model_config import get_model_config
from serve_jax.tokenizer import load_tokenizer

SECRET = "root:x:0:0:secret-line-of-the-file"


@pytest.fixture
def not_a_checkpoint(tmp_path):
    path = tmp_path / "passwd"
    path.write_text(SECRET + "\n" + "daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\n" * 50)
    return path


def test_a_checkpoint_that_is_not_one_names_the_file_not_its_contents(not_a_checkpoint):
    model = init_model(get_model_config("tiny"))
    with pytest.raises(ValueError, match="is not a safetensors checkpoint") as e:
        load_safetensors(model, str(not_a_checkpoint))
    assert "secret" not in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_safetensors(model, str(not_a_checkpoint.parent / "missing.safetensors"))
    with pytest.raises(FileNotFoundError, match="not a file"):
        load_safetensors(model, str(not_a_checkpoint.parent))


def test_a_tokenizer_that_is_not_one_names_the_file_not_its_contents(not_a_checkpoint, tmp_path):
    with pytest.raises(ValueError, match="is not a tokenizer.json") as e:
        load_tokenizer(str(not_a_checkpoint))
    assert "secret" not in str(e.value)
    json_not_tokenizer = tmp_path / "tokenizer.json"
    json_not_tokenizer.write_text('{"secret": "' + SECRET + '"}')
    with pytest.raises(ValueError, match="is not a tokenizer.json") as e:
        load_tokenizer(str(json_not_tokenizer))
    assert "secret" not in str(e.value)
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "missing.json"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["model.checkpoint={bad}"], "is not a safetensors checkpoint"),
        (["model.tokenizer={bad}"], "is not a tokenizer.json file"),
        (["model.checkpoint={missing}"], "does not exist"),
        (["--workload", "{missing}"], "does not exist"),
        (["--workload", "{bad}"], "missing column"),
        (["--workload", "nope"], "unknown workload 'nope'"),
        (["--workload", "conv", "--burstiness", "0.5"], "give a rate"),
        (["model.preset=gpt-9"], "unknown model preset 'gpt-9'"),
    ],
)
def test_replay_user_errors_are_one_line_and_exit_2(
    args, message, not_a_checkpoint, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("SERVE_JAX_CACHE_DIR", "")
    fill = {"bad": str(not_a_checkpoint), "missing": str(tmp_path / "missing.csv")}
    argv = ["replay", "--config", "tiny_cpu", "--num-requests", "2", *args]
    assert serve_jax_main([a.format(**fill) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "secret" not in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_simulate_user_errors_are_one_line_and_exit_2(capsys, not_a_checkpoint):
    for argv, message in [
        (["--policies", ""], "--policies is empty"),
        (["--policies", "lifo"], "unknown policy 'lifo'"),
        (["kv_memory_gb=oops"], "kv_memory_gb"),
        (["engine.cache.block_size=4"], "key 'engine': not a field of SimConfig"),
        (["--config", str(not_a_checkpoint)], "no preset"),
        (["--model", "gpt-9"], "unknown model preset 'gpt-9'"),
    ]:
        rc = serve_jax_main(["simulate", "--duration-s", "60", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (argv, err)
        assert "secret" not in err and len(err.strip().splitlines()) == 1
