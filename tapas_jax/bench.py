"""``python -m tapas_jax bench``: the folded search against the integer program, layer by layer.

For each depth, the GPT training step is traced once; then, on the same cost model:

- *tapas*: fold repeated layers, lower the representatives, solve by dynamic programming;
- *ILP*: lower the unfolded graph and solve Alpa's integer program with HiGHS (time limit);
- *Megatron*: the hand-written Megatron-LM param specs, with the remaining choices optimised.

Search times exclude tracing (shared by both) and include lowering, which is where the folded
search saves the most besides the solve. Both wall-clock and process CPU seconds are recorded:
on a shared machine CPU time is the steadier of the two. Rows are printed as a table and
written as JSON with a log-scale plot of search time against depth next to it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import zoo
from .commands import command_parser
from .config import BenchConfig, load_config, preset_path
from .cost import build_problem
from .fold import fold_repeated_blocks, no_folding
from .graph import build_graph
from .hardware import get_profile
from .ilp import solve_ilp
from .mesh import parse_mesh_spec
from .planner import cost_with_param_specs
from .search import solve

__all__ = ["main", "bench_row", "build_parser", "config_from_args"]


def bench_row(
    layers: int,
    dims: dict,
    mesh_axes: dict[str, int],
    hardware: str,
    time_limit: float,
    batch_axis: str | None = "data",
) -> dict:
    """One row of the benchmark: search seconds and plan cost of tapas, ILP and Megatron."""
    hw = get_profile(hardware)
    model = zoo.build("gpt", layers=layers, **dims)
    t0 = time.perf_counter()
    graph = build_graph(model.fn, model.params, *model.inputs)
    trace = time.perf_counter() - t0

    t0, c0 = time.perf_counter(), time.process_time()
    folding = fold_repeated_blocks(graph)
    lowered = build_problem(graph, mesh_axes, hw, folding, batch_axis=batch_axis)
    tapas = solve(lowered.problem, hw.hbm_bytes, time_limit=time_limit)
    tapas_seconds, tapas_cpu = time.perf_counter() - t0, time.process_time() - c0

    t0, c0 = time.perf_counter(), time.process_time()
    unfolded = build_problem(graph, mesh_axes, hw, no_folding(graph), batch_axis=batch_axis)
    ilp = solve_ilp(unfolded.problem, hw.hbm_bytes, time_limit=time_limit)
    ilp_seconds, ilp_cpu = time.perf_counter() - t0, time.process_time() - c0

    megatron = cost_with_param_specs(lowered, zoo.megatron_rules)
    return {
        "layers": layers,
        "tapas_seconds": tapas_seconds,
        "ilp_seconds": ilp_seconds,
        "tapas_cost": tapas.objective,
        "ilp_cost": ilp.objective,
        "megatron_cost": megatron,
        "tapas_cpu_seconds": tapas_cpu,
        "ilp_cpu_seconds": ilp_cpu,
        "speedup": ilp_seconds / tapas_seconds,
        "cpu_speedup": ilp_cpu / tapas_cpu,
        "cost_ratio": tapas.objective / ilp.objective,
        "tapas_method": tapas.method,
        "ilp_optimal": ilp.optimal,
        "ilp_status": ilp.status,
        "ilp_variables": ilp.num_variables,
        "ilp_nodes": len(unfolded.problem.sizes),
        "folded_nodes": len(lowered.problem.sizes),
        "eqns": len(graph.eqns),
        "eqns_folded": folding.eqns_after,
        "trace_seconds": trace,
    }


def _plot(rows: list[dict], path: Path) -> bool:
    """Writes the search-time plot; False when matplotlib (an optional library) is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    fig, ax = plt.subplots(figsize=(5, 3.5))
    xs = [r["layers"] for r in rows]
    ax.plot(xs, [r["tapas_seconds"] for r in rows], "o-", label="tapas (folded DP)")
    ax.plot(xs, [r["ilp_seconds"] for r in rows], "s-", label="ILP (HiGHS, unfolded)")
    ax.plot(
        xs,
        [r["tapas_cpu_seconds"] for r in rows],
        "o--",
        color="C0",
        alpha=0.6,
        label="tapas, CPU time",
    )
    ax.plot(
        xs,
        [r["ilp_cpu_seconds"] for r in rows],
        "s--",
        color="C1",
        alpha=0.6,
        label="ILP, CPU time",
    )
    ax.set_yscale("log")
    ax.set_xlabel("GPT layers")
    ax.set_ylabel("search time (s)")
    ax.set_title("sharding search time, data=2 x model=4")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


