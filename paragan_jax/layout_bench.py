"""``python -m paragan_jax layout``: padding waste and CPU time of a discriminator stem in three
layouts.

The first convolution of a discriminator (forward + kernel gradient) as NCHW, NHWC and NHWC on a
space-to-depth input (`paragan_jax.layout.conv_s2d`), for a DCGAN and a BigGAN stem in float32
and bfloat16. Padding waste comes from the compiled HLO priced under the TPU and GPU tile models
(`paragan_jax.layout.padding_waste`); CPU time is the median of interleaved repetitions;
the relative error is the largest gradient difference from the NHWC reference over its largest
value. Settings are `LayoutBenchCommand` (``--config``, flags, ``key=value`` overrides).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from tapas_jax.commands import write_json

from .command_config import command_config_parser, load_command_config
from .layout import conv_nhwc, conv_s2d, host_space_to_depth, padding_waste

__all__ = ["LayoutBenchCommand", "bench", "main"]


@dataclasses.dataclass(frozen=True)
class LayoutBenchCommand:
    """Settings of ``python -m paragan_jax layout``."""

    batch: int = 32
    """Batch of the DCGAN stem (the BigGAN stem runs a quarter of it)."""
    reps: int = 15
    """Timed repetitions of each variant (interleaved)."""
    json: str | None = None
    """Write the rows and the backend here."""

    def __post_init__(self):
        if self.batch < 1 or self.reps < 1:
            raise ValueError(f"need batch >= 1 and reps >= 1, got {self.batch} and {self.reps}")


def _stem_variants(batch: int, size: int, cout: int, stride: int, dtype):
    """(name, fn, args) of one discriminator stem in three layouts, forward + kernel gradient."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((batch, size, size, 3)), dtype)
    w = jnp.asarray(rng.standard_normal((3, 3, 3, cout)) * 0.1, dtype)

    def loss_nchw(w_oihw, x_nchw):
        y = jax.lax.conv_general_dilated(
            x_nchw, w_oihw, (stride, stride), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW")
        )
        return jnp.sum(jnp.square(y.astype(jnp.float32)))

    def loss_nhwc(w, x):
        return jnp.sum(jnp.square(conv_nhwc(x, w, stride).astype(jnp.float32)))

    def loss_s2d(w, xs):
        return jnp.sum(jnp.square(conv_s2d(xs, w, 2, stride).astype(jnp.float32)))

    xs = jnp.asarray(host_space_to_depth(np.asarray(x), 2))
    return [
        ("NCHW", jax.grad(loss_nchw), (w.transpose(3, 2, 0, 1), x.transpose(0, 3, 1, 2))),
        ("NHWC", jax.grad(loss_nhwc), (w, x)),
        ("NHWC+s2d", jax.grad(loss_s2d), (w, xs)),
    ]


def bench(args: LayoutBenchCommand) -> list[dict]:
    """Padding waste (TPU and GPU tile models) and CPU time of three stem layouts: one row per
    case, dtype and layout, printed as a table and returned."""
    cases = [
        ("dcgan stem 3->64 s2, 32x32", args.batch, 32, 64, 2),
        ("biggan stem 3->128 s1, 64x64", max(1, args.batch // 4), 64, 128, 1),
    ]
    out = []
    for title, batch, size, cout, stride in cases:
        for dtype in (jnp.float32, jnp.bfloat16):
            variants = _stem_variants(batch, size, cout, stride, dtype)
            ref = np.asarray(variants[1][1](*variants[1][2]), np.float32)
            fns = [jax.jit(f) for _, f, _ in variants]
            for f, (_, _, a) in zip(fns, variants):
                jax.block_until_ready(f(*a))
            times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
            for _ in range(args.reps):  # interleaved: drifting load hits all alike
                for f, (name, _, a) in zip(fns, variants):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*a))
                    times[name].append(time.perf_counter() - t0)
            for f, (name, fn, a) in zip(fns, variants):
                g = np.asarray(f(*a), np.float32)
                if name == "NCHW":
                    g = g.transpose(2, 3, 1, 0)
                row = {
                    "case": title,
                    "batch": batch,
                    "dtype": jnp.dtype(dtype).name,
                    "layout": name,
                    "cpu_ms": 1e3 * float(np.median(times[name])),
                    "grad_max_rel_err": float(np.abs(g - ref).max() / np.abs(ref).max()),
                }
                for tile in ("tpu", "gpu"):
                    w = padding_waste(fn, *a, tile=tile)
                    row[f"{tile}_waste"] = w["waste"]
                    row[f"{tile}_tiled_mib"] = w["tiled_bytes"] / 2**20
                out.append(row)
    print(
        f"{'case':<30} {'dtype':<8} {'layout':<9} {'TPU waste':>9} {'TPU MiB':>8} "
        f"{'GPU waste':>9} {'CPU ms':>8} {'rel err':>8}"
    )
    for r in out:
        print(
            f"{r['case']:<30} {r['dtype']:<8} {r['layout']:<9} {r['tpu_waste']:9.1%} "
            f"{r['tpu_tiled_mib']:8.2f} {r['gpu_waste']:9.1%} {r['cpu_ms']:8.2f} "
            f"{r['grad_max_rel_err']:8.1e}"
        )
    return out


def main(argv: list[str]) -> int:
    """``python -m paragan_jax layout [--config preset] [--flags] [key=value ...]``."""
    parser = command_config_parser(
        "layout",
        LayoutBenchCommand,
        "Padding waste (TPU and GPU tile models) and CPU time of three stem layouts.",
    )
    cfg = load_command_config(LayoutBenchCommand, parser.parse_intermixed_args(argv[1:]))
    rows = bench(cfg)
    write_json(cfg.json, {"rows": rows, "backend": jax.default_backend()})
    return 0
