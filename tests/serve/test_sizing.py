"""KV pages sized from device memory (cache.kv_cache_memory_fraction, serve_jax.sizing), the
refusal of a KV cache that cannot hold one request of the model's maximum length, and the bf16
one-chip presets."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from serve_jax.__main__ import main as serve_jax_main
from serve_jax.config import load_engine_config
from serve_jax.engine import Engine
from serve_jax.model_config import get_model_config
from serve_jax.sizing import activation_bytes, device_memory_bytes, size_kv_cache

MIB = 2**20


def test_engine_pages_follow_the_formula():
    cfg = load_engine_config(
        "tiny_cpu", ["cache.kv_cache_memory_fraction=0.5", f"cache.device_memory_bytes={8 * MIB}"]
    )
    engine = Engine(cfg)
    mc, cc, sc = engine.model_config, cfg.cache, cfg.scheduler
    weights = sum(x.nbytes for x in jax.tree.leaves(nnx.state(engine.model)))
    acts = activation_bytes(mc, sc.max_num_batched_tokens, sc.max_num_seqs)
    page = cc.block_size * mc.kv_bytes_per_token()
    want = (4 * MIB - weights - acts) // page
    s = engine.kv_sizing
    assert (s.weight_bytes, s.activation_bytes, s.page_bytes) == (weights, acts, page)
    assert s.num_pages == want > cfg.cache.num_device_blocks  # not the preset's 64
    assert s.memory_source == "configured"
    assert engine.config.cache.num_device_blocks == want
    assert engine.scheduler.blocks.device.num_blocks == want
    assert engine.executor.k_pool[0].shape[0] == want  # the pool the executor allocated
    out = engine.generate([[5, 6, 7]], None)
    assert len(out[0].token_ids) == 16  # the engine serves with the sized pool
    # Twice the memory: the extra half is all KV.
    cfg2 = load_engine_config(
        "tiny_cpu", ["cache.kv_cache_memory_fraction=0.5", f"cache.device_memory_bytes={16 * MIB}"]
    )
    _, s2 = size_kv_cache(cfg2, mc, engine.model)
    assert s2.num_pages == (8 * MIB - weights - acts) // page


def test_a_kv_cache_that_cannot_hold_one_request_is_refused_with_the_numbers():
    mc = get_model_config("tiny", max_seq_len=128)
    cfg = load_engine_config(
        "tiny_cpu",
        ["cache.kv_cache_memory_fraction=0.1", f"cache.device_memory_bytes={int(1.5 * MIB)}"],
    )
    with pytest.raises(ValueError) as e:
        size_kv_cache(cfg, mc)
    msg = str(e.value)
    for part in ("max_model_len 128", "of 0.00 GiB (configured)", "weights", "activations",
                 "pages of 4 tokens", "it needs 32 pages"):  # fmt: skip
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        size_kv_cache(load_engine_config("tiny_cpu", ["cache.kv_cache_memory_fraction=1.5"]), mc)
    # Without a fraction nothing changes.
    plain = load_engine_config("tiny_cpu")
    assert size_kv_cache(plain, mc) == (plain, None)


def test_cpu_budget_is_host_memory_and_the_flag_reaches_the_config(capsys):
    total, source = device_memory_bytes(jax.devices()[0])
    assert source in ("host MemAvailable", "host physical memory") and total > 64 * MIB
    assert device_memory_bytes(jax.devices()[0], 123) == (123, "configured")
    argv = ["replay", "--config", "tiny_cpu", "--kv-cache-memory-fraction", "0.01"]
    argv += ["cache.device_memory_bytes=100000", "--num-requests", "1"]
    assert serve_jax_main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot hold one request of max_model_len 128" in err and "\n" == err[-1]
    assert err.count("\n") == 1  # one line


@pytest.mark.parametrize(
    ("preset", "memory_gib"), [("llama1b_tpu_v5e", 15.75), ("llama1b_h100", 79.1)]
)
def test_one_chip_bf16_presets_fit_their_chip(preset, memory_gib):
    cfg = load_engine_config(preset, [f"cache.device_memory_bytes={int(memory_gib * 2**30)}"])
    assert cfg.model.dtype == "bfloat16" and cfg.cache.kv_cache_memory_fraction == 0.9
    mc = get_model_config(cfg.model.preset, dtype="bfloat16", max_seq_len=cfg.model.max_seq_len)
    assert 1.0e9 < mc.num_params() < 1.5e9  # a 1B-class shape
    _, s = size_kv_cache(cfg, mc)
    assert s.weight_bytes == mc.num_params() * 2
    # A full batch of requests of half the context each fits in the pages.
    assert s.num_pages * cfg.cache.block_size >= cfg.scheduler.max_num_seqs * mc.max_seq_len // 2
    assert s.kv_bytes + s.weight_bytes + s.activation_bytes <= 0.9 * memory_gib * 2**30
