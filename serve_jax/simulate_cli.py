"""``python -m serve_jax simulate``: compare preemption policies on a workload in the simulator.

Example::

    python -m serve_jax simulate --workload reasoning \\
        --policies fcfs_last,fewest_output,least_computed,predictive \\
        --model llama-7b --hardware h100 --kv-memory-gb 8 --json out.json

prints one row per policy (and the ratios of ``predictive`` to ``fcfs_last``), writes the rows as
a JSON list (keys ``policy``, ``preemptions``, ``cascades``, ``p99_tpot_s``, ``p99_ttft_s``,
``throughput_tok_s``, ``completed``, ``submitted`` first, then the other metrics) and a PNG next
to it with the TPOT CDF of each policy and its cumulative preemptions over time.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from pathlib import Path
from typing import Any

from serve_jax.preemption import POLICY_NAMES, get_policy
from serve_jax.simulator import SimConfig, SimulationResult, simulate
from serve_jax.workloads import make_workload

__all__ = ["main", "build_parser", "plot_results"]


def build_parser(prog: str = "simulate") -> argparse.ArgumentParser:
    """The command-line parser of ``simulate``."""
    p = argparse.ArgumentParser(
        prog=f"python -m serve_jax {prog}",
        description="Compare preemption policies on a workload with the trace-driven simulator.",
    )
    p.add_argument(
        "--workload",
        default="reasoning",
        help="reasoning, agentic, azure-conv, azure-code, or an Azure-format CSV path",
    )
    p.add_argument("--policies", default=",".join(POLICY_NAMES), help="comma-separated names")
    p.add_argument("--model", default="llama-7b", help="model shape (llama-7b, llama-13b, ...)")
    p.add_argument("--hardware", default="h100", help="chip profile (h100, h200, tpu-v5e, ...)")
    p.add_argument(
        "--kv-memory-gb",
        type=float,
        default=8.0,
        help="device memory for the KV cache, GB (<= 0: HBM left after the weights)",
    )
    p.add_argument("--host-memory-gb", type=float, default=64.0, help="host KV memory, GB")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrivals this many times faster")
    p.add_argument("--burstiness", type=float, default=1.0, help="inter-arrival CV (synthetic)")
    p.add_argument("--duration-s", type=float, default=None, help="span of arrivals, seconds")
    p.add_argument("--max-requests", type=int, default=None, help="keep the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed of synthetic workloads")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--cascade-window-s", type=float, default=1.0)
    p.add_argument("--slo-ttft-s", type=float, default=10.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.1)
    p.add_argument(
        "--vllm-admission",
        action="store_true",
        help="no admission in a step that preempted (vLLM V1's rule); default: the engine's",
    )
    p.add_argument(
        "--gate-quantile",
        type=float,
        default=None,
        help="predictive: quantile of the remaining length its admission gate uses (default 0.7)",
    )
    p.add_argument(
        "--cheap-preemption-steps",
        type=float,
        default=None,
        help="predictive: admit past the gate when a later recompute would cost at most this "
        "many decode steps (default 0: never)",
    )
    p.add_argument(
        "--token-scale", type=float, default=1.0, help="multiply prompt and output lengths"
    )
    p.add_argument(
        "--engine",
        default=None,
        metavar="CONFIG",
        help="also run each policy on the real engine (serve preset or YAML, e.g. tiny_cpu) and "
        "check that the simulator, fed the engine's step times, preempts the same requests at the "
        "same steps; lengths are clipped to the model's context",
    )
    p.add_argument(
        "--engine-override",
        action="append",
        default=[],
        help="engine config override key=value (repeatable), e.g. cache.num_device_blocks=24",
    )
    p.add_argument("--json", default=None, help="write the rows here (and a PNG next to it)")
    p.add_argument("--png", default=None, help="PNG path (default: the JSON path with .png)")
    return p


def _make_policy(name: str, args: argparse.Namespace):
    """A fresh policy, with the predictive options of the command line."""
    kw: dict[str, Any] = {}
    if name.startswith("predictive"):
        if args.gate_quantile is not None:
            kw["gate_quantile"] = args.gate_quantile
        if args.cheap_preemption_steps is not None:
            kw["cheap_preemption_steps"] = args.cheap_preemption_steps
    return get_policy(name, **kw)


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if math.isnan(x):
            return "nan"
        return f"{x:.4g}"
    return str(x)


def _print_table(results: list[SimulationResult]) -> None:
    cols = [
        ("policy", "policy"),
        ("preemptions", "preempt"),
        ("cascades", "cascades"),
        ("back_to_back_preemption_steps", "b2b_steps"),
        ("offload_preemptions", "offloads"),
        ("p99_tpot_s", "p99_tpot_s"),
        ("p50_tpot_s", "p50_tpot_s"),
        ("p99_ttft_s", "p99_ttft_s"),
        ("throughput_tok_s", "tok/s"),
        ("wasted_recompute_tokens", "wasted_tok"),
        ("goodput_req_s", "goodput"),
        ("completed", "done"),
        ("submitted", "sub"),
        ("sim_wall_s", "wall_s"),
    ]
    rows = [[_fmt(r.row()[k]) for k, _ in cols] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (_, h) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (_, h), w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _ratios(results: list[SimulationResult]) -> dict[str, float] | None:
    by = {r.policy: r.row() for r in results}
    if "predictive" not in by or "fcfs_last" not in by:
        return None
    p, f = by["predictive"], by["fcfs_last"]

    def div(a: float, b: float) -> float:
        return a / b if b else (math.inf if a else 1.0)

    return {
        "preemption_reduction_x": div(f["preemptions"], p["preemptions"]),
        "p99_tpot_reduction_x": div(f["p99_tpot_s"], p["p99_tpot_s"]),
        "throughput_ratio": div(p["throughput_tok_s"], f["throughput_tok_s"]),
        "p99_ttft_ratio": div(p["p99_ttft_s"], f["p99_ttft_s"]),
    }


def plot_results(results: list[SimulationResult], path: str | Path, title: str = "") -> None:
    """Writes a PNG: TPOT CDF per policy (left), cumulative preemptions over time (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        t = np.sort(r.tpots)
        if len(t):
            ax1.plot(t * 1e3, np.arange(1, len(t) + 1) / len(t), label=r.policy)
        pt = np.sort(r.preemption_times)
        ax2.step(np.concatenate([[0.0], pt]), np.arange(len(pt) + 1), where="post", label=r.policy)
    ax1.set_xscale("log")
    ax1.set_xlabel("TPOT (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TPOT CDF")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.set_yscale("symlog")
    ax2.set_xlabel("time (s)")
    ax2.set_ylabel("preemptions (cumulative)")
    ax2.set_title("preemptions over time")
    ax2.grid(alpha=0.3)
    ax2.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    """Runs the ``simulate`` command; ``argv[0]`` is the command name."""
    args = build_parser(argv[0] if argv else "simulate").parse_args(argv[1:])
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if not policies:
        raise SystemExit("simulate: --policies is empty")
    config = SimConfig(
        model=args.model,
        hardware=args.hardware,
        kv_memory_gb=args.kv_memory_gb if args.kv_memory_gb > 0 else None,
        host_memory_gb=args.host_memory_gb,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cascade_window_s=args.cascade_window_s,
        slo_ttft_s=args.slo_ttft_s,
        slo_tpot_s=args.slo_tpot_s,
        no_admission_after_preemption=args.vllm_admission,
    )
    workload = make_workload(
        args.workload,
        rate_scale=args.rate_scale,
        burstiness=args.burstiness,
        duration_s=args.duration_s,
        max_requests=args.max_requests,
        seed=args.seed,
    )
    if args.token_scale != 1.0:
        workload = workload.with_token_scale(args.token_scale)
    costs = config.cost_model()
    blocks = costs.kv_capacity_blocks(config.kv_memory_gb)
    s = workload.summary()
    print(
        f"workload {workload.name}: {len(workload.requests)} requests over "
        f"{workload.duration_s:.0f} s, prompt mean {s.get('prompt_mean', 0):.0f}, output mean "
        f"{s.get('output_mean', 0):.0f} tokens; {args.model} on {args.hardware}, KV "
        f"{blocks} blocks x {args.block_size} tokens ({blocks * args.block_size} tokens)"
    )
    if args.engine:
        return _engine_mode(args, workload, policies)
    results = []
    for name in policies:
        res = simulate(workload, _make_policy(name, args), config)
        results.append(res)
    _print_table(results)
    ratios = _ratios(results)
    if ratios:
        print("predictive vs fcfs_last: " + ", ".join(f"{k} {_fmt(v)}" for k, v in ratios.items()))
    for r in results:
        if r.predictor_error:
            e = r.predictor_error
            print(
                f"predictor ({r.policy}): MAE {e['mae_tokens']:.0f} tokens over "
                f"{e['predictions_scored']:.0f} predictions; quantile coverage "
                + ", ".join(f"{k[-3:]}={v:.2f}" for k, v in e.items() if k.startswith("coverage"))
            )
    if args.json:
        rows = []
        for r in results:
            row = r.row()
            row.update(
                model=args.model,
                hardware=args.hardware,
                kv_memory_gb=args.kv_memory_gb,
                rate_scale=args.rate_scale,
                vllm_admission=args.vllm_admission,
            )
            if ratios and r.policy == "predictive":
                row["vs_fcfs_last"] = ratios
            rows.append(row)
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2, default=float))
        png = Path(args.png) if args.png else path.with_suffix(".png")
        title = (
            f"{workload.name}, {args.model} on {args.hardware}, "
            f"KV {args.kv_memory_gb:g} GB, rate x{args.rate_scale:g}"
        )
        plot_results(results, png, title)
        print(f"wrote {path} and {png}")
    return 0


