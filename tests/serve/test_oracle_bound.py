"""scripts/oracle_bound.py: the predictive policy told the true remaining lengths."""

import importlib.util
from pathlib import Path

from serve_jax.interface import Request
from serve_jax.preemption import get_policy
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import WorkloadConfig, build_workload

_SPEC = importlib.util.spec_from_file_location(
    "oracle_bound", Path(__file__).parents[2] / "scripts" / "oracle_bound.py"
)
oracle_bound = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(oracle_bound)


def test_the_oracle_reads_the_trace_length_not_max_tokens():
    pol = oracle_bound.OraclePolicy({"a": 100}, reserve=0.5)
    req = Request("a", [1] * 8, max_tokens=500, arrival_time=0.0)
    req.output_token_ids.extend([1] * 30)
    assert pol.remaining(req) == (70.0, 35.0)  # truth, and the gate's half of it
    capped = Request("a", [1] * 8, max_tokens=60, arrival_time=0.0)
    assert pol.remaining(capped)[0] == 60.0  # the context left caps the trace length


def test_an_exact_oracle_gate_never_preempts_where_predictive_does():
    wl = build_workload(WorkloadConfig(name="reasoning", duration_s=600.0, seed=0))
    cfg = SimConfig(kv_memory_gb=8.0)
    lens = {r.request_id: r.output_len for r in wl.requests}
    exact = simulate(wl, oracle_bound.OraclePolicy(lens), cfg)
    nogate = simulate(wl, get_policy("predictive_nogate"), cfg)
    assert nogate.preemptions > 0
    assert exact.preemptions == 0 and exact.completed == exact.submitted == len(wl.requests)
