"""``python -m tapas_jax info``: the devices JAX sees, a resolved mesh and the hardware profiles."""

from __future__ import annotations

import jax

from .commands import command_parser
from .config import InfoConfig, load_config, preset_path
from .hardware import PROFILES
from .mesh import make_mesh


def main(argv: list[str]) -> int:
    """Prints the devices, the resolved mesh and a table of the hardware profiles."""
    parser = command_parser(
        "tapas_jax", "info", InfoConfig, description=__doc__, example="mesh=data=2,model=4"
    )
    parser.add_argument("--mesh", help="same as mesh=..., e.g. data=2,model=4")
    args = parser.parse_args(argv[1:])
    path = preset_path("tapas", args.config) if args.config else None
    flags = [f"mesh={args.mesh}"] if args.mesh is not None else []
    cfg = load_config(InfoConfig, path, flags + list(args.overrides))
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {jax.device_count()} devices")
    mesh = make_mesh(cfg.mesh)
    print(f"mesh {dict(mesh.shape)} axis types {mesh.axis_types}")
    print(f"{'profile':<9} {'bf16 TFLOP/s':>12} {'HBM GiB':>8} {'HBM TB/s':>9} {'axis GB/s':>9}")
    for p in PROFILES.values():
        print(
            f"{p.name:<9} {p.peak_flops / 1e12:>12.0f} {p.hbm_gib:>8.0f} "
            f"{p.hbm_bandwidth / 1e12:>9.2f} {p.axis_bandwidth / 1e9:>9.0f}"
        )
    return 0
