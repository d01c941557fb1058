"""Tokenizers: a model directory's configs, chat templates, incremental detokenization.

Uses the Hugging Face tokenizers of fixtures/hf/ (byte-level BPE for llama3 and qwen2, a
Metaspace BPE for llama2) and the byte tokenizer. No jax here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from serve_jax.chat_template import ChatTemplate
from serve_jax.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TEXT = "héllo 中文 🙂 wörld, ça va?"


@pytest.mark.parametrize("name", ["llama2", "llama3", "qwen2"])
def test_incremental_decoding_equals_full_decoding_across_multibyte_characters(name):
    tok = HFTokenizer.from_dir(FIXTURES / name)
    prompt = tok.encode("Hello world")
    ids = tok.encode(TEXT, add_special_tokens=False)
    dec = tok.decoder(prompt)
    chunks = [dec.step(i) for i in ids]
    whole = tok.decode(prompt + ids)[len(tok.decode(prompt)) :]
    assert "".join(chunks) + dec.flush() == whole
    assert not any("\ufffd" in c for c in chunks)  # a character appears once it is complete
    if name != "llama2":  # byte-level: some characters span several tokens
        assert chunks.count("") > 0


def test_a_character_cut_by_the_end_is_flushed_as_transformers_decodes_it():
    tok = HFTokenizer.from_dir(FIXTURES / "qwen2")
    ids = tok.encode("ok 🙂", add_special_tokens=False)[:-1]  # the emoji's last byte is missing
    dec = tok.decoder([])
    text = "".join(dec.step(i) for i in ids)
    assert text == "ok "
    assert text + dec.flush() == tok.decode(ids) and tok.decode(ids).endswith("\ufffd")
    byte = ByteTokenizer()
    bdec = byte.decoder([])
    assert [
        bdec.step(i)
        for i in byte.encode(
            "é",
        )[1:]
    ] == ["", "é"]
    bdec.step(byte.encode("中")[1])
    assert bdec.flush() == "\ufffd"


def test_directory_configs_bos_eos_and_templates():
    llama2 = HFTokenizer.from_dir(FIXTURES / "llama2")
    assert llama2.add_bos is True and llama2.encode("hi")[0] == llama2.bos_id
    assert llama2.encode("hi", add_special_tokens=False)[0] != llama2.bos_id
    llama3 = HFTokenizer.from_dir(FIXTURES / "llama3")
    assert llama3.add_bos is None and llama3.encode("hi")[0] == llama3.bos_id  # post-processor
    gen = json.loads((FIXTURES / "llama3" / "generation_config.json").read_text())
    assert llama3.eos_ids == frozenset(gen["eos_token_id"]) | {llama3.eos_id}
    qwen2 = HFTokenizer.from_dir(FIXTURES / "qwen2")
    assert qwen2.bos_id is None and qwen2.eos_ids == {qwen2.eos_id}
    assert isinstance(load_tokenizer(str(FIXTURES / "qwen2")), HFTokenizer)
    bare = load_tokenizer(str(FIXTURES / "qwen2" / "tokenizer.json"))  # a file: no configs
    assert bare.eos_ids == frozenset() and bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.chat_ids([{"role": "user", "content": "hi"}])


def test_templates_and_eos_from_the_other_config_files(tmp_path):
    d = tmp_path / "tok"
    shutil.copytree(FIXTURES / "qwen2", d)
    source = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    (d / "generation_config.json").unlink()  # then config.json's eos_token_id
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [
        {"name": "tool_use", "template": "x"},
        {"name": "default", "template": source},
    ]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = HFTokenizer.from_dir(d)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.render_chat(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_ids == {json.loads((d / "config.json").read_text())["eos_token_id"]}
    cfg["eos_token"] = "<|not-a-token|>"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="eos_token '<|not-a-token|>' is not in the vocabulary"):
        HFTokenizer.from_dir(d)
    (d / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        HFTokenizer.from_dir(d)


def test_chat_templates_render_as_transformers_does():
    llama2 = HFTokenizer.from_dir(FIXTURES / "llama2")
    with pytest.raises(ValueError, match="roles must alternate"):
        llama2.chat_ids([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    t = ChatTemplate(
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m | tojson }}{% endgeneration %}{% endfor %}"
        "{{ bos_token }}{{ tools is none }}",
        {"bos_token": "<s>"},
    )
    out = t.render([{"role": "user", "content": "中"}, {"role": "x", "content": "y"}])
    assert out == '{"role": "user", "content": "中"}<s>True'
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ValueError, match="chat template"):  # the sandbox refuses attribute games
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_byte_tokenizer_keeps_its_chat_format():
    tok = ByteTokenizer()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert tok.chat_ids(msgs) == tok.encode("<|system|>\ns\n<|user|>\nhi\n<|assistant|>\n")