_FLAGS = {
    "d_model": int,
    "heads": int,
    "seq_len": int,
    "batch": int,
    "vocab": int,
    "mesh": str,
    "hardware": str,
    "time_limit": float,
    "space": str,
}


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from a YAML file, then flags, then ``key=value`` overrides."""
    overrides = [f"{k}={getattr(args, k)}" for k in _FLAGS if getattr(args, k) is not None]
    if args.layers is not None:
        try:
            depths = [int(x) for x in args.layers.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"--layers {args.layers!r} is not a comma-separated list of integers"
            ) from None
        overrides.append(f"layers=[{','.join(map(str, depths))}]")
    if args.no_warmup:
        overrides.append("warmup=false")
    path = preset_path("tapas", args.config) if args.config else None
    cfg = load_config(BenchConfig, path, overrides + list(args.overrides))
    if cfg.space not in ("batch", "full"):
        raise ValueError(f"space must be batch or full, not {cfg.space!r}")
    if not cfg.layers:
        raise ValueError("layers is empty: give at least one depth")
    return cfg


def build_parser() -> argparse.ArgumentParser:
    """The bench parser: ``--config``, flags and ``key=value`` overrides of BenchConfig."""
    p = command_parser(
        "tapas_jax", "bench", BenchConfig, description=__doc__, example="layers=[2,4]"
    )
    p.add_argument("--layers", help="comma-separated depths, e.g. 2,4,8 (same as layers=[2,4,8])")
    for name, typ in _FLAGS.items():
        flag = "--" + name.replace("_", "-")
        p.add_argument(flag, dest=name, type=typ, default=None, help=f"same as {name}=...")
    p.add_argument("--no-warmup", action="store_true", help="same as warmup=false")
    p.add_argument("--json", default="bench.json", help="rows as JSON, the plot next to it")
    return p


def main(argv: list[str]) -> int:
    """Runs the benchmark; ``argv[0]`` is the command name."""
    args = build_parser().parse_args(argv[1:])
    cfg = config_from_args(args)
    depths = list(cfg.layers)
    pairs = [kv.split("=") for kv in cfg.mesh.split(",")]
    mesh_axes = parse_mesh_spec(cfg.mesh, _product(pairs))
    dims = {
        "d_model": cfg.d_model,
        "heads": cfg.heads,
        "seq_len": cfg.seq_len,
        "batch": cfg.batch,
        "vocab": cfg.vocab,
    }
    # Warm up imports and caches once (untimed) so the first row is not charged for them.
    batch_axis = "data" if cfg.space == "batch" else None
    if cfg.warmup:
        bench_row(min(depths), dims, mesh_axes, cfg.hardware, cfg.time_limit, batch_axis)
    rows = []
    head = (
        f"{'layers':>6} {'tapas s':>8} {'ILP s':>8} {'speedup':>8} {'tapas cpu':>9} "
        f"{'ILP cpu':>8} {'cpu x':>7} {'tapas cost':>12} {'ILP cost':>12} {'megatron':>12} "
        f"{'cost ratio':>10} {'ILP opt':>7}"
    )
    print(head)
    for n in depths:
        r = bench_row(n, dims, mesh_axes, cfg.hardware, cfg.time_limit, batch_axis)
        rows.append(r)
        print(
            f"{n:>6} {r['tapas_seconds']:>8.3f} {r['ilp_seconds']:>8.2f} {r['speedup']:>7.1f}x "
            f"{r['tapas_cpu_seconds']:>9.3f} {r['ilp_cpu_seconds']:>8.2f} "
            f"{r['cpu_speedup']:>6.1f}x {r['tapas_cost'] * 1e3:>10.4f}ms "
            f"{r['ilp_cost'] * 1e3:>10.4f}ms {r['megatron_cost'] * 1e3:>10.4f}ms "
            f"{r['cost_ratio']:>10.6f} {str(r['ilp_optimal']):>7}",
            flush=True,
        )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "mesh": mesh_axes,
        "hardware": cfg.hardware,
        "dims": dims,
        "time_limit": cfg.time_limit,
        "space": cfg.space,
    }
    out.write_text(json.dumps({"rows": rows, "config": meta}, indent=1))
    png = out.with_suffix(".png")
    if _plot(rows, png):
        print(f"wrote {out} and {png}")
    else:
        print(f"wrote {out} (no plot: matplotlib is not installed; pip install matplotlib)")
    return 0


def _product(pairs) -> int:
    n = 1
    for _, v in pairs:
        n *= max(int(v), 1)
    return n