def _engine_mode(args: argparse.Namespace, workload, policies: list[str]) -> int:
    """Each policy on the real engine, then the simulator on the engine's step times."""
    from serve_jax.config import load_engine_config
    from serve_jax.simulator import (
        count_cascades,
        latency_summary,
        replay_on_engine,
        simulator_config_for_engine,
    )

    cfg = load_engine_config(args.engine, args.engine_override)
    sim_cfg = simulator_config_for_engine(cfg, cascade_window_s=args.cascade_window_s)
    limit = min(sim_cfg.max_model_len or 10**9, cfg.cache.num_device_blocks * cfg.cache.block_size)
    workload = workload.with_token_scale(1.0, max_total=limit)
    print(
        f"real engine ({args.engine}, {cfg.cache.num_device_blocks} device blocks x "
        f"{cfg.cache.block_size}, {cfg.cache.num_host_blocks} host blocks): "
        f"{len(workload.requests)} requests, {workload.total_output_tokens()} output tokens"
    )
    # Warm-up: the first steps compile the executor's programs; keep that out of the timings.
    replay_on_engine(cfg, workload.head(min(4, len(workload.requests))), "fcfs_last")
    rows = []
    for name in policies:
        real = replay_on_engine(cfg, workload, _make_policy(name, args), seed=args.seed)
        sim = simulate(
            workload,
            _make_policy(name, args),
            sim_cfg,
            step_times=real.step_seconds,
            costs=copy.deepcopy(real.initial_costs),
            cost_observations=real.cost_observations,
        )
        sim_events = sorted((t, rid) for _, t, rid, _ in sim.preemption_log)
        lat, _ = latency_summary(real.requests)
        makespan = max(r.finish_time or 0.0 for r in real.requests)
        out_tokens = sum(r.num_output_tokens for r in real.requests)
        rows.append(
            {
                "policy": name,
                "preemptions": len(real.preemptions),
                "cascades": count_cascades(real.requests, args.cascade_window_s),
                "p99_tpot_s": lat["p99_tpot_s"],
                "p99_ttft_s": lat["p99_ttft_s"],
                "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
                "completed": sum(1 for r in real.requests if r.status.finished),
                "submitted": len(workload.requests),
                "engine_steps": len(real.step_seconds),
                "offload_preemptions": real.num_offload_preemptions,
                "sim_preemptions": sim.preemptions,
                "same_preemption_sequence": sim_events == real.preemptions,
                "mean_tpot_s": lat["mean_tpot_s"],
                "p50_tpot_s": lat["p50_tpot_s"],
                "engine": args.engine,
            }
        )
        r = rows[-1]
        print(
            f"{name:16s} preemptions {r['preemptions']:5d} (sim {r['sim_preemptions']:5d}, same "
            f"sequence: {r['same_preemption_sequence']})  p99 TPOT {_fmt(r['p99_tpot_s'])} s  "
            f"p99 TTFT {_fmt(r['p99_ttft_s'])} s  {_fmt(r['throughput_tok_s'])} tok/s  "
            f"{r['completed']}/{r['submitted']} done",
            flush=True,
        )
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(rows, indent=2, default=float))
        print(f"wrote {path}")
    return 0 if all(r["same_preemption_sequence"] for r in rows) else 1
