"""``python -m serve_jax simulate``: compare preemption policies on a workload in the simulator.

Example::

    python -m serve_jax simulate --workload reasoning \\
        --policies fcfs_last,fewest_output,least_computed,predictive \\
        --model llama-7b --hardware h100 --kv-memory-gb 8 --json out.json

The simulated server is a `serve_jax.simulator.SimConfig`: ``--config <preset or .yaml>`` and
``key=value`` overrides (``kv_memory_gb=16``, ``no_admission_after_preemption=true``, ...; all
listed by ``--help``); its most used fields also have flags, as tapas_jax's ``plan`` has
(``--kv-memory-gb 16`` is ``kv_memory_gb=16``). The requests come from the
workload flags every serve command shares (`serve_jax.cli_args`).

Every policy runs under the same scheduler rules (vLLM V1's: no admission in a step that
preempted, automatic prefix caching; ``no_admission_after_preemption=false`` or
``enable_prefix_caching=false`` switch them off for all). ``--policies`` takes the names of
`serve_jax.preemption.POLICY_NAMES` (the default: the baselines ``fcfs_last``,
``fcfs_last_offload``, ``fewest_output``, ``least_computed``, and ``predictive``) and the
ablations ``predictive_nogate`` and ``predictive_recompute``.

Prints one row per policy and the ratios of ``predictive`` to the best baseline of the run on
each metric (and to ``fcfs_last``), writes the rows as a JSON list (keys ``policy``,
``preemptions``, ``cascades``, ``p99_tpot_ms`` and ``p99_tpot_s``, ``p99_ttft_ms`` and
``p99_ttft_s``, ``throughput_tok_s``, ``completed``, ``submitted``, ``rejected``,
``prefix_hit_rate`` first, then the other metrics, ``goodput_req_s`` among them; latency
distributions in ms, as `serve_jax.metrics` reports them for every command) and a PNG next to it
with the TPOT CDF of each policy and its cumulative preemptions over time.

The check of the simulator against the real engine is its own command,
``python -m serve_jax crosscheck`` (`serve_jax.crosscheck_cli`), so this one never loads JAX.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from tqdm import tqdm

from serve_jax.cli_args import (
    add_policy_args,
    add_slo_args,
    add_tqdm_flag,
    add_workload_args,
    policy_names,
    workload_config,
)
from serve_jax.preemption import POLICY_NAMES, make_policy
from serve_jax.simulator import SimConfig, SimulationResult, simulate
from serve_jax.workloads import WorkloadConfig, build_workload
from tapas_jax.commands import command_parser, write_json
from tapas_jax.config import load_config, preset_path

__all__ = [
    "main",
    "build_parser",
    "load_sim_config",
    "plot_results",
    "preemption_curve",
    "best_baseline_ratios",
    "goals",
    "BASELINES",
]

_FLAGS = {
    "model": (str, "served model preset (llama-7b, llama-13b, llama3-8b, tiny, small)"),
    "hardware": (str, "chip profile (h100, h200, tpu-v5e, ...)"),
    "kv_memory_gb": (float, "device memory for the KV cache, GB (<= 0: HBM left after weights)"),
    "host_memory_gb": (float, "host KV memory, GB"),
    "block_size": (int, "tokens per KV block"),
    "max_num_seqs": (int, "most requests running at once"),
    "max_num_batched_tokens": (int, "token budget per step"),
    "cascade_window_s": (float, "a re-preemption within this many seconds is a cascade"),
}
"""SimConfig fields that also have a flag (as tapas_jax's plan does): ``--kv-memory-gb 8`` is
``kv_memory_gb=8``."""


def build_parser(prog: str = "simulate") -> argparse.ArgumentParser:
    """The command-line parser of ``simulate``."""
    p = command_parser(
        "serve_jax",
        prog,
        SimConfig,
        description="Compare preemption policies on a workload with the trace-driven simulator.",
        example="kv_memory_gb=16",
    )
    for name, (typ, text) in _FLAGS.items():
        p.add_argument(
            "--" + name.replace("_", "-"), dest=name, type=typ, help=f"{text}; same as {name}=..."
        )
    p.add_argument(
        "--vllm-admission",
        action="store_true",
        help="no admission in a step that preempted (vLLM V1's rule, the default for every "
        "policy); same as no_admission_after_preemption=true",
    )
    add_workload_args(p, WorkloadConfig(name="reasoning"))
    add_policy_args(p)
    add_slo_args(p, None, None)
    p.add_argument("--json", default=None, help="write the rows here (and a PNG next to it)")
    add_tqdm_flag(p)
    p.add_argument("--png", default=None, help="PNG path (default: the JSON path with .png)")
    return p


def load_sim_config(args: argparse.Namespace) -> SimConfig:
    """The `SimConfig` of ``--config``, then the flags, then the (non-engine) overrides."""
    path = preset_path("serve", args.config) if args.config else None
    overrides = []
    for name in _FLAGS:
        value = getattr(args, name)
        if name == "kv_memory_gb" and value is not None and value <= 0:
            value = "null"
        if value is not None:
            overrides.append(f"{name}={value}")
    if args.vllm_admission:
        overrides.append("no_admission_after_preemption=true")
    if args.slo_ttft_ms is not None:
        overrides.append(f"slo_ttft_ms={args.slo_ttft_ms}")
    if args.slo_tpot_ms is not None:
        overrides.append(f"slo_tpot_ms={args.slo_tpot_ms}")
    overrides += args.overrides
    return load_config(SimConfig, path, overrides)


def _make_policy(name: str, args: argparse.Namespace):
    """A fresh policy, with the predictive options of the command line."""
    return make_policy(name, args.gate_quantile, args.cheap_preemption_steps)


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
        ("p99_tpot_ms", "p99_tpot_ms"),
        (("tpot_ms", "median"), "p50_tpot_ms"),
        ("p99_ttft_ms", "p99_ttft_ms"),
        ("throughput_tok_s", "tok/s"),
        ("wasted_recompute_tokens", "wasted_tok"),
        ("goodput_req_s", "goodput"),
        ("prefix_hit_rate", "prefix_hit"),
        ("completed", "done"),
        ("rejected", "rej"),
        ("submitted", "sub"),
        ("sim_wall_s", "wall_s"),
    ]

    def cell(row: dict[str, Any], key) -> str:
        return _fmt(row[key[0]][key[1]] if isinstance(key, tuple) else row[key])

    rows = [[cell(r.row(), k) for k, _ in cols] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, (_, h) in enumerate(cols)]
    print("  ".join(h.ljust(w) for (_, h), w in zip(cols, widths)))
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def _div(a: float, b: float) -> float:
    return a / b if b else (math.inf if a else 1.0)


def _ratios(results: list[SimulationResult]) -> dict[str, float] | None:
    """``predictive`` against ``fcfs_last`` (None unless both ran)."""
    by = {r.policy: r.row() for r in results}
    if "predictive" not in by or "fcfs_last" not in by:
        return None
    p, f = by["predictive"], by["fcfs_last"]
    return {
        "preemption_reduction_x": _div(f["preemptions"], p["preemptions"]),
        "p99_tpot_reduction_x": _div(f["p99_tpot_ms"], p["p99_tpot_ms"]),
        "throughput_ratio": _div(p["throughput_tok_s"], f["throughput_tok_s"]),
        "p99_ttft_ratio": _div(p["p99_ttft_ms"], f["p99_ttft_ms"]),
    }


BASELINES = tuple(n for n in POLICY_NAMES if not n.startswith("predictive"))
"""The baselines ``predictive`` is judged against (`best_baseline_ratios`)."""


def best_baseline_ratios(
    results: list[SimulationResult], name: str = "predictive"
) -> dict[str, Any] | None:
    """The policy row ``name`` against the best baseline of the run on each metric (the issue's
    goals: preemptions and p99 TPOT reduction, throughput, goodput and p99 TTFT ratios), with the
    baseline that was best; None unless ``name`` and a baseline ran. Baselines are the other
    rows, less ``predictive`` and its ablations."""
    rows = [r.row() for r in results]
    pred = next((r for r in rows if r["policy"] == name), None)
    base = [r for r in rows if r["policy"] != name and not r["policy"].startswith("predictive")]
    if pred is None or not base:
        return None

    def best(key: str, lower: bool) -> dict[str, Any]:
        return (min if lower else max)(base, key=lambda r: r[key])

    b_pre, b_tpot = best("preemptions", True), best("p99_tpot_ms", True)
    b_tput, b_good = best("throughput_tok_s", False), best("goodput_req_s", False)
    b_ttft = best("p99_ttft_ms", True)
    return {
        "preemption_reduction_x": _div(b_pre["preemptions"], pred["preemptions"]),
        "preemptions_best": b_pre["policy"],
        "p99_tpot_reduction_x": _div(b_tpot["p99_tpot_ms"], pred["p99_tpot_ms"]),
        "p99_tpot_best": b_tpot["policy"],
        "throughput_ratio": _div(pred["throughput_tok_s"], b_tput["throughput_tok_s"]),
        "throughput_best": b_tput["policy"],
        "goodput_ratio": _div(pred["goodput_req_s"], b_good["goodput_req_s"]),
        "goodput_best": b_good["policy"],
        "p99_ttft_ratio": _div(pred["p99_ttft_ms"], b_ttft["p99_ttft_ms"]),
        "p99_ttft_best": b_ttft["policy"],
    }


def goals(r: dict[str, Any]) -> dict[str, bool]:
    """The issue's five goals for one ratio row of `best_baseline_ratios`: >= 5x fewer
    preemptions, >= 2x lower p99 TPOT, throughput >= 0.99x, goodput >= 1x, p99 TTFT <= 1.1x."""
    return {
        "preemptions_5x": r["preemption_reduction_x"] >= 5,
        "p99_tpot_2x": r["p99_tpot_reduction_x"] >= 2,
        "throughput_0.99": r["throughput_ratio"] >= 0.99,
        "goodput_1x": r["goodput_ratio"] >= 1.0,
        "p99_ttft_1.1x": r["p99_ttft_ratio"] <= 1.1,
    }


def _with_seconds(row: dict[str, Any]) -> dict[str, Any]:
    """The row with ``p99_tpot_s`` and ``p99_ttft_s`` after their ms keys: the keys issue 13
    names for these rows (and the JSON had before latencies moved to ms)."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        out[key] = value
        if key in ("p99_tpot_ms", "p99_ttft_ms"):
            out[key[:-3] + "_s"] = value / 1e3
    return out


CDF_POINTS = 2000
"""Points of a drawn TPOT CDF at most (see `plot_results`)."""


def preemption_curve(r: SimulationResult) -> tuple[Any, Any]:
    """(times, cumulative preemptions) of a run, drawn as a step line: from 0 through each
    preemption to the run's end (its last finish, in the same absolute simulated time as
    ``preemption_times``; ``makespan_s`` counts from the first arrival)."""
    import numpy as np

    pt = np.sort(r.preemption_times)
    end = max(r.start_s + r.makespan_s, pt[-1] if len(pt) else 0.0)
    times = np.concatenate([[0.0], pt, [end]])
    return times, np.concatenate([np.arange(len(pt) + 1), [len(pt)]])


def plot_results(results: list[SimulationResult], path: str | Path, title: str = "") -> None:
    """Writes a PNG: TPOT CDF per policy (left), cumulative preemptions over time (right).

    A CDF of more than ``CDF_POINTS`` requests is drawn through that many evenly spaced order
    statistics (first and last included): the picture is the same at any printable size."""
    import numpy as np
    from matplotlib.figure import Figure  # (no pyplot: no global figure state, no GUI backend)

    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    for r in results:
        t = np.sort(r.tpots_ms)
        if len(t):
            rank = np.unique(np.linspace(0, len(t) - 1, min(len(t), CDF_POINTS)).astype(int))
            ax1.plot(t[rank], (rank + 1) / len(t), label=r.policy)
        ax2.step(*preemption_curve(r), where="post", label=r.policy)
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


def main(argv: list[str]) -> int:
    """Runs the ``simulate`` command; ``argv[0]`` is the command name."""
    args = build_parser(argv[0] if argv else "simulate").parse_args(argv[1:])
    policies = policy_names(args)
    for name in policies:
        _make_policy(name, args)  # an unknown name fails before any work
    config = load_sim_config(args)
    wcfg = workload_config(args)
    workload = build_workload(wcfg)
    costs = config.cost_model()
    blocks = config.num_device_blocks or costs.kv_capacity_blocks(config.kv_memory_gb)
    s = workload.summary()
    print(
        f"workload {workload.name}: {len(workload.requests)} requests over "
        f"{workload.duration_s:.0f} s, prompt mean {s.get('prompt_mean', 0):.0f}, output mean "
        f"{s.get('output_mean', 0):.0f} tokens; {config.model} on {config.hardware}, KV "
        f"{blocks} blocks x {config.block_size} tokens ({blocks * config.block_size} tokens)"
    )
    results = []
    for name in policies:
        with tqdm(
            total=round(workload.duration_s),
            desc=name,
            unit="sim s",
            disable=args.disable_tqdm,
            leave=False,
        ) as bar:

            def advance(now: float, bar=bar) -> None:
                if bar.n < bar.total and now - bar.n >= 1.0:  # whole simulated seconds
                    bar.update(min(int(now), bar.total) - bar.n)

            progress = None if args.disable_tqdm else advance
            res = simulate(workload, _make_policy(name, args), config, progress=progress)
        results.append(res)
    _print_table(results)
    ratios = _ratios(results)
    if ratios:
        print("predictive vs fcfs_last: " + ", ".join(f"{k} {_fmt(v)}" for k, v in ratios.items()))
    vs_best = best_baseline_ratios(results)
    if vs_best:
        print(
            "predictive vs the best baseline: "
            + ", ".join(f"{k} {_fmt(v)}" for k, v in vs_best.items())
        )
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
            row = _with_seconds(r.row())
            row.update(
                model=config.model,
                hardware=config.hardware,
                kv_memory_gb=config.kv_memory_gb,
                rate_scale=wcfg.rate_scale,
                vllm_admission=config.no_admission_after_preemption,
            )
            if ratios and r.policy == "predictive":
                row["vs_fcfs_last"] = ratios
            if vs_best and r.policy == "predictive":
                row["vs_best_baseline"] = vs_best
            rows.append(row)
        path = Path(args.json)
        png = Path(args.png) if args.png else path.with_suffix(".png")
        write_json(path, rows)
        png.parent.mkdir(parents=True, exist_ok=True)
        kv = "HBM left" if config.kv_memory_gb is None else f"{config.kv_memory_gb:g} GB"
        title = (
            f"{workload.name}, {config.model} on {config.hardware}, "
            f"KV {kv}, rate x{wcfg.rate_scale:g}"
        )
        plot_results(results, png, title)
        print(f"wrote {png}")
    return 0
