"""Roofline cost model of the simulator: shapes, regimes, capacity, host link."""

from __future__ import annotations

import pytest

from serve_jax.costmodel import (
    RooflineCostModel,
    kv_capacity_blocks,
    matmul_params,
    weight_bytes,
)
from serve_jax.model_config import get_model_config
from tapas_jax.hardware import get_profile


def test_llama_7b_shape():
    m = get_model_config("llama-7b")
    assert weight_bytes(m) / 2 == pytest.approx(6.74e9, rel=0.01)
    assert m.num_params() == pytest.approx(6.74e9, rel=0.01)
    assert m.kv_bytes_per_token() == 2 * 32 * 4096 * 2


def test_the_served_model_is_priced_at_its_dtype():
    """The simulator prices an engine's model (any preset, its dtype), not a separate table."""
    tiny = get_model_config("tiny")
    c = RooflineCostModel.create(tiny, "h100")
    assert c.block_bytes == 16 * 2 * 2 * 2 * 16 * 4  # block x K,V x layers x kv heads x dim x f32
    half = RooflineCostModel.create(get_model_config("tiny", dtype="bfloat16"), "h100")
    assert half.block_bytes * 2 == c.block_bytes
    assert half.decode_seconds(4, 400) < c.decode_seconds(4, 400)


def test_decode_is_memory_bound_and_prefill_compute_bound():
    c = RooflineCostModel.create("llama-7b", "h100")
    hw, m = get_profile("h100"), get_model_config("llama-7b")
    t_hbm = (weight_bytes(m) + m.kv_bytes_per_token() * 1) / (hw.hbm_bandwidth * 0.8)
    assert c.decode_seconds(1, 0) == pytest.approx(t_hbm + 1e-3, rel=1e-6)
    n = 4096
    flops = 2 * matmul_params(m) * n + 4 * 32 * 128 * 32 * n * (n + 1) / 2
    assert c.prefill_seconds(n) == pytest.approx(flops / (hw.peak_flops * 0.6) + 1e-3, rel=1e-6)
    # More context makes a decode step slower; a bigger batch costs little when memory-bound.
    assert c.decode_seconds(8, 8 * 4000) > c.decode_seconds(8, 8 * 100)
    assert c.decode_seconds(8, 800) < 1.2 * c.decode_seconds(1, 100)


def test_chips_rank_as_their_bandwidth():
    t = {hw: RooflineCostModel.create("llama-7b", hw).decode_seconds(16, 16000) for hw in
         ("h100", "h200", "tpu-v5e")}  # fmt: skip
    assert t["h200"] < t["h100"] < t["tpu-v5e"]


def test_kv_capacity_and_transfer():
    assert kv_capacity_blocks("llama-7b", "h100", kv_memory_gb=8) == 8e9 // (16 * 524288)
    # From HBM: 90% of 80 GB minus 13.5 GB of weights.
    free = 80e9 * 0.9 - weight_bytes(get_model_config("llama-7b"))
    assert kv_capacity_blocks("llama-7b", "h100") == int(free // (16 * 524288))
    c = RooflineCostModel.create("llama-7b", "h100")
    assert c.transfer_seconds(100) == pytest.approx(2e-5 + 100 * 16 * 524288 / (5e10 * 0.8))
    assert c.transfer_seconds(0) == 0.0


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match="unknown model"):
        RooflineCostModel.create("gpt-9", "h100")
    with pytest.raises(ValueError, match="unknown dtype"):
        get_model_config("tiny", dtype="int3")
    with pytest.raises(ValueError, match="do not fit"):
        kv_capacity_blocks("llama-13b", "tpu-v5e")
    with pytest.raises(ValueError, match="kv_memory_gb"):
        kv_capacity_blocks("llama-7b", "h100", kv_memory_gb=0)
    with pytest.raises(ValueError, match="flops_efficiency"):
        RooflineCostModel.create("llama-7b", "h100", flops_efficiency=2.0)
    with pytest.raises(ValueError, match="kv_efficiency"):
        RooflineCostModel.create("llama-7b", "h100", kv_efficiency=0.0)


def test_kv_traffic_efficiency_and_no_overlap():
    """kv_efficiency prices paged-KV bytes apart from weight reads; overlap=False adds compute
    and memory time (a CPU) instead of taking the larger."""
    hw, m = get_profile("h100"), get_model_config("llama-7b")
    w, kv = weight_bytes(m), m.kv_bytes_per_token()
    base = RooflineCostModel.create("llama-7b", "h100", step_overhead_s=0.0)
    slow_kv = RooflineCostModel.create("llama-7b", "h100", kv_efficiency=0.2, step_overhead_s=0.0)
    t_hbm = w / (hw.hbm_bandwidth * 0.8) + 8 * 1001 * kv / (hw.hbm_bandwidth * 0.2)
    assert slow_kv.decode_seconds(8, 8 * 1000) == pytest.approx(t_hbm, rel=1e-9)
    assert base.decode_seconds(8, 8 * 1000) < slow_kv.decode_seconds(8, 8 * 1000)
    summed = RooflineCostModel.create("llama-7b", "h100", overlap=False, step_overhead_s=0.0)
    n = 512
    t_math = (2 * matmul_params(m) * n + 4 * 32 * 128 * 32 * n * (n + 1) / 2) / (
        hw.peak_flops * 0.6
    )
    t_mem = (w + n * kv) / (hw.hbm_bandwidth * 0.8)
    assert summed.prefill_seconds(n) == pytest.approx(t_math + t_mem, rel=1e-9)
    assert base.prefill_seconds(n) == pytest.approx(max(t_math, t_mem), rel=1e-9)


