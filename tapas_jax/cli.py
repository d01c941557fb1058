"""``python -m tapas_jax plan | verify | bench``: the planner on zoo models from the command line.

- ``plan``: plans a zoo model on a mesh (a real one, or an abstract one with ``--num-devices``)
  and prints the plan table, the fold statistics and the search time; ``--json`` writes
  ``param_specs``, ``fold``, ``search_seconds`` and ``predicted``.
- ``verify``: plans, compiles on the local (simulated) devices, counts the collectives in the HLO
  and compares outputs with the unsharded function; ``--json`` writes ``predicted_comm_bytes``,
  ``compiled_comm_bytes``, ``collectives`` and ``max_abs_error``. Exits 1 when the numerics differ
  by more than 1e-5 relative.
- ``bench``: search time and plan cost of the folded search against the integer program
  (`tapas_jax.bench`).

Model and mesh options come from `tapas_jax.config.PlanConfig` (a preset via ``--config`` plus
flags and dotted ``key=value`` overrides). A bad mesh, hardware or model name, or a model that fits
no plan in the memory limit, is raised as a ValueError, which `tapas_jax.commands.dispatch` prints
as one line (exit status 2).
"""

from __future__ import annotations

import argparse
import sys
import time

from . import zoo
from .bench import main as bench_main
from .commands import command_parser, write_json
from .config import PlanConfig, load_config, preset_path
from .mesh import abstract_mesh, make_mesh
from .planner import plan
from .verification import verify

__all__ = ["main", "config_from_args", "build_model", "mesh_for"]

_FLAGS = {
    "model": str,
    "layers": int,
    "d_model": int,
    "heads": int,
    "seq_len": int,
    "batch": int,
    "vocab": int,
    "mesh": str,
    "num_devices": int,
    "hardware": str,
    "dtype": str,
    "memory_limit_gib": float,
}


def _parser(command: str) -> argparse.ArgumentParser:
    p = command_parser("tapas_jax", command, PlanConfig, description=__doc__, example="layers=8")
    for name, typ in _FLAGS.items():
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=typ,
            default=None,
            help=f"same as {name}=...",
        )
    p.add_argument("--json", help="write the result as JSON to this file")
    return p


def config_from_args(args: argparse.Namespace) -> PlanConfig:
    """PlanConfig from a preset, then flags, then ``key=value`` overrides."""
    path = preset_path("tapas", args.config) if args.config else None
    overrides = [f"{k}={getattr(args, k)}" for k in _FLAGS if getattr(args, k) is not None]
    return load_config(PlanConfig, path, overrides + list(args.overrides))


def build_model(cfg: PlanConfig, **extra):
    """The zoo model a config names."""
    return zoo.build(
        cfg.model,
        layers=cfg.layers,
        d_model=cfg.d_model,
        heads=cfg.heads,
        seq_len=cfg.seq_len,
        batch=cfg.batch,
        vocab=cfg.vocab,
        dtype=cfg.dtype,
        remat=cfg.remat,
        **extra,
    )


def mesh_for(cfg: PlanConfig):
    """A real mesh over the local devices, or an abstract one of ``num_devices`` chips."""
    if cfg.num_devices is not None:
        return abstract_mesh(cfg.mesh, cfg.num_devices)
    return make_mesh(cfg.mesh)


def _plan(argv: list[str]) -> int:
    args = _parser("plan").parse_args(argv[1:])
    cfg = config_from_args(args)
    t0 = time.perf_counter()
    mesh = mesh_for(cfg)
    model = build_model(cfg)
    limit = None if cfg.memory_limit_gib is None else cfg.memory_limit_gib * 2**30
    p = plan(
        model.fn,
        model.params,
        *model.inputs,
        mesh=mesh,
        hardware=cfg.hardware,
        memory_limit_bytes=limit,
    )
    total = time.perf_counter() - t0
    print(p)
    print(f"search {p.search_seconds:.3f} s; end to end (build, trace, fold, search) {total:.2f} s")
    payload = p.to_dict()
    payload["total_seconds"] = total
    payload["model"] = cfg.model
    payload["layers"] = cfg.layers
    write_json(args.json, payload)
    return 0


def _verify(argv: list[str]) -> int:
    args = _parser("verify").parse_args(argv[1:])
    cfg = config_from_args(args)
    if cfg.num_devices is not None:
        raise ValueError("verify compiles on local devices; drop --num-devices")
    mesh = mesh_for(cfg)
    model = build_model(cfg)
    limit = None if cfg.memory_limit_gib is None else cfg.memory_limit_gib * 2**30
    p = plan(
        model.fn,
        model.params,
        *model.inputs,
        mesh=mesh,
        hardware=cfg.hardware,
        memory_limit_bytes=limit,
    )
    print(p)
    t0 = time.perf_counter()
    r = verify(p, model.fn, model.init(0), *model.example_inputs(0))
    print(f"\ncompiled and ran in {time.perf_counter() - t0:.1f} s")
    print(f"collectives in HLO: {r.collectives}")
    print(
        f"comm bytes per device: predicted {r.predicted_comm_bytes:.0f}, compiled "
        f"{r.compiled_comm_bytes:.0f} (ratio {r.comm_ratio:.3f})"
    )
    print(f"max abs error {r.max_abs_error:.3g}, max relative error {r.max_rel_error:.3g}")
    payload = r.to_dict()
    payload["plan"] = p.to_dict()
    write_json(args.json, payload)
    ok = r.max_rel_error <= 1e-5
    if not ok:
        print("error: sharded outputs differ from the unsharded ones", file=sys.stderr)
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    """Entry point; ``argv[0]`` is the command name (plan, verify or bench)."""
    command = argv[0] if argv else "plan"
    if command == "plan":
        return _plan(argv)
    if command == "verify":
        return _verify(argv)
    if command == "bench":
        return bench_main(argv)
    raise ValueError(f"unknown tapas command {command!r}")
