"""Alpha-beta collective costs and hardware profiles."""

import pytest

from tapas_jax.collectives import bytes_moved, collective_seconds
from tapas_jax.hardware import PROFILES, get_profile


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
    from tapas_jax.hardware import profile_for_device

    assert profile_for_device("tpu", "TPU v5 lite").name == "tpu-v5e"
    assert profile_for_device("tpu", "TPU v4").name == "tpu-v4"
    assert profile_for_device("gpu", "NVIDIA H200").name == "h200"
    assert profile_for_device("gpu", "NVIDIA A100-SXM4-40GB").name == "h100"
    assert profile_for_device("cpu", "cpu").name == "cpu"
    with pytest.raises(ValueError, match="platform"):
        profile_for_device("quantum")
