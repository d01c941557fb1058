"""Workload generators: seeding, length mixtures, arrivals, multi-turn growth, traces."""

from __future__ import annotations

import numpy as np
import pytest

from serve_jax.workloads import (
    TRACE_DIR,
    agentic_workload,
    gamma_arrivals,
    make_workload,
    reasoning_workload,
)


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


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_arrivals_rate_and_burstiness(cv):
    t = gamma_arrivals(np.random.default_rng(0), rate=2.0, duration_s=5000, burstiness=cv)
    assert len(t) / 5000 == pytest.approx(2.0, rel=0.1)
    gaps = np.diff(t)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.15)


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


@pytest.mark.skipif(not (TRACE_DIR / "azure_llm_conv_2023.csv").exists(), reason="no ../shared")
def test_azure_conv_trace_from_shared_traces():
    wl = make_workload("azure-conv", duration_s=60)
    assert len(wl.requests) == 191  # the first minute of the trace
    assert all(r.arrival_time < 60 for r in wl.requests)


def test_token_scale_shrinks_lengths_within_a_context():
    wl = reasoning_workload(rate=0.5, duration_s=200, seed=0)
    small = wl.with_token_scale(0.01, max_total=64)
    for a, b in zip(wl.requests, small.requests):
        assert 1 <= b.prompt_len <= 32 and 1 <= b.output_len
        assert b.prompt_len + b.output_len <= 64
        assert b.output_len == min(max(round(a.output_len * 0.01), 1), 64 - b.prompt_len)
    with pytest.raises(ValueError, match="token scale"):
        wl.with_token_scale(0)
