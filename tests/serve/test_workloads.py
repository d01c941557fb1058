"""Workloads: generators (seeding, length mixtures, arrivals, multi-turn growth), traces, and the
one builder that replay, bench and simulate share."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from serve_jax.workloads import (
    WorkloadConfig,
    agentic_workload,
    build_workload,
    gamma_arrivals,
    load_trace,
    reasoning_workload,
)


def make_workload(name, **kw):
    return build_workload(WorkloadConfig(name=name, **kw))


def test_reasoning_is_seeded_and_bimodal():
    a = reasoning_workload(rate=0.5, duration_s=2000, seed=3)
    b = reasoning_workload(rate=0.5, duration_s=2000, seed=3)
    assert a == b
    assert a != reasoning_workload(rate=0.5, duration_s=2000, seed=4)
    short = reasoning_workload(rate=1.0, duration_s=2000, long_fraction=0.0, seed=0)
    long_ = reasoning_workload(rate=1.0, duration_s=2000, long_fraction=1.0, seed=0)
    assert np.median([r.output_len for r in short.requests]) == pytest.approx(2048, rel=0.1)
    assert np.median([r.output_len for r in long_.requests]) == pytest.approx(8192, rel=0.1)
    frac_long = np.mean([r.output_len > 4096 for r in a.requests])
    assert frac_long == pytest.approx(0.4, abs=0.1)


@pytest.mark.parametrize("shape", [1.0, 1 / 9])
def test_gamma_arrivals_rate_and_burstiness(shape):
    """burstiness is the gamma shape (vLLM's meaning): CV = 1 / sqrt(burstiness)."""
    t = gamma_arrivals(np.random.default_rng(0), rate=2.0, duration_s=5000, burstiness=shape)
    assert len(t) / 5000 == pytest.approx(2.0, rel=0.1)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(shape**-0.5, rel=0.15)


def test_synthetic_and_trace_arrivals_share_one_burstiness():
    """The same --burstiness (the gamma shape) draws a generator's arrivals and a trace's."""
    shape, rate = 0.25, 2.0
    trace = make_workload("conv", rate=rate, burstiness=shape, num_requests=50, seed=1)
    gaps = np.diff([r.arrival_time for r in trace.requests])
    expected = np.random.default_rng(1).gamma(shape, 1 / (rate * shape), size=50)[:-1]
    np.testing.assert_allclose(gaps, expected, rtol=1e-9, atol=1e-9)
    t = gamma_arrivals(np.random.default_rng(1), rate, 1000.0, burstiness=shape)
    expected = np.cumsum(np.random.default_rng(1).gamma(shape, 1 / (rate * shape), size=len(t)))
    np.testing.assert_allclose(t, expected, rtol=1e-9)
    with pytest.raises(ValueError, match="give a rate"):
        make_workload("conv", burstiness=0.5)


def test_rate_scale_speeds_arrivals_up():
    wl = make_workload("reasoning", duration_s=600, seed=1)
    fast = make_workload("reasoning", duration_s=600, seed=1, rate_scale=2.0)
    assert len(fast.requests) == len(wl.requests)
    for a, b in zip(wl.requests, fast.requests):
        assert b.arrival_time == pytest.approx(a.arrival_time / 2)
        assert (b.prompt_len, b.output_len) == (a.prompt_len, a.output_len)


def test_agentic_context_grows_turn_after_turn():
    wl = agentic_workload(session_rate=0.2, duration_s=300, seed=0)
    by_id = {r.request_id: r for r in wl.requests}
    children = [r for r in wl.requests if r.parent_id is not None]
    assert children, "expected multi-turn sessions"
    for r in children:
        parent = by_id[r.parent_id]
        assert r.session_id == parent.session_id
        assert r.prompt_len > parent.prompt_len + parent.output_len
        assert r.arrival_time >= parent.arrival_time
    assert [r.arrival_time for r in wl.requests] == sorted(r.arrival_time for r in wl.requests)


def test_head_keeps_parents():
    wl = agentic_workload(session_rate=0.2, duration_s=300, seed=0).head(10)
    ids = {r.request_id for r in wl.requests}
    assert all(r.parent_id is None or r.parent_id in ids for r in wl.requests)


def test_unknown_workload_is_an_error():
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        make_workload("nope")
    with pytest.raises(ValueError, match="rate_scale"):
        make_workload("reasoning", duration_s=10, rate_scale=0)
    with pytest.raises(ValueError, match="skip applies to traces"):
        make_workload("reasoning", duration_s=10, skip=3)


def test_azure_csv_path(tmp_path):
    csv = tmp_path / "t.csv"
    csv.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:15:51.2224670,879,55\n"
    )
    wl = make_workload(str(csv))
    assert [(r.prompt_len, r.output_len) for r in wl.requests] == [(374, 44), (396, 109), (879, 55)]
    assert wl.requests[1].arrival_time == pytest.approx(4.314579, abs=1e-5)
    assert make_workload(str(csv), rate_scale=2.0).requests[1].arrival_time == pytest.approx(
        4.314579 / 2, abs=1e-5
    )
    with pytest.raises(FileNotFoundError):
        make_workload(str(tmp_path / "missing.csv"))
    assert [r.request_id for r in load_trace(csv, skip=1).requests] == ["a1", "a2"]
    clipped = make_workload(str(csv), token_scale=0.5, max_input_len=100, max_output_len=30)
    assert [(r.prompt_len, r.output_len) for r in clipped.requests] == [(100, 22), (100, 30),
                                                                      (100, 28)]  # fmt: skip


