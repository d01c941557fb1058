"""``python -m serve_jax crosscheck``: the simulator against the real engine, policy by policy.

Example (the CPU check of BENCHMARKS.md: 174 requests, long enough for ``predictive``'s
predictor to learn lengths of this scale, so that it preempts too)::

    python -m serve_jax crosscheck --config tiny_cpu cache.num_device_blocks=16 \\
        cache.num_host_blocks=0 cache.enable_prefix_caching=false --workload reasoning \\
        --duration-s 4000 --rate-scale 400 --token-scale 0.005 --json engine_tiny.json

Prefix caching is off there because at this scale prompts are 1-4 random tokens: two requests
with the same prompt produce the same greedy tokens and share cached blocks on the engine, which
the simulator (placeholder tokens, one cache salt per request) cannot know, so the sequences part.

The engine is an `serve_jax.config.EngineConfig` (``--config <preset or .yaml>``, default
``tiny_cpu``, and ``key=value`` overrides); the requests come from the workload flags every serve
command shares (`serve_jax.cli_args`), their lengths clipped to the model's context. Each policy
runs on the real engine with a step clock, then the simulator replays the engine's step times
(`serve_jax.crosscheck`) and must preempt the same requests at the same steps. Prints one line
per policy and writes the rows as JSON; exits 1 when a sequence differs.

A command of its own (not a mode of ``simulate``) so that the simulator's command never loads
the JAX engine.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from serve_jax.cli_args import (
    add_policy_args,
    add_slo_args,
    add_workload_args,
    policy_names,
    workload_config,
)
from serve_jax.config import EngineConfig, load_engine_config
from serve_jax.crosscheck import replay_on_engine, simulate_replay
from serve_jax.metrics import record_from, summarize
from serve_jax.preemption import make_policy
from serve_jax.sim_metrics import count_cascades
from serve_jax.simulator import simulator_config_for_engine
from serve_jax.workloads import WorkloadConfig, build_workload
from tapas_jax.commands import command_parser, write_json

__all__ = ["main", "build_parser"]


def build_parser(prog: str = "crosscheck") -> argparse.ArgumentParser:
    """The command-line parser of ``crosscheck``."""
    p = command_parser(
        "serve_jax",
        prog,
        EngineConfig,
        description="Run each policy on the real engine, then check that the simulator, fed the "
        "engine's step times, preempts the same requests at the same steps.",
        example="cache.num_device_blocks=16",
    )
    add_workload_args(p, WorkloadConfig(name="reasoning"))
    add_policy_args(p)
    p.add_argument(
        "--cascade-window-s",
        type=float,
        default=1.0,
        help="a re-preemption within this many seconds is a cascade",
    )
    add_slo_args(p, None, None)
    p.add_argument("--json", default=None, help="write the rows here")
    return p


def _fmt(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.4g}"


def main(argv: list[str]) -> int:
    """Runs the ``crosscheck`` command; ``argv[0]`` is the command name."""
    args = build_parser(argv[0] if argv else "crosscheck").parse_args(argv[1:])
    options = {"gate_quantile": args.gate_quantile}
    options["cheap_preemption_steps"] = args.cheap_preemption_steps
    policies = policy_names(args)
    for name in policies:
        make_policy(name, **options)  # an unknown name fails before any work
    cfg = load_engine_config(args.config or "tiny_cpu", list(args.overrides))
    slos: dict[str, Any] = {"cascade_window_s": args.cascade_window_s}
    if args.slo_ttft_ms is not None:
        slos["slo_ttft_ms"] = args.slo_ttft_ms
    if args.slo_tpot_ms is not None:
        slos["slo_tpot_ms"] = args.slo_tpot_ms
    sim_cfg = simulator_config_for_engine(cfg, **slos)
    limit = min(sim_cfg.max_model_len or 10**9, cfg.cache.num_device_blocks * cfg.cache.block_size)
    workload = build_workload(workload_config(args)).with_token_scale(1.0, max_total=limit)
    print(
        f"real engine ({args.config or 'tiny_cpu'}, {cfg.cache.num_device_blocks} device blocks "
        f"x {cfg.cache.block_size}, {cfg.cache.num_host_blocks} host blocks): "
        f"{len(workload.requests)} requests, {workload.total_output_tokens()} output tokens"
    )
    # Warm-up: the first steps compile the executor's programs; keep that out of the timings.
    replay_on_engine(cfg, workload.head(min(4, len(workload.requests))), "fcfs_last")
    rows = []
    for name in policies:
        real = replay_on_engine(cfg, workload, make_policy(name, **options), seed=args.seed)
        sim = simulate_replay(workload, make_policy(name, **options), sim_cfg, real)
        sim_events = sorted((t, rid) for _, t, rid, _ in sim.preemption_log)
        finished = [r for r in real.requests if r.status.finished]
        makespan = max(r.finish_time or 0.0 for r in real.requests)
        lat = summarize([record_from(r) for r in finished], makespan if makespan > 0 else None)
        out_tokens = sum(r.num_output_tokens for r in real.requests)
        r = {
            "policy": name,
            "preemptions": len(real.preemptions),
            "cascades": count_cascades(real.requests, sim_cfg.cascade_window_s),
            "p99_tpot_ms": lat["tpot_ms"]["p99"],
            "p99_ttft_ms": lat["ttft_ms"]["p99"],
            "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "completed": len(finished),
            "submitted": len(workload.requests),
            "engine_steps": len(real.step_seconds),
            "offload_preemptions": real.num_offload_preemptions,
            "sim_preemptions": sim.preemptions,
            "same_preemption_sequence": sim_events == real.preemptions,
            "tpot_ms": lat["tpot_ms"],
            "ttft_ms": lat["ttft_ms"],
            "engine": args.config or "tiny_cpu",
        }
        rows.append(r)
        print(
            f"{name:16s} preemptions {r['preemptions']:5d} (sim {r['sim_preemptions']:5d}, same "
            f"sequence: {r['same_preemption_sequence']})  p99 TPOT {_fmt(r['p99_tpot_ms'])} ms  "
            f"p99 TTFT {_fmt(r['p99_ttft_ms'])} ms  {_fmt(r['throughput_tok_s'])} tok/s  "
            f"{r['completed']}/{r['submitted']} done",
            flush=True,
        )
    write_json(args.json, rows)
    return 0 if all(r["same_preemption_sequence"] for r in rows) else 1
