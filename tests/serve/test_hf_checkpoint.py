"""Hugging Face checkpoints against transformers: logits, greedy tokens and text, chat prompts.

The fixtures under fixtures/hf/ are tiny random checkpoints written by transformers'
``save_pretrained`` (scripts/make_hf_fixtures.py, run in a separate environment with torch),
with transformers' own float32 logits and greedy outputs. Each is served here through the code
path of ``serve --model DIR`` (an engine config with ``model.path``), and must agree: logits
within 1e-4, identical prompt ids, greedy ids, text and finish reasons, for completions and a
chat rendered from the model's chat template. Then the loader's errors, one by one.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from serve_jax.__main__ import main as serve_jax_main
from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.hf_checkpoint import SafetensorsFile, load_hf_model
from serve_jax.hf_config import hf_model_config, resolve_model_dir
from serve_jax.kv_cache import DenseKVView
from serve_jax.sampling import SamplingParams
from serve_jax.tokenizer import HFTokenizer

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
NAMES = ["llama2", "llama3", "mistral", "qwen2"]
GREEDY = SamplingParams(max_tokens=8)


def reference(name: str) -> tuple[dict, np.ndarray]:
    ref = json.loads((FIXTURES / name / "reference.json").read_text())
    return ref, np.load(FIXTURES / name / "logits.npy")


@pytest.fixture(scope="module", params=NAMES)
def served(request):
    """(name, engine) for each fixture, built as ``serve --model DIR`` builds it."""
    d = FIXTURES / request.param
    cfg = load_engine_config("tiny_cpu", [f"model.path={d}", f"model.name={d}"])
    return request.param, Engine(cfg)


def last_logits(model, ids: list[int], rows: int) -> np.ndarray:
    """The model's float32 logits at the last ``rows`` positions of ``ids`` (dense reference)."""
    n = len(ids)
    k, v = DenseKVView.zeros(model.cfg, 1, n)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    view = DenseKVView(k, v, pos, jnp.ones((1, n), bool))
    return np.asarray(model(jnp.asarray([ids], jnp.int32), pos, view))[0, -rows:]


def run(engine: Engine, prompt) -> tuple[list[int], str, str, str]:
    """Greedy generation: (output ids, final text, streamed text, finish reason)."""
    rid = engine.add_request(prompt, GREEDY)
    streamed, final = [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid:
                streamed.append(out.new_text)
                final = out if out.finished else final
    return list(final.token_ids), final.text, "".join(streamed), final.finish_reason


def test_completions_match_transformers(served):
    name, engine = served
    ref, logits = reference(name)
    rows = ref["logit_rows"]
    for i, case in enumerate(ref["prompts"]):
        assert engine.tokenizer.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]
        got = last_logits(engine.model, case["prompt_ids"], rows)
        np.testing.assert_allclose(got, logits[i], atol=1e-4, rtol=0)
        ids, text, streamed, reason = run(engine, case["prompt"])
        assert ids == case["greedy_ids"], case["prompt"]
        assert text == case["text"] and streamed == case["text"], case["prompt"]
        assert reason == ("stop" if case["stopped"] else "length")


def test_chat_matches_transformers(served):
    name, engine = served
    ref, logits = reference(name)
    chat = ref["chat"]
    tok = engine.tokenizer
    assert tok.render_chat(chat["messages"]) == chat["rendered"]
    ids = tok.chat_ids(chat["messages"])
    assert ids == chat["prompt_ids"]
    got = last_logits(engine.model, ids, ref["logit_rows"])
    np.testing.assert_allclose(got, logits[len(ref["prompts"])], atol=1e-4, rtol=0)
    out_ids, text, streamed, _ = run(engine, ids)
    assert out_ids == chat["greedy_ids"]
    assert text == chat["text"] == streamed