def test_sample_traces_ship_with_the_package():
    wl = load_trace("conv", limit=20)
    assert len(wl.requests) == 20 and wl.requests[0].arrival_time == 0.0
    times = [r.arrival_time for r in wl.requests]
    assert times == sorted(times)
    assert (wl.requests[0].prompt_len, wl.requests[0].output_len) == (374, 44)
    assert len(load_trace("code", limit=5).requests) == 5
    fixed = make_workload("conv", num_requests=30, rate=float("inf"))
    assert all(r.arrival_time == 0.0 for r in fixed.requests)


def test_a_file_that_is_not_a_trace_names_the_file_not_its_contents(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens\n1,2\n")
    with pytest.raises(ValueError, match="GeneratedTokens"):
        load_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1,two,3\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        load_trace(bad)
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nsecret-text,2,3\n")
    with pytest.raises(ValueError, match="bad.csv:2: bad TIMESTAMP") as e:
        load_trace(bad)
    assert "secret" not in str(e.value)
    bad.write_bytes(b"\xff\xfe\x00secret")
    with pytest.raises(ValueError, match="not a CSV trace|missing column") as e:
        load_trace(bad)
    assert "secret" not in str(e.value)


def test_full_azure_traces_ship_with_the_package():
    """The full traces are package data (gzip), so the Azure tables reproduce from a clone."""
    conv = make_workload("azure-conv", duration_s=60)
    assert len(conv.requests) == 191  # the first minute of the trace
    assert all(r.arrival_time < 60 for r in conv.requests)
    code = load_trace("azure-code")
    assert len(code.requests) == 8819 and 3430 < code.duration_s < 3440
    # conv / code are the first 500 requests of the full traces, skip and limit within them.
    assert load_trace("conv").requests == load_trace("azure-conv", limit=500).requests
    assert len(load_trace("code", skip=490).requests) == 10
    assert len(load_trace("code", skip=490, limit=50).requests) == 10


def test_gzip_traces_by_path_and_a_bad_gzip_named_without_its_bytes(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n1.0,5,6\n3.5,7,8\n"
    path = tmp_path / "t.csv.gz"
    path.write_bytes(gzip.compress(text.encode()))
    wl = make_workload(str(path))
    assert [(r.arrival_time, r.prompt_len, r.output_len) for r in wl.requests] == [
        (0.0, 5, 6),
        (2.5, 7, 8),
    ]
    path.write_bytes(b"secret, not gzip")
    with pytest.raises(ValueError, match="t.csv.gz: not a gzip-compressed CSV trace") as e:
        load_trace(path)
    assert "secret" not in str(e.value)


def test_token_scale_shrinks_lengths_within_a_context():
    wl = reasoning_workload(rate=0.5, duration_s=200, seed=0)
    small = wl.with_token_scale(0.01, max_total=64)
    for a, b in zip(wl.requests, small.requests):
        assert 1 <= b.prompt_len <= 32 and 1 <= b.output_len
        assert b.prompt_len + b.output_len <= 64
        assert b.output_len == min(max(round(a.output_len * 0.01), 1), 64 - b.prompt_len)
    with pytest.raises(ValueError, match="token scale"):
        wl.with_token_scale(0)
