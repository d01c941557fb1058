"""The tuning sweep of ``predictive``'s admission gate, on ONE workload: reasoning, seed 0.

Issue 13 asks that the predictor and gate settings be chosen on one workload and reported on the
others without retuning. This script is that choice, written down: it runs the baselines once
and ``predictive`` at every setting of the grid, on the reasoning workload (seed 0, 2400 s) at
8 GB and 16 GB of KV (Llama-7B on an H100, the BENCHMARKS setting), scores each setting against
the best baseline of each memory size on the issue's five goals, and picks one:

1. most goals met over both memory sizes (>= 5x fewer preemptions, >= 2x lower p99 TPOT,
   throughput >= 0.99x, goodput >= 1x, p99 TTFT <= 1.1x);
2. then the highest geometric mean of the goodput ratios;
3. then the highest geometric mean of the p99 TPOT reductions.

The predictor's own settings (prior, window, shrinkage, refresh) are not swept: they keep their
defaults. Usage (writes the rows and the choice as JSON)::

    python scripts/tune_predictive.py --json runs/tune_predictive.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
from pathlib import Path

from serve_jax.preemption import get_policy
from serve_jax.simulate_cli import BASELINES, best_baseline_ratios, goals
from serve_jax.simulator import SimConfig, simulate
from serve_jax.workloads import WorkloadConfig, build_workload

GATE_QUANTILES = (0.3, 0.5, 0.7, 0.9)
CHEAP_PREEMPTION_STEPS = (0.0, 10.0, 100.0)
MEMORY_GB = (8.0, 16.0)


def _gmean(xs: list[float]) -> float:
    xs = [max(x, 1e-9) for x in xs]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration-s", type=float, default=2400.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    wl = build_workload(
        WorkloadConfig(name="reasoning", duration_s=args.duration_s, seed=args.seed)
    )
    base = {gb: [simulate(wl, get_policy(n), SimConfig(kv_memory_gb=gb)) for n in BASELINES]
            for gb in MEMORY_GB}  # fmt: skip
    rows = []
    for q, cheap in itertools.product(GATE_QUANTILES, CHEAP_PREEMPTION_STEPS):
        row: dict = {"gate_quantile": q, "cheap_preemption_steps": cheap, "goals_met": 0}
        ratios = {}
        for gb in MEMORY_GB:
            pol = get_policy("predictive", gate_quantile=q, cheap_preemption_steps=cheap)
            res = simulate(wl, pol, SimConfig(kv_memory_gb=gb))
            r = best_baseline_ratios([*base[gb], res])
            ratios[gb] = r
            met = goals(r)
            row["goals_met"] += sum(met.values())
            row[f"{gb:g}GB"] = {
                "preemptions": res.preemptions,
                **{k: r[k] for k in r if not k.endswith("_best")},
                "missed": [k for k, v in met.items() if not v],
            }
        row["goodput_gmean"] = _gmean([ratios[gb]["goodput_ratio"] for gb in MEMORY_GB])
        row["tpot_gmean"] = _gmean([ratios[gb]["p99_tpot_reduction_x"] for gb in MEMORY_GB])
        rows.append(row)
        print(
            f"q={q:.1f} cheap={cheap:5.0f}: goals {row['goals_met']}/10, goodput x"
            f"{row['goodput_gmean']:.3f}, p99 TPOT /{row['tpot_gmean']:.2f}; "
            + "; ".join(
                f"{gb:g} GB: {row[f'{gb:g}GB']['preemptions']} preempt, TPOT /"
                f"{ratios[gb]['p99_tpot_reduction_x']:.2f}, goodput x"
                f"{ratios[gb]['goodput_ratio']:.3f}, TTFT x{ratios[gb]['p99_ttft_ratio']:.2f}"
                for gb in MEMORY_GB
            ),
            flush=True,
        )
    best = max(rows, key=lambda r: (r["goals_met"], r["goodput_gmean"], r["tpot_gmean"]))
    print(
        f"chosen: gate_quantile={best['gate_quantile']}, "
        f"cheap_preemption_steps={best['cheap_preemption_steps']:g}"
    )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rows": rows, "chosen": best}, indent=2) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
