"""The HTTP server on a Hugging Face checkpoint: chat prompts from the model's own template.

``/v1/chat/completions`` renders the messages with the checkpoint's chat template (as
transformers' ``apply_chat_template`` does) and answers transformers' greedy continuation; a
conversation the template rejects (its ``raise_exception``) is a 400 naming ``messages``.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from serve_jax.config import load_engine_config
from serve_jax.engine import Engine

FIXTURES = Path(__file__).parent / "fixtures" / "hf"


@pytest.fixture(scope="module", params=["llama3", "llama2"])
def server(request, running_server):
    d = FIXTURES / request.param
    cfg = load_engine_config("tiny_cpu", [f"model.path={d}", f"model.name={request.param}"])
    engine = Engine(cfg)
    with running_server(engine, cfg) as url:
        yield url, request.param, engine


def test_chat_uses_the_models_template(server):
    url, name, engine = server
    chat = json.loads((FIXTURES / name / "reference.json").read_text())["chat"]
    body = {"model": name, "messages": chat["messages"], "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["choices"][0]["message"]["content"] == chat["text"]
    assert out["usage"]["prompt_tokens"] == len(chat["prompt_ids"])
    assert out["usage"]["completion_tokens"] == len(chat["greedy_ids"])


def test_a_conversation_the_template_rejects_is_a_400(server):
    """Llama 2's template requires alternating roles; Llama 3's takes two user turns."""
    url, name, engine = server
    msgs = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    body = {"messages": msgs, "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    if name == "llama3":
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages" and "roles must alternate" in err["message"]
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def test_n2_greedy_chat_with_logprobs_gives_the_reference_twice(server):
    url, name, engine = server
    chat = json.loads((FIXTURES / name / "reference.json").read_text())["chat"]
    parts = [[{"type": "text", "text": m["content"]}] for m in chat["messages"]]
    messages = [{"role": m["role"], "content": p} for m, p in zip(chat["messages"], parts)]
    body = {
        "model": name,
        "messages": messages,
        "max_tokens": 8,
        "temperature": 0,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
    }
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["message"]["content"] for c in out["choices"]] == [chat["text"]] * 2
    for c in out["choices"]:
        content = c["logprobs"]["content"]
        assert len(content) == len(c["token_ids"]) == len(chat["greedy_ids"])
        assert all(e["logprob"] == e["top_logprobs"][0]["logprob"] for e in content)
    assert out["usage"]["completion_tokens"] == 2 * len(chat["greedy_ids"])
