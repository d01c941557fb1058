"""What a perfect remaining-length predictor would reach: the bound on issue 13's claim.

``predictive`` is judged against the best baseline of each table on five goals at once (>= 5x
fewer preemptions, >= 2x lower p99 TPOT, throughput >= 0.99x, goodput >= 1x, p99 TTFT <= 1.1x).
This script asks whether ANY predictor could meet them: it runs ``predictive``'s own victim
choice, offload pricing and admission gate, but with every request's true remaining length in
place of the predictor's estimate (the trace's output lengths, which no real policy sees),
next to the four baselines, on the same settings as the
BENCHMARKS tables. If the oracle misses a goal, a better predictor cannot close it there; if it
meets one that ``predictive`` misses, the gap is the prediction.

An analysis tool, not a policy: nothing in serve_jax can construct it. Usage::

    python scripts/oracle_bound.py --json runs/oracle_bound.json [--tables reasoning_8,conv_8]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from serve_jax.interface import Request
from serve_jax.preemption import PredictivePolicy, _PredState, get_policy
from serve_jax.simulate_cli import BASELINES, best_baseline_ratios, goals
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import WorkloadConfig, build_workload

RESERVES = (1.0, 0.5, 0.25, 0.1, 0.03)
# name: (workload, duration s, KV GB, seed) as in BENCHMARKS' issue-13 tables
TABLES = {
    "reasoning_8": ("reasoning", 2400.0, 8.0, 0),
    "reasoning_16": ("reasoning", 2400.0, 16.0, 0),
    "reasoning_8_seed1": ("reasoning", 2400.0, 8.0, 1),
    "agentic_8": ("agentic", 1200.0, 8.0, 0),
    "conv_8": ("azure-conv", 600.0, 8.0, 0),
    "code_8": ("azure-code", 600.0, 8.0, 0),
}


class OraclePolicy(PredictivePolicy):
    """`PredictivePolicy` told each request's true remaining output: its trace length (capped,
    as the simulator caps it, by the context left after its prompt: ``max_tokens``) minus what
    it generated. Victims are chosen on the truth; the gate reserves ``reserve`` of it (1: the
    exact future peak, never a preemption it could foresee; less: admits more and accepts
    preemptions)."""

    def __init__(self, output_lens: dict[str, int], reserve: float = 1.0, **kwargs):
        super().__init__(**kwargs)
        if not 0.0 < reserve <= 1.0:
            raise ValueError(f"reserve must be in (0, 1], got {reserve}")
        self.output_lens = output_lens
        self.reserve = reserve

    def _fresh_state(self, req: Request, g: int) -> _PredState:
        st = req.predictor_state
        if not isinstance(st, _PredState):
            st = req.predictor_state = _PredState()
        length = min(self.output_lens[req.request_id], req.max_tokens)
        truth = float(max(length - g, 1))
        st.generated_at_refresh = g
        st.remaining_at_refresh = truth
        st.gate_at_refresh = max(self.reserve * truth, 1.0)
        return st


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tables", default=",".join(TABLES), help="comma-separated table names")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = {}
    for name in args.tables.split(","):
        kind, duration, gb, seed = TABLES[name]
        wl = build_workload(WorkloadConfig(name=kind, duration_s=duration, seed=seed))
        cfg = SimConfig(kv_memory_gb=gb)
        base = [simulate(wl, get_policy(b), cfg) for b in BASELINES]
        lens = {r.request_id: r.output_len for r in wl.requests}
        variants = {f"oracle_reserve{f:g}": OraclePolicy(lens, reserve=f) for f in RESERVES}
        variants["oracle_cheap100"] = OraclePolicy(lens, cheap_preemption_steps=100.0)
        variants["oracle_nogate"] = OraclePolicy(lens, gate=False)
        out[name] = {"baselines": {r.policy: r.row() for r in base}, "oracle": {}}
        for label, pol in variants.items():
            pol.name = label  # its row's policy, the one best_baseline_ratios compares
            res = simulate(wl, pol, cfg)
            ratios = best_baseline_ratios([*base, res], label)
            missed = [g for g, ok in goals(ratios).items() if not ok]
            row = res.row()
            out[name]["oracle"][label] = {"row": row, "ratios": ratios, "missed": missed}
            print(
                f"{name:18} {label:16} preempt {row['preemptions']:5d} "
                f"(best {ratios['preemption_reduction_x']:.3g}x) p99 TPOT /"
                f"{ratios['p99_tpot_reduction_x']:.2f} tput x{ratios['throughput_ratio']:.3f} "
                f"goodput x{ratios['goodput_ratio']:.3f} TTFT x{ratios['p99_ttft_ratio']:.2f} "
                f"missed: {', '.join(missed) or 'none'}",
                flush=True,
            )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
