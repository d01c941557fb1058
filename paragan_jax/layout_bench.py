"""``python -m paragan_jax layout``: padding waste and CPU time of a discriminator stem in three
layouts.

The first convolution of a discriminator (forward + kernel gradient) as NCHW, NHWC and NHWC on a
space-to-depth input (`paragan_jax.layout.conv_s2d`), for a DCGAN and a BigGAN stem in float32
and bfloat16. Padding waste comes from the compiled HLO priced under the TPU and GPU tile models
(`paragan_jax.layout.padding_waste`); CPU time is the median of interleaved repetitions;
the relative error is the largest gradient difference from the NHWC reference over its largest
value. Settings are `LayoutBenchCommand` (``--config``, flags, ``key=value`` overrides).

``--train-step`` adds the whole synchronous training step (`paragan_jax.steps.make_sync_step`:
D and G updates and the EMA, compiled for one CPU device, never run) of a DCGAN and a BigGAN on
32x32 RGB images, priced under the TPU tile model (`train_step_waste`): its tiled bytes, the share
of the thin full-resolution 3-channel arrays (real and fake images and their gradients), and the
bound on what space-to-depth could save if real batches came converted from the host and G
emitted its fakes in that layout at no other cost: those arrays priced as ``(H/2, W/2, 12)``.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from tapas_jax.commands import write_json
from tapas_jax.mesh import make_mesh

from .command_config import command_config_parser, load_command_config
from .config import load_train_config
from .layout import (
    DTYPE_BYTES,
    TILES,
    conv_nhwc,
    conv_s2d,
    hlo_array_shapes,
    host_space_to_depth,
    padding_waste,
)
from .state import (
    StateLayout,
    batch_struct,
    graphdefs,
    init_train_state,
    make_optimizer,
    state_shardings,
)
from .steps import make_sync_step

__all__ = ["LayoutBenchCommand", "bench", "main", "train_step_waste"]


@dataclasses.dataclass(frozen=True)
class LayoutBenchCommand:
    """Settings of ``python -m paragan_jax layout``."""

    batch: int = 32
    """Batch of the DCGAN stem (the BigGAN stem runs a quarter of it)."""
    reps: int = 15
    """Timed repetitions of each variant (interleaved)."""
    json: str | None = None
    """Write the rows and the backend here."""
    train_step: bool = False
    """Also price whole training steps (`train_step_waste`; a few minutes of compiling)."""

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


def train_step_waste(preset: str, overrides: list[str]) -> dict:
    """TPU tile model over every array of a compiled sync training step (3-channel images).

    Returns:
      ``tiled_mib``, ``waste``, ``thin_arrays`` and ``thin_share`` (full-resolution 3-channel
      arrays: count and share of tiled bytes), ``s2d_bound_mib`` / ``s2d_bound_saving`` (those
      arrays priced as ``(N, H/2, W/2, 12)``, nothing else changed) and ``arrays``.
    """
    cfg = load_train_config(preset, [*overrides, "model.channels=3", "sharding.num_devices=1"])
    mesh = make_mesh("data=1", jax.devices()[:1])
    tx_g, tx_d = make_optimizer(cfg.optim_g), make_optimizer(cfg.optim_d)
    g_def, d_def = graphdefs(cfg)
    abstract = jax.eval_shape(init_train_state(cfg, tx_g, tx_d))
    sh = state_shardings(cfg, mesh, abstract, g_def, d_def)
    batch_sh = NamedSharding(mesh, P(None, "data"))
    layout = StateLayout(g_def, d_def, tx_g, tx_d, mesh, sh, batch_sh, abstract)
    r = cfg.model.resolution
    state = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, sh
    )
    step = make_sync_step(cfg, layout).lower(state, batch_struct(cfg, layout, (r, r, 3)))
    tile = TILES["tpu"]
    logical = tiled = thin = thin_s2d = n_thin = 0
    shapes = hlo_array_shapes(step.compile().as_text())
    for dt, dims, mtm in shapes:
        size = DTYPE_BYTES[dt]
        t = tile.padded_elements([dims[i] for i in mtm], size) * size
        logical, tiled = logical + int(np.prod(dims)) * size, tiled + t
        if len(dims) == 4 and dims[1:3] == (r, r) and dims[mtm[0]] == 3:
            s2d = (dims[0], r // 2, r // 2, 12)
            n_thin, thin = n_thin + 1, thin + t
            thin_s2d += tile.padded_elements([s2d[i] for i in mtm], size) * size
    bound = tiled - thin + thin_s2d
    return {
        "arrays": len(shapes),
        "tiled_mib": tiled / 2**20,
        "waste": 1 - logical / tiled,
        "thin_arrays": n_thin,
        "thin_share": thin / tiled,
        "s2d_bound_mib": bound / 2**20,
        "s2d_bound_saving": 1 - bound / tiled,
    }


_STEP_CASES = {
    "dcgan 32x32 w32 f32": ["model.arch=dcgan", "model.resolution=32"],
    "biggan 32x32 w32 f32": ["model.arch=biggan", "model.resolution=32"],
}


def _train_step_rows() -> list[dict]:
    common = ["model.g_width=32", "model.d_width=32", "data.batch_size=16", "model.z_dim=32"]
    common.append("model.shared_dim=32")
    rows = []
    print(f"{'train step':<22} {'TPU MiB':>9} {'waste':>6} {'thin':>5} {'share':>6} {'bound':>6}")
    for name, over in _STEP_CASES.items():
        row = {"case": name, **train_step_waste("tiny", [*over, *common])}
        rows.append(row)
        print(
            f"{name:<22} {row['tiled_mib']:9.2f} {row['waste']:6.1%} {row['thin_arrays']:5d} "
            f"{row['thin_share']:6.1%} {-row['s2d_bound_saving']:6.1%}"
        )
    return rows


def main(argv: list[str]) -> int:
    """``python -m paragan_jax layout [--config preset] [--flags] [key=value ...]``."""
    parser = command_config_parser(
        "layout",
        LayoutBenchCommand,
        "Padding waste (TPU and GPU tile models) and CPU time of three stem layouts.",
    )
    cfg = load_command_config(LayoutBenchCommand, parser.parse_intermixed_args(argv[1:]))
    rows = bench(cfg)
    out = {"rows": rows, "backend": jax.default_backend()}
    if cfg.train_step:
        out["train_step"] = _train_step_rows()
    write_json(cfg.json, out)
    return 0
