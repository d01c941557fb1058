"""``python -m paragan_jax prepare``: turn an image folder, ``.npy``/``.npz`` shards or the digits
into the sharded uint8 format of `paragan_jax.shards`.

::

    python -m paragan_jax prepare --src ~/imagenet/train --out /data/in64 --resolution 64
    python -m paragan_jax prepare --src digits --out /tmp/digits32 --resolution 32
    python -m paragan_jax prepare --src ./npy --out gs://bucket/shards   # written with tensorstore

Sources (``--src``): ``digits`` (scikit-learn's 8x8 digits); a directory of ``.npy`` (images) or
``.npz`` (``images``, optional ``labels``) files of shape (N, H, W[, C]), uint8 or float in
[-1, 1]; otherwise an image folder (PNG/JPEG/BMP/GIF), one sub-folder per class or flat. Images
are read ``chunk`` at a time and written a shard at a time, so memory stays bounded by one shard
whatever the data set's size. ``--resolution`` resizes (bilinear) to a square side;
``--channels`` converts 1 <-> 3 channels. The result is uint8; the manifest records the count,
image shape, number of classes and the class names of a folder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tapas_jax.commands import write_json

from .command_config import command_config_parser, load_command_config
from .data import IMAGE_EXTS, DataError, convert_channels, read_image, resize_uint8
from .shards import ShardWriter

__all__ = ["PrepareCommand", "main", "prepare"]

Chunk = tuple[np.ndarray, np.ndarray]


@dataclasses.dataclass(frozen=True)
class PrepareCommand:
    """Settings of ``python -m paragan_jax prepare``."""

    src: str = ""
    """``digits``, a directory of .npy/.npz files, or an image folder."""
    out: str = ""
    """Directory (or gs:// prefix) to write the shards and manifest.json to."""
    resolution: int = 0
    """Resize images to this square side (0: keep their size)."""
    channels: int = 0
    """Convert to 1 or 3 channels (0: keep)."""
    examples_per_shard: int = 0
    """Examples a shard (0: about 64 MiB of images a shard)."""
    chunk: int = 256
    """Examples read and converted at a time."""
    json: str | None = None
    """Also write the manifest here."""

    def __post_init__(self):
        if not self.src or not self.out:
            raise ValueError("prepare needs --src and --out")
        if self.resolution < 0 or self.channels not in (0, 1, 3) or self.chunk < 1:
            raise ValueError("need resolution >= 0, channels in {0, 1, 3}, chunk >= 1")
        if self.examples_per_shard < 0:
            raise ValueError("examples_per_shard must be >= 0")


def to_uint8(images: np.ndarray) -> np.ndarray:
    """uint8 as is; floats in [-1, 1] to [0, 255] (rounded). Raises DataError otherwise."""
    if images.dtype == np.uint8:
        return images
    x = images.astype(np.float32)
    if x.size and (x.min() < -1.0 - 1e-3 or x.max() > 1.0 + 1e-3):
        raise DataError(f"float images must lie in [-1, 1]; got [{x.min()}, {x.max()}]")
    return np.clip(np.rint((x + 1.0) * 127.5), 0, 255).astype(np.uint8)


def convert(images: np.ndarray, resolution: int, channels: int) -> np.ndarray:
    """(n, H, W[, C]) uint8 -> (n, R, R, C') uint8: channels then a bilinear resize."""
    if images.ndim == 3:
        images = images[..., None]
    if channels:
        images = convert_channels(images, channels, f"--channels {channels}")
    if resolution:
        images = resize_uint8(images, resolution)
    return images


def _digits(chunk: int) -> tuple[int, Iterator[Chunk], int, list[str]]:
    from sklearn.datasets import load_digits  # optional (the gan extra)

    d = load_digits()
    images = np.rint(d.images * (255.0 / 16.0)).astype(np.uint8)
    labels = d.target.astype(np.int32)
    chunks = ((images[i : i + chunk], labels[i : i + chunk]) for i in range(0, len(images), chunk))
    return len(images), chunks, 10, [str(k) for k in range(10)]


def _npy(files: list[Path], chunk: int) -> tuple[int, Iterator[Chunk], int, list]:
    sizes, max_label = [], 0
    for f in files:
        try:
            if f.suffix == ".npy":
                sizes.append(len(np.load(f, mmap_mode="r")))
            else:
                with np.load(f) as z:
                    if "images" not in z:
                        raise DataError(f"{f} has no 'images' array (keys: {list(z)})")
                    sizes.append(len(z["images"]))
                    if "labels" in z and len(z["labels"]):
                        max_label = max(max_label, int(np.max(z["labels"])))
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"cannot read {f}: {e}") from None

    def chunks() -> Iterator[Chunk]:
        for f in files:
            if f.suffix == ".npy":
                images, labels = np.load(f, mmap_mode="r"), None
            else:
                with np.load(f) as z:
                    images = z["images"]
                    labels = z["labels"] if "labels" in z else None
            for i in range(0, len(images), chunk):
                part = np.asarray(images[i : i + chunk])
                lab = np.zeros(len(part), np.int32) if labels is None else labels[i : i + chunk]
                yield to_uint8(part), np.asarray(lab, np.int32)

    return sum(sizes), chunks(), max_label + 1, []


