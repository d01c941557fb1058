"""Hardware-aware layout of activations and the first convolutions, with padding waste measured.

Accelerators store the two minor dimensions of every array in fixed tiles: a TPU uses (8, 128)
tiles for 32-bit values and (16, 128) for bf16 (sublanes x lanes); GPU tensor cores want channel
(contraction) counts in multiples of 8 for 16-bit types. A 3-channel NHWC image has 3 useful
lanes out of 128 on a TPU (97.7% zero padding); NCHW puts the image width on the lanes, which
wastes as much for 32x32 images and hurts every later layer. The per-backend choice here:

- `choose_layout(backend)` returns a `LayoutPlan`: NHWC everywhere, the backend's tile, a channel
  multiple for layer widths, and a space-to-depth block for 3-channel input.
- `space_to_depth` / `depth_to_space` move 2x2 (or bxb) pixel blocks into channels; the host can
  apply it in the input pipeline (`host_space_to_depth`), so the device never holds the thin
  3-channel array.
- `conv_s2d` computes exactly the convolution ``conv(x, kernel, stride, padding)`` from the
  space-to-depth input: the kernel is rearranged by a constant gather (each new weight is one
  original tap or zero, so
  gradients flow to the original kernel and checkpoints do not depend on the layout); stride-1
  convolutions produce ``b*b*O`` channels at block resolution and are moved back with
  `depth_to_space`. Results equal the direct convolution up to float summation order.
- `pad_conv_channels` pads conv widths to the channel multiple with zero filters; the padded
  network computes the same function (tested).
- `padding_waste` compiles a function, reads every array shape (with its minor-to-major layout)
  materialised by the ENTRY computation of the optimised HLO, and prices each under a `TileModel`:
  waste = 1 - logical bytes / tiled bytes. On CPU the compiled layouts are row-major, so this
  measures the program's logical layout against the target's tiles; a TPU compiler may still
  re-layout some buffers on its own.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tapas_jax.hardware import HardwareProfile, get_profile

__all__ = [
    "DTYPE_BYTES",
    "LayoutPlan",
    "TileModel",
    "choose_layout",
    "conv_nhwc",
    "conv_s2d",
    "depth_to_space",
    "hlo_array_shapes",
    "host_space_to_depth",
    "pad_conv_channels",
    "padding_waste",
    "space_to_depth",
    "stem_conv",
    "tile_friendly_width",
]

Padding = str | tuple[tuple[int, int], tuple[int, int]]


@dataclasses.dataclass(frozen=True)
class TileModel:
    """How a backend pads the two minor dimensions of an array."""

    name: str
    second_minor: int
    """Tile extent on the second-most-minor dimension (TPU sublanes)."""
    minor: int
    """Tile extent on the most-minor dimension (TPU lanes, tensor-core channel multiple)."""
    bf16_second_minor: int | None = None
    """Second-minor tile for 16-bit types (TPU packs two bf16 per sublane: 16)."""

    def padded_elements(self, dims_minor_to_major: Sequence[int], itemsize: int) -> int:
        """Elements an array of these dims occupies once tiled."""
        dims = list(dims_minor_to_major)
        if not dims:
            return 1
        dims[0] = -(-dims[0] // self.minor) * self.minor
        if len(dims) > 1:
            sub = (
                self.bf16_second_minor
                if (itemsize == 2 and self.bf16_second_minor)
                else (self.second_minor)
            )
            dims[1] = -(-dims[1] // sub) * sub
        return int(np.prod(dims))


TILES = {
    "tpu": TileModel("tpu (8, 128)", 8, 128, bf16_second_minor=16),
    "gpu": TileModel("gpu tensor core (channels % 8)", 1, 8),
    "cpu": TileModel("cpu (none)", 1, 1),
}


@dataclasses.dataclass(frozen=True)
class LayoutPlan:
    """The layout choice for one backend."""

    backend: str
    """``tpu``, ``gpu`` or ``cpu``."""
    data_format: str
    """Activation layout; always ``NHWC`` (channels on the minor, tiled dimension)."""
    channel_multiple: int
    """Layer widths are best multiples of this (128 lanes on TPU, 8 on tensor cores)."""
    space_to_depth: int
    """Block size applied to 3-channel input before the first convolution (1 = off)."""
    tile: TileModel
    """The tile model the waste is priced with."""


def choose_layout(backend: str | HardwareProfile | None = None) -> LayoutPlan:
    """The layout for a backend (``tpu``/``gpu``/``cpu``, a hardware profile or its name).

    None uses ``jax.default_backend()``. TPU and GPU get space-to-depth 2 on 3-channel input
    (3 -> 12 channels: 4x fewer padded lanes on a TPU; on tensor cores 12 pads to 16 rather
    than 3 to 8); CPU has no tiles, so the plain NHWC layout is kept.
    """
    if backend is None:
        kind = jax.default_backend()
    elif isinstance(backend, HardwareProfile):
        kind = backend.kind
    elif backend in TILES:
        kind = backend
    else:
        kind = get_profile(backend).kind
    kind = {"cuda": "gpu", "rocm": "gpu"}.get(kind, kind)
    if kind not in TILES:
        raise ValueError(f"no layout for backend {backend!r}; known: tpu, gpu, cpu")
    multiple = {"tpu": 128, "gpu": 8, "cpu": 1}[kind]
    return LayoutPlan(kind, "NHWC", multiple, 1 if kind == "cpu" else 2, TILES[kind])


def tile_friendly_width(width: int, plan: LayoutPlan) -> int:
    """`width` rounded up to the plan's channel multiple (a model-config choice, not exact)."""
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    m = plan.channel_multiple
    return -(-width // m) * m


# --------------------------------------------------------------------------------------------
# Space-to-depth and the equivalent convolution.


def space_to_depth(x: jax.Array, block: int) -> jax.Array:
    """``(N, H, W, C) -> (N, H/b, W/b, b*b*C)``, channel order (row in block, col in block, c)."""
    n, h, w, c = x.shape
    if h % block or w % block:
        raise ValueError(f"space_to_depth: spatial size {h}x{w} is not divisible by {block}")
    x = x.reshape(n, h // block, block, w // block, block, c)
    return x.transpose(0, 1, 3, 2, 4, 5).reshape(n, h // block, w // block, block * block * c)


def depth_to_space(x: jax.Array, block: int) -> jax.Array:
    """Inverse of `space_to_depth`."""
    n, h, w, cb = x.shape
    if cb % (block * block):
        raise ValueError(f"depth_to_space: {cb} channels are not divisible by {block}^2")
    c = cb // (block * block)
    x = x.reshape(n, h, w, block, block, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(n, h * block, w * block, c)


def host_space_to_depth(images: np.ndarray, block: int) -> np.ndarray:
    """NumPy `space_to_depth` for the input pipeline (runs on the host, before transfer)."""
    n, h, w, c = images.shape
    if h % block or w % block:
        raise ValueError(f"host_space_to_depth: {h}x{w} is not divisible by {block}")
    x = images.reshape(n, h // block, block, w // block, block, c).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(x.reshape(n, h // block, w // block, block * block * c))


def _explicit_padding(
    padding: Padding, size: tuple[int, int], k: tuple[int, int], stride: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    if isinstance(padding, str):
        if padding.upper() == "VALID":
            return ((0, 0), (0, 0))
        if padding.upper() != "SAME":
            raise ValueError(f"padding must be 'SAME', 'VALID' or explicit pairs, got {padding!r}")
        out = []
        for n, kk in zip(size, k):
            total = max((-(-n // stride) - 1) * stride + kk - n, 0)
            out.append((total // 2, total - total // 2))
        return tuple(out)  # type: ignore[return-value]
    return tuple((int(lo), int(hi)) for lo, hi in padding)  # type: ignore[return-value]


def conv_nhwc(x: jax.Array, kernel: jax.Array, stride: int = 1, padding: Padding = "SAME"):
    """The reference convolution: NHWC input, HWIO kernel (what flax's Conv computes)."""
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _axis_taps(k: int, stride: int, pad_lo: int, block: int, n_out: int):
    """Kernel tap feeding each (block offset D', in-block input b, output sub-position a).

    For one spatial axis, output pixel ``m*P + a`` reads input ``s*(P + D) + b`` through tap
    ``d = s*D + b - stride*a + pad_lo``; for a given ``(D, b, a)`` that tap is unique, so the
    rearranged kernel is a gather, never a sum. Entries with no tap are -1 (zero weight).
    """
    m = block // stride  # output sub-positions per block (1 when stride == block)
    rs = [(a, d, stride * a + d - pad_lo) for a in range(m) for d in range(k)]
    dmin = min(r // block for _, _, r in rs)
    kk = max(r // block for _, _, r in rs) - dmin + 1
    taps = np.full((kk, block, m), -1, np.int64)
    for a, d, r in rs:
        taps[r // block - dmin, r % block, a] = d
    return taps, dmin, kk, m, -(-n_out // m)


def conv_s2d(
    xs: jax.Array,
    kernel: jax.Array,
    block: int,
    stride: int = 1,
    padding: Padding = "SAME",
    image_hw: tuple[int, int] | None = None,
) -> jax.Array:
    """``conv_nhwc(x, kernel, stride, padding)`` computed from ``xs = space_to_depth(x, block)``.

    Args:
      xs: ``(N, H/b, W/b, b*b*C)`` space-to-depth input.
      kernel: the ordinary HWIO kernel ``(kh, kw, C, O)``.
      block: the space-to-depth block b.
      stride: 1 or b (the two strides a stem uses).
      padding: as for `conv_nhwc`.
      image_hw: original ``(H, W)``; defaults to the block grid times b.

    Returns:
      The NHWC output of the original convolution.
    """
    if stride not in (1, block):
        raise ValueError(f"conv_s2d supports stride 1 or stride == block ({block}), got {stride}")
    n, hb, wb, cb = xs.shape
    kh, kw, c, o = kernel.shape
    if cb != block * block * c:
        raise ValueError(
            f"input has {cb} channels; a {block}x{block} block of {c} is {block**2 * c}"
        )
    h, w = image_hw or (hb * block, wb * block)
    if (h, w) != (hb * block, wb * block):
        raise ValueError(f"image {h}x{w} does not match the block grid {hb}x{wb} of {block}")
    (plh, phh), (plw, phw) = _explicit_padding(padding, (h, w), (kh, kw), stride)
    out_h = (h + plh + phh - kh) // stride + 1
    out_w = (w + plw + phw - kw) // stride + 1
    th, dmin_h, kkh, m, nbh = _axis_taps(kh, stride, plh, block, out_h)
    tw, dmin_w, kkw, _, nbw = _axis_taps(kw, stride, plw, block, out_w)
    # idx[D'h, D'w, bh, bw, ah, aw] -> flat tap dh*kw + dw, or kh*kw (an appended zero filter).
    vh, vw = th[:, None, :, None, :, None], tw[None, :, None, :, None, :]
    idx = np.where((vh >= 0) & (vw >= 0), vh * kw + vw, kh * kw)
    flat = jnp.concatenate([kernel.reshape(kh * kw, c, o), jnp.zeros((1, c, o), kernel.dtype)])
    w2 = flat[idx]  # (D'h, D'w, bh, bw, ah, aw, C, O)
    w2 = w2.transpose(0, 1, 2, 3, 6, 4, 5, 7).reshape(kkh, kkw, block * block * c, m * m * o)
    lo_h, lo_w = -dmin_h, -dmin_w
    hi_h = max(0, nbh + kkh - 1 - hb - lo_h)
    hi_w = max(0, nbw + kkw - 1 - wb - lo_w)
    y = jax.lax.conv_general_dilated(
        xs, w2, (1, 1), ((lo_h, hi_h), (lo_w, hi_w)), dimension_numbers=("NHWC", "HWIO", "NHWC")
    )[:, :nbh, :nbw, :]
    if m > 1:
        y = depth_to_space(y, m)
    return y[:, :out_h, :out_w, :]


def stem_conv(
    x: jax.Array,
    kernel: jax.Array,
    plan: LayoutPlan,
    stride: int = 1,
    padding: Padding = "SAME",
    input_is_s2d: bool = False,
    image_hw: tuple[int, int] | None = None,
) -> jax.Array:
    """The first convolution of a discriminator under a layout plan.

    Takes either the NHWC image (converted on device when the plan asks for space-to-depth) or,
    with ``input_is_s2d=True``, the host-side `host_space_to_depth` output. Returns NHWC.
    """
    b = plan.space_to_depth
    use_s2d = b > 1 and kernel.shape[2] == 3 and stride in (1, b)
    if input_is_s2d:
        if b <= 1:
            raise ValueError("input_is_s2d=True but the plan has no space-to-depth")
        return conv_s2d(x, kernel, b, stride, padding, image_hw)
    if use_s2d and x.shape[1] % b == 0 and x.shape[2] % b == 0:
        return conv_s2d(space_to_depth(x, b), kernel, b, stride, padding)
    return conv_nhwc(x, kernel, stride, padding)


def pad_conv_channels(kernel: jax.Array, bias: jax.Array | None, in_to: int, out_to: int):
    """Zero-pads an HWIO kernel (and bias) to ``in_to`` input and ``out_to`` output channels.

    The extra output channels are exactly zero (zero filters, zero bias), so a network whose every
    layer is padded computes the same values on the original channels.
    """
    kh, kw, c, o = kernel.shape
    if in_to < c or out_to < o:
        raise ValueError(f"cannot pad {c}->{in_to} / {o}->{out_to} channels: targets are smaller")
    k = jnp.pad(kernel, ((0, 0), (0, 0), (0, in_to - c), (0, out_to - o)))
    return k, None if bias is None else jnp.pad(bias, (0, out_to - o))


# --------------------------------------------------------------------------------------------
# Padding waste from compiled HLO.

DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\](?:\{([\d,]*)[^}]*\})?")


def hlo_array_shapes(hlo_text: str) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """Arrays materialised by the ENTRY computation: ``(dtype, dims, minor_to_major)`` each.

    Every instruction's result (tuple elements separately) is read from its definition line;
    fusion bodies are not entered, since their intermediates live in registers.
    """
    out = []
    in_entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            in_entry = True
            continue
        if in_entry and line.startswith("}"):
            break
        if not in_entry or "=" not in line:
            continue
        lhs, rhs = line.split("=", 1)
        # The result type sits between '=' and the opcode; tuples are parenthesised.
        m = re.match(r"\s*(\([^=]*?\)|\S+)\s+[\w-]+\(", rhs)
        if not m:
            continue
        for dt, dims, layout in _SHAPE.findall(m.group(1)):
            shape = tuple(int(d) for d in dims.split(",") if d)
            if not shape:
                continue
            mtm = (
                tuple(int(d) for d in layout.split(",") if d)
                if layout
                else tuple(range(len(shape) - 1, -1, -1))
            )
            out.append((dt, shape, mtm))
    return out


def padding_waste(fn: Callable, *args, tile: TileModel | str = "tpu") -> dict[str, float]:
    """Compiles ``jax.jit(fn)(*args)`` and prices its ENTRY arrays under a tile model.

    Returns:
      ``logical_bytes``, ``tiled_bytes``, ``waste`` (fraction of tiled bytes that are padding)
      and ``arrays`` (how many were counted).
    """
    tile = TILES[tile] if isinstance(tile, str) else tile
    text = jax.jit(fn).lower(*args).compile().as_text()
    logical = tiled = 0
    shapes = hlo_array_shapes(text)
    for dt, dims, mtm in shapes:
        size = DTYPE_BYTES[dt]
        logical += int(np.prod(dims)) * size
        tiled += tile.padded_elements([dims[i] for i in mtm], size) * size
    return {
        "logical_bytes": float(logical),
        "tiled_bytes": float(tiled),
        "waste": 1.0 - logical / tiled if tiled else 0.0,
        "arrays": float(len(shapes)),
    }