def test_work_counts_a_mixed_step_and_both_sides_price_it():
    """`work` counts FLOPs, weight and KV bytes and attention-loop iterations of a step;
    `step_seconds`, `prefill_seconds` and `decode_seconds` charge the roofline of those counts."""
    m = get_model_config("llama-7b")
    c = RooflineCostModel.create(m, "h100")
    w = c.work([(512, 1000), (100, 0)], 8, 8000)
    new = 8 + 512 + 100
    pairs = 8000 + 512 * 1000 + 512 * 513 / 2 + 100 * 101 / 2
    assert w.new_tokens == new
    assert w.flops == pytest.approx(2 * matmul_params(m) * new + 4 * 32 * 128 * 32 * pairs)
    assert w.weight_bytes == weight_bytes(m)
    assert w.kv_bytes == m.kv_bytes_per_token() * (8000 + 1000 + new)
    # Per layer: the longest prefill (1512 tokens) and the decodes (1000 + 1 each), 32 a chunk.
    assert w.attention_chunks == 32 * (48 + 32)
    assert c.work((), 3, 3 * 3000).attention_chunks == 32 * 94
    # Every pricing method charges the roofline of those counts (defaults: 60% of peak FLOP/s,
    # 80% of HBM bandwidth for weights and KV alike, the larger time, plus 1 ms a step).
    hw, kv, mp = get_profile("h100"), m.kv_bytes_per_token(), matmul_params(m)

    def roof(flops: float, hbm_bytes: float) -> float:
        return max(flops / (hw.peak_flops * 0.6), hbm_bytes / (hw.hbm_bandwidth * 0.8)) + 1e-3

    per_pair = 4 * 32 * 128 * 32
    mixed = roof(2 * mp * new + per_pair * pairs, weight_bytes(m) + kv * (8000 + 1000 + new))
    assert c.step_seconds([(512, 1000), (100, 0)], 8, 8000) == pytest.approx(mixed, rel=1e-9)
    prefill = roof(2 * mp * 512 + per_pair * (512 * 1000 + 512 * 513 / 2),
                   weight_bytes(m) + kv * (1000 + 512))  # fmt: skip
    assert c.prefill_seconds(512, 1000) == pytest.approx(prefill, rel=1e-9)
    decode = roof(2 * mp * 8 + per_pair * 8000, weight_bytes(m) + kv * (8000 + 8))
    assert c.decode_seconds(8, 8000) == pytest.approx(decode, rel=1e-9)
    assert c.seconds(c.work()) == 0.0
    with pytest.raises(ValueError, match="bad prefill chunk"):
        c.work([(4, -1)])


def test_one_token_weight_reads_and_the_attention_loop_cost_are_off_by_default():
    """A one-token step reads the weights at ``gemv_efficiency`` (a batched step does not); each
    attention-loop iteration costs ``attention_chunk_s``. Left at their defaults, neither changes
    a step time (the simulator's accelerator figures stay the plain roofline)."""
    hw, m = get_profile("h100"), get_model_config("llama-7b")
    w, kv = weight_bytes(m), m.kv_bytes_per_token()
    base = RooflineCostModel.create(m, "h100", step_overhead_s=0.0)
    plain = RooflineCostModel.create(m, "h100", step_overhead_s=0.0, gemv_efficiency=0.8)
    assert plain.decode_seconds(1, 1000) == pytest.approx(base.decode_seconds(1, 1000), rel=1e-12)
    gemv = RooflineCostModel.create(m, "h100", step_overhead_s=0.0, gemv_efficiency=0.4)
    assert gemv.decode_seconds(1, 1000) == pytest.approx(
        w / (hw.hbm_bandwidth * 0.4) + 1001 * kv / (hw.hbm_bandwidth * 0.8), rel=1e-9
    )
    assert gemv.decode_seconds(2, 2000) == base.decode_seconds(2, 2000)
    loop = RooflineCostModel.create(m, "h100", step_overhead_s=0.0, attention_chunk_s=1e-5)
    for batch, ctx in ((1, 127), (16, 16 * 511)):
        chunks = loop.work((), batch, ctx).attention_chunks
        extra = loop.decode_seconds(batch, ctx) - base.decode_seconds(batch, ctx)
        assert extra == pytest.approx(chunks * 1e-5, rel=1e-9)
    assert loop.work((), 1, 127).attention_chunks == 32 * 4
    mixed = ([(512, 1000), (100, 0)], 8, 8000)  # 48 + 32 iterations a layer (see above)
    extra = loop.step_seconds(*mixed) - base.step_seconds(*mixed)
    assert extra == pytest.approx(32 * (48 + 32) * 1e-5, rel=1e-9)
    assert loop.prefill_seconds(512, 1000) - base.prefill_seconds(512, 1000) == pytest.approx(
        32 * 48 * 1e-5, rel=1e-9
    )
    with pytest.raises(ValueError, match="gemv_efficiency"):
        RooflineCostModel.create(m, "h100", gemv_efficiency=1.5)
    with pytest.raises(ValueError, match="attention_chunk_s"):
        RooflineCostModel.create(m, "h100", attention_chunk_s=-1.0)
    with pytest.raises(ValueError, match="attention_chunk_tokens"):
        RooflineCostModel.create(m, "h100", attention_chunk_tokens=0)