def test_generation_stops_at_any_eos_id_unless_ignore_eos():
    """llama3's generation_config.json lists two EOS ids; greedy decoding reaches the second."""
    ref, _ = reference("llama3")
    case = ref["prompts"][0]
    assert case["stopped"]
    tok = HFTokenizer.from_dir(FIXTURES / "llama3")
    assert case["greedy_ids"][-1] in tok.eos_ids and len(tok.eos_ids) == 2
    cfg = load_engine_config("tiny_cpu", [f"model.path={FIXTURES / 'llama3'}"])
    engine = Engine(cfg)
    n = len(case["greedy_ids"])
    out = engine.generate([case["prompt"]], SamplingParams(max_tokens=n + 3, ignore_eos=True))[0]
    assert list(out.token_ids[:n]) == case["greedy_ids"] and len(out.token_ids) == n + 3
    assert out.finish_reason == "length"


def test_rope_scaling_and_tied_embeddings_are_what_make_llama3_match():
    """The parity above fails without the llama3 frequency scaling (the test can fail)."""
    ref, logits = reference("llama3")
    cfg = hf_model_config(FIXTURES / "llama3")
    assert cfg.rope_scaling is not None and cfg.tie_embeddings
    plain = load_hf_model(FIXTURES / "llama3", dataclasses.replace(cfg, rope_scaling=None))
    case = ref["prompts"][1]
    got = last_logits(plain, case["prompt_ids"], ref["logit_rows"])
    assert np.abs(got - logits[1]).max() > 1e-2


def test_config_fields_map_to_the_model_config():
    llama3 = hf_model_config(FIXTURES / "llama3")  # classic layout: rope_theta + rope_scaling
    assert (llama3.rope_theta, llama3.rope_scaling.factor) == (10000.0, 8.0)
    assert llama3.rope_scaling.original_max_position_embeddings == 64
    mistral = hf_model_config(FIXTURES / "mistral")
    assert (mistral.head_dim, mistral.d_model, mistral.n_heads) == (16, 32, 4)
    assert mistral.max_seq_len == 128  # the sliding window: attention over it is exact
    qwen2 = hf_model_config(FIXTURES / "qwen2", dtype="bfloat16", max_seq_len=64)
    assert qwen2.qkv_bias and not qwen2.tie_embeddings and qwen2.max_seq_len == 64
    assert qwen2.n_kv_heads == 2 and qwen2.dtype == "bfloat16"
    with pytest.raises(ValueError, match="max_seq_len 1000 exceeds"):
        hf_model_config(FIXTURES / "qwen2", max_seq_len=1000)


def test_bfloat16_serving_casts_once():
    cfg = hf_model_config(FIXTURES / "qwen2", dtype="bfloat16")
    model = load_hf_model(FIXTURES / "qwen2", cfg)
    assert model.blocks[0].attn.q_proj.kernel[...].dtype == jnp.bfloat16
    assert model.blocks[0].attn.q_proj.bias[...].dtype == jnp.bfloat16


def test_weights_land_in_the_tensor_parallel_plan():
    """With a model axis each weight is put straight into the executor's plan's sharding."""
    d = FIXTURES / "qwen2"
    over = [f"model.path={d}", "executor.mesh=data=1,model=2"]
    over.append("executor.plan_memory_limit_bytes=700000")  # too tight to replicate the weights
    engine = Engine(load_engine_config("tiny_cpu", over))
    plan = engine.executor.plan
    assert any("model" in (s or []) for s in plan.param_paths.values())
    loaded = jax.tree.leaves(nnx.state(engine.model))
    wanted = jax.tree.leaves(plan.in_shardings_on(engine.executor.mesh)[0])
    assert len(loaded) == len(wanted)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(loaded, wanted))
    ref, _ = reference("qwen2")
    case = ref["prompts"][0]
    out = engine.generate([case["prompt"]], GREEDY)[0]
    assert list(out.token_ids) == case["greedy_ids"]


def test_hf_cache_layout_is_found_without_download(tmp_path, monkeypatch):
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in (FIXTURES / "llama3").iterdir():
        (snap / f.name).symlink_to(f)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_model_dir("org/tiny") == snap
    assert resolve_model_dir(repo) == snap
    assert hf_model_config("org/tiny") == hf_model_config(FIXTURES / "llama3")
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        resolve_model_dir("org/absent")


