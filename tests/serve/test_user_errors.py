"""User errors of serve_jax raise one clear exception naming the problem, never file contents."""

from __future__ import annotations

import pytest

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
