"""Alpha-beta collective costs and hardware profiles."""

import pytest

from tapas_jax.collectives import (
    bytes_moved,
    collective_seconds,
    compiled_collective_terms,
    fit_alpha_beta,
    latency_hops,
    op_seconds,
    torus_allreduce_seconds,
    torus_shape,
)
from tapas_jax.hardware import PROFILES, get_profile, profile_for_device, tpu_slice


def test_all_reduce_is_reduce_scatter_plus_all_gather():
    hw = get_profile("tpu-v5e")
    v, p = 64e6, 8
    ar = collective_seconds("all-reduce", v, p, hw)
    rs = collective_seconds("reduce-scatter", v, p, hw)
    ag = collective_seconds("all-gather", v, p, hw)
    assert ar == pytest.approx(rs + ag)
    assert bytes_moved("all-reduce", v, p) == pytest.approx(2 * 7 / 8 * v)


def test_single_device_axis_is_free():
    for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
        assert collective_seconds(kind, 1e9, 1, "h100") == 0.0


def test_bandwidth_term_dominates_large_messages():
    hw = get_profile("tpu-v5p")
    t = collective_seconds("all-gather", 1e9, 4, hw)
    assert t == pytest.approx(0.75 * 1e9 / hw.axis_bandwidth, rel=1e-3)


def test_unknown_kind_and_profile():
    with pytest.raises(ValueError, match="unknown collective kind"):
        collective_seconds("broadcast", 1e6, 4, "h100")
    with pytest.raises(ValueError, match="unknown hardware 'tpu-v9'"):
        get_profile("tpu-v9")