def _folder(root: Path, chunk: int) -> tuple[int, Iterator[Chunk], int, list[str]]:
    subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    groups = list(enumerate(subdirs)) if subdirs else [(0, root)]
    files = [
        (f, label)
        for label, d in groups
        for f in sorted(d.iterdir())
        if f.suffix.lower() in IMAGE_EXTS
    ]
    if not files:
        raise DataError(f"no images ({', '.join(IMAGE_EXTS)}) found under {str(root)!r}")

    def chunks() -> Iterator[Chunk]:
        for i in range(0, len(files), chunk):
            part = files[i : i + chunk]
            yield [read_image(f) for f, _ in part], np.array([lab for _, lab in part], np.int32)

    return len(files), chunks(), max(len(subdirs), 1), [d.name for d in subdirs]


def prepare(cfg: PrepareCommand) -> dict:
    """Writes the data set of `cfg.src` to `cfg.out`; returns the manifest."""
    if cfg.src == "digits":
        count, chunks, classes, names = _digits(cfg.chunk)
    else:
        root = Path(cfg.src)
        if not root.is_dir():
            raise FileNotFoundError(f"--src {cfg.src!r} is neither 'digits' nor a directory")
        arrays = sorted(p for p in root.iterdir() if p.suffix in (".npy", ".npz"))
        if arrays:
            count, chunks, classes, names = _npy(arrays, cfg.chunk)
        else:
            count, chunks, classes, names = _folder(root, cfg.chunk)
    writer = None
    for images, labels in chunks:
        if isinstance(images, list):  # folder: each image converted alone (sizes may differ)
            images = [convert(im[None], cfg.resolution, cfg.channels)[0] for im in images]
            shapes = {im.shape for im in images}
            if len(shapes) > 1 or (writer is not None and images[0].shape != writer.shape):
                raise DataError(
                    f"images of mixed sizes under {cfg.src!r} ({sorted(shapes)[:2]}...); "
                    "give --resolution to resize them to one size"
                )
            images = np.stack(images)
        else:
            images = convert(images, cfg.resolution, cfg.channels)
        if images.shape[1] != images.shape[2]:
            raise DataError(
                f"images are {images.shape[1]}x{images.shape[2]}; the models need square "
                "images: give --resolution"
            )
        if writer is None:
            writer = ShardWriter(
                cfg.out,
                count,
                images.shape[1:],
                examples_per_shard=cfg.examples_per_shard or None,
                num_classes=classes,
                source=cfg.src,
                class_names=names,
            )
        writer.add(images, labels)
    return writer.close()


def main(argv: list[str]) -> int:
    """``python -m paragan_jax prepare --src S --out DIR [--resolution R] [key=value ...]``."""
    parser = command_config_parser(
        "prepare",
        PrepareCommand,
        "Write an image folder, .npy/.npz files or the digits as sharded uint8 (tensorstore).",
    )
    cfg = load_command_config(PrepareCommand, parser.parse_intermixed_args(argv[1:]))
    manifest = prepare(cfg)
    shape = "x".join(map(str, manifest["image_shape"]))
    print(
        f"wrote {manifest['count']} images ({shape} uint8, {manifest['num_classes']} classes) "
        f"in {len(manifest['shards'])} shards to {cfg.out}"
    )
    if cfg.json:
        write_json(cfg.json, manifest)
    return 0