# ---- errors ---------------------------------------------------------------------------------


@pytest.fixture
def copy_of(tmp_path):
    def make(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(FIXTURES / name, d)
        return d

    return make


def edit_config(d: Path, **fields) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    (d / "config.json").write_text(json.dumps(cfg))


def load(d: Path):
    return load_hf_model(d, hf_model_config(d))


def test_a_directory_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        hf_model_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf_model_config(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures \\['GPT2LMHeadModel'\\] not"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias true is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor'"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer"),
        ({"num_key_value_heads": 3}, "multiple of n_kv_heads"),
    ],
)
def test_unsupported_config_fields_are_named(copy_of, fields, message):
    d = copy_of("llama3")
    edit_config(d, **fields)
    with pytest.raises(ValueError, match=message) as e:
        hf_model_config(d)
    assert "config.json" in str(e.value) and "\n" not in str(e.value)


def test_a_missing_shard_is_named(copy_of):
    d = copy_of("qwen2")
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load(d)


def test_a_tensor_of_the_wrong_shape_is_named(copy_of):
    d = copy_of("llama2")
    edit_config(d, intermediate_size=48)
    with pytest.raises(ValueError, match="mlp.*_proj.weight' has shape .* config.json implies"):
        load(d)


def test_a_missing_tensor_is_named(copy_of):
    d = copy_of("llama3")
    edit_config(d, tie_word_embeddings=False)  # now an lm_head.weight is expected
    with pytest.raises(ValueError, match="'lm_head.weight' is missing"):
        load(d)


def test_an_unexpected_tensor_is_named(copy_of):
    d = copy_of("llama2")
    edit_config(d, num_hidden_layers=1)
    with pytest.raises(ValueError, match="unexpected tensor 'model.layers.1."):
        load(d)


def test_a_shard_that_is_not_safetensors(copy_of):
    d = copy_of("llama3")
    (d / "model.safetensors").write_bytes(b"secret text, not a checkpoint" * 10)
    with pytest.raises(ValueError, match="is not a safetensors file") as e:
        load(d)
    assert "secret" not in str(e.value)


@pytest.mark.parametrize(
    "header",
    [
        {"w": {"dtype": "F32", "shape": [2]}},
        {"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}},
        {"w": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}},
        [1, 2],
    ],
)
def test_a_malformed_safetensors_header(tmp_path, header):
    raw = json.dumps(header).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8))
    with pytest.raises(ValueError, match="is not a safetensors file"):
        SafetensorsFile(path)


def test_tensor_dtypes_and_offsets_are_checked(tmp_path):
    header = {
        "q": {"dtype": "I8", "shape": [2], "data_offsets": [0, 2]},
        "w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},
    }
    raw = json.dumps(header).encode()
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(8))
    with SafetensorsFile(path) as f:
        with pytest.raises(ValueError, match="tensor 'q' has dtype 'I8'"):
            f.read("q")
        with pytest.raises(ValueError, match="tensor 'w' has offsets that do not fit"):
            f.read("w")


def test_no_weights_at_all(copy_of):
    d = copy_of("llama3")
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        load(d)


def test_serve_and_replay_model_flag_errors_are_one_line(copy_of, capsys, monkeypatch):
    monkeypatch.setenv("SERVE_JAX_CACHE_DIR", "")
    d = copy_of("llama3")
    edit_config(d, architectures=["GPT2LMHeadModel"])
    for model, message in [(d, "GPT2LMHeadModel"), (d / "absent", "does not exist")]:
        for command in ("replay", "serve"):
            assert serve_jax_main([command, "--config", "tiny_cpu", "--model", str(model)]) == 2
            err = capsys.readouterr().err
            assert message in err and "Traceback" not in err
            assert len(err.strip().splitlines()) == 1