def test_required_profiles_exist_with_sources():
    for name in ("tpu-v3", "tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "h200", "cpu"):
        p = PROFILES[name]
        assert p.peak_flops > 0 and p.hbm_bytes > 0 and p.source
    assert get_profile("H100") is PROFILES["h100"]


def test_profile_for_device_reads_generation_then_platform():
    assert profile_for_device("tpu", "TPU v5 lite").name == "tpu-v5e"
    assert profile_for_device("tpu", "TPU v4").name == "tpu-v4"
    assert profile_for_device("gpu", "NVIDIA H200").name == "h200"
    assert profile_for_device("gpu", "NVIDIA A100-SXM4-40GB").name == "h100"
    assert profile_for_device("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="platform"):
        profile_for_device("quantum")


def test_latency_hops_follow_the_ring_algorithms():
    assert [latency_hops("all-reduce", p) for p in (1, 2, 8)] == [0, 2, 14]
    assert latency_hops("all-gather", 8) == latency_hops("reduce-scatter", 8) == 7
    assert latency_hops("all-to-all", 4) == 3
    assert latency_hops("collective-permute", 64) == 1  # to its neighbour
    with pytest.raises(ValueError, match="send-recv"):
        latency_hops("send-recv", 2)
    # collective_seconds pays exactly those hops: at one byte the bandwidth term is negligible.
    hw = get_profile("tpu-v3")
    t = collective_seconds("all-reduce", 1.0, 8, hw)
    assert t == pytest.approx(14 * hw.collective_latency, rel=1e-4)


def test_torus_shape_is_the_most_square_factorisation():
    assert torus_shape(1024) == (32, 32)
    assert torus_shape(512) == (16, 32)
    assert torus_shape(8) == (2, 4)
    assert torus_shape(7) == (1, 7)
    assert torus_shape(1) == (1, 1)
    with pytest.raises(ValueError, match="chips"):
        torus_shape(0)


def test_torus_allreduce_is_cheaper_than_one_ring_and_composes_the_axis_collectives():
    v = 3e8
    ring = collective_seconds("all-reduce", v, 1024, "tpu-v3")
    torus = torus_allreduce_seconds(v, 1024, "tpu-v3")
    assert torus < ring
    expect = (
        collective_seconds("reduce-scatter", v, 32, "tpu-v3")
        + collective_seconds("all-reduce", v / 32, 32, "tpu-v3")
        + collective_seconds("all-gather", v, 32, "tpu-v3")
    )
    assert torus == pytest.approx(expect)
    assert torus_allreduce_seconds(v, 1, "tpu-v3") == 0.0


def test_alpha_beta_fit_recovers_a_known_link():
    alpha, w = 2e-4, 5e8
    times = {v: 2 * alpha + v / w for v in (4096, 1 << 20, 4 << 20)}  # p = 2
    fa, fw = fit_alpha_beta(times, 2)
    assert fa == pytest.approx(alpha, rel=1e-6) and fw == pytest.approx(w, rel=1e-6)
    p = 4  # 2(p-1) = 6 hops, 2(p-1)/p = 1.5 bytes per byte
    times = {v: 6 * alpha + 1.5 * v / w for v in (4096, 1 << 20, 4 << 20)}
    fa, fw = fit_alpha_beta(times, p)
    assert fa == pytest.approx(alpha, rel=1e-6) and fw == pytest.approx(w, rel=1e-6)
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta({4096: 1e-3}, 2)


def test_compiled_collectives_are_priced_like_the_collective_model():
    hw = get_profile("tpu-v3")

    def seconds(count, p):
        hops, sent = compiled_collective_terms({"all-reduce": count}, {"all-reduce": 1e6}, 2, p)
        return hops * hw.collective_latency + sent / hw.axis_bandwidth

    # 1e6 bytes moved at p=2 is a 1e6-byte payload (2 (p-1)/p = 1).
    assert seconds(1, 8) == pytest.approx(collective_seconds("all-reduce", 1e6, 8, hw))
    assert seconds(10, 8) > seconds(1, 8)  # nine more latency terms
    assert seconds(3, 1) == 0.0
    counts = {"all-reduce": 2, "all-gather": 1, "all-to-all": 1, "collective-permute": 3}
    moved = {"all-reduce": 2e6, "all-gather": 0.0, "all-to-all": 0.0, "collective-permute": 30.0}
    hops, sent = compiled_collective_terms(counts, moved, 2, 4)
    # all-reduce 2(p-1) each, gather and all-to-all p-1, a permute one hop to its neighbour.
    assert hops == 2 * 6 + 3 + 3 + 3
    # 2e6 bytes moved by two all-reduces at p=2 are 2e6 of payload; at p=4 each device sends 1.5x.
    assert sent == pytest.approx(1.5 * 2e6 + 30.0)
    assert compiled_collective_terms(counts, moved, 2, 1) == (0, 0.0)
    with pytest.raises(ValueError, match="send-recv"):
        compiled_collective_terms({"send-recv": 1}, {}, 2, 2)


@pytest.mark.parametrize(
    "acc,chips,cores,hosts,profile",
    [
        ("v3-8", 4, 8, 1, "tpu-v3"),
        ("v3-32", 16, 32, 4, "tpu-v3"),
        ("v3-1024", 512, 1024, 128, "tpu-v3"),
        ("v5litepod-8", 8, 8, 1, "tpu-v5e"),
        ("v5litepod-16", 16, 16, 4, "tpu-v5e"),
        ("v6e-256", 256, 256, 64, "tpu-v6e"),
    ],
)
def test_tpu_slice(acc, chips, cores, hosts, profile):
    s = tpu_slice(acc)
    assert (s.chips, s.cores, s.hosts, s.profile) == (chips, cores, hosts, profile)
    assert s.profile in PROFILES


def test_tpu_slice_rejects_unknown_types():
    with pytest.raises(ValueError, match="unknown accelerator"):
        tpu_slice("v9-8")
    with pytest.raises(ValueError, match="two per chip"):
        tpu_slice("v3-3")


def test_op_seconds_prices_one_compiled_collective_on_a_torus():
    hw = get_profile("tpu-v3")
    assert op_seconds("all-reduce", 1e8, 1, hw) == 0.0
    assert op_seconds("all-reduce", 1e8, 256, hw) == torus_allreduce_seconds(1e8, 256, hw)
    # One hop over one link, whatever the slice.
    permute = op_seconds("collective-permute", 1e6, 256, hw)
    assert permute == pytest.approx(1e6 / hw.ici_link_bandwidth + hw.collective_latency)
    assert op_seconds("all-gather", 1e6, 16, hw) == collective_seconds("all-gather", 1e6, 16, hw)
    with pytest.raises(ValueError, match="unknown collective"):
        op_seconds("broadcast", 1e6, 16, hw)
