"""Real samples for GAN training, and the plain prefetching loader.

Sources (``data.source``):

- ``digits``: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes), shipped inside
  scikit-learn, so nothing is downloaded; upsampled bilinearly to ``model.resolution``.
- ``ring8`` / ``grid25``: 2-D Gaussian mixtures (8 modes on a circle of radius 2; 25 modes on the
  grid {-4, -2, 0, 2, 4}^2), ``data.mixture_std`` each; `Dataset.modes` holds the centres for the
  mode-coverage metrics.
- ``folder``: an image folder (PNG/JPEG), one sub-folder per class or flat (one class). Every image
  must have the same size; they are resized to ``model.resolution`` if that differs.
- ``npy``: a directory of ``.npy`` (images only) or ``.npz`` (``images`` and optional ``labels``)
  shards of shape (N, H, W[, C]); uint8, or floats already in [-1, 1].
- ``shards``: the sharded uint8 format of `paragan_jax.shards` (``python -m paragan_jax prepare``
  writes it; ``data.path`` a directory, ``gs://...`` or ``http://...``), read lazily: only the
  labels are loaded, images are read when a batch asks for them (`paragan_jax.shards.ShardImages`).

Images are NHWC: uint8 in [0, 255] where the source is uint8 (folder, uint8 npy, shards; a
quarter of the memory of float32) and float32 in [-1, 1] otherwise (digits, float npy); labels
int32. uint8 batches stay uint8 on the host and are cast on the device: `device_batch` puts a
host batch with its sharding and maps uint8 images to float32 in [-1, 1] there;
`as_float_images` is the same map on the host (metrics of real images).

The loader is deterministic: batch ``i`` is a pure function of ``(seed, i)`` (epoch ``i // nb``
is a fresh permutation seeded by ``[seed, epoch]`` of which the first `Dataset.epoch_size`
examples are served, all of them by default; the last incomplete batch of an epoch is
dropped). The data position saved in checkpoints is simply the next batch index, so a resumed run
reads exactly the batches an uninterrupted one would. `PrefetchLoader` prepares batches on a
background thread; it is the default implementation of the trainer's batch-iterator seam
(``batch_iterator_factory(dataset, batch_size, seed, start) -> Iterator[Batch]``), which the
adaptive pipeline of ``paragan_jax at scale`` replaces.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from scipy.ndimage import zoom

from .config import TrainConfig
from .pipeline import epoch_order
from .shards import ShardedStorage, ShardImages

__all__ = [
    "Batch",
    "DataError",
    "Dataset",
    "IMAGE_EXTS",
    "PrefetchLoader",
    "as_float_images",
    "batch_at",
    "convert_channels",
    "device_batch",
    "gaussian_mixture",
    "load_dataset",
    "read_image",
    "resize_uint8",
]

Batch = dict[str, np.ndarray]
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".bmp", ".gif")


class DataError(ValueError):
    """Real data that cannot be read or does not fit the config."""


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Real samples in memory."""

    name: str
    images: np.ndarray | ShardImages  # (N, H, W, C) uint8 or float32 in [-1, 1]; (N, 2) mixtures
    labels: np.ndarray  # (N,) int32
    num_classes: int
    modes: np.ndarray | None = None  # (M, 2) mixture centres
    mode_std: float = 0.0
    epoch_size: int | None = None  # examples served per epoch (None: all); see `batch_at`

    @property
    def examples_per_epoch(self) -> int:
        """Examples served per epoch: ``epoch_size``, or all of them."""
        return len(self) if self.epoch_size is None else self.epoch_size

    @property
    def is_mixture(self) -> bool:
        return self.modes is not None

    def __len__(self) -> int:
        return int(self.images.shape[0])


# uint8 -> [-1, 1] as (x - 127.5) * c: the subtraction is exact and the product rounds once, so
# host and device agree bit for bit (x / 127.5 - 1 does not: XLA turns the division into a
# product by the reciprocal) and the ends map to exactly -1 and 1.
_SCALE = np.float32(1 / 127.5)


def as_float_images(images) -> np.ndarray:
    """float32 in [-1, 1]: uint8 images scaled from [0, 255], float images as they are."""
    x = np.asarray(images)
    if x.dtype == np.uint8:
        return (x.astype(np.float32) - np.float32(127.5)) * _SCALE
    return x.astype(np.float32, copy=False)


@jax.jit
def _unit_range(images: jax.Array) -> jax.Array:
    return (images.astype(jnp.float32) - jnp.float32(127.5)) * _SCALE


def device_batch(batch: Batch, sharding, local: bool = False) -> dict[str, jax.Array]:
    """A host batch on the devices of `sharding`; uint8 images cross as uint8 (a quarter of the
    bytes of float32) and become float32 in [-1, 1] on the device.

    Args:
      batch: host arrays (``image``, ``label``, ...).
      sharding: where they go.
      local: the arrays are this process's share of a global batch
        (``jax.make_array_from_process_local_data``); otherwise every process holds all of it.
    """
    if local:
        out = {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
    else:
        out = jax.device_put(batch, sharding)
    if out["image"].dtype == jnp.uint8:
        out["image"] = _unit_range(out["image"])
    return out


def resize_uint8(images: np.ndarray, size: int, chunk: int = 256) -> np.ndarray:
    """(N, H, W, C) uint8 resized (bilinear) to (N, size, size, C) uint8, `chunk` at a time."""
    n, h, w, _ = images.shape
    if (h, w) == (size, size):
        return images
    out = []
    for i in range(0, n, chunk):
        x = zoom(
            images[i : i + chunk].astype(np.float32),
            (1, size / h, size / w, 1),
            order=1,
            grid_mode=True,
            mode="nearest",
        )
        out.append(np.clip(np.rint(x), 0, 255).astype(np.uint8))
    return np.concatenate(out)


def convert_channels(images: np.ndarray, channels: int, where: str = "images") -> np.ndarray:
    """(N, H, W, C) images with `channels` channels: grey repeated to RGB, RGB averaged to grey
    (rounded back to uint8 for uint8 images); unchanged when they already have that many.

    Raises:
      DataError: another conversion (`where` names the images in the message).
    """
    c = images.shape[-1]
    if c == channels:
        return images
    if c == 1 and channels == 3:
        return np.repeat(images, 3, axis=-1)
    if c == 3 and channels == 1:
        grey = images.mean(axis=-1, keepdims=True)
        return np.rint(grey).astype(np.uint8) if images.dtype == np.uint8 else grey
    raise DataError(f"{where}: images have {c} channels; cannot make {channels} of them")


def _resize(images: np.ndarray, size: int) -> np.ndarray:
    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images.astype(np.float32)
    out = zoom(images, (1, size / h, size / w, 1), order=1, grid_mode=True, mode="nearest")
    return np.clip(out, -1.0, 1.0).astype(np.float32)


def _digits(resolution: int) -> Dataset:
    from sklearn.datasets import load_digits  # optional (the gan extra): only the digits need it

    d = load_digits()
    images = (d.images.astype(np.float32) / 16.0) * 2.0 - 1.0
    images = _resize(images[..., None], resolution)
    return Dataset("digits", images, d.target.astype(np.int32), 10)


def mixture_modes(name: str) -> np.ndarray:
    """Centres of ``ring8`` (radius 2) or ``grid25`` (spacing 2) as an (M, 2) array."""
    if name == "ring8":
        angles = 2 * np.pi * np.arange(8) / 8
        return np.stack([2 * np.cos(angles), 2 * np.sin(angles)], axis=1).astype(np.float32)
    if name == "grid25":
        g = np.arange(-4, 5, 2, dtype=np.float32)
        return np.stack(np.meshgrid(g, g, indexing="ij"), axis=-1).reshape(-1, 2)
    raise DataError(f"unknown mixture {name!r}; expected 'ring8' or 'grid25'")


def gaussian_mixture(name: str, n: int, std: float, seed: int) -> Dataset:
    """Draws `n` points from an equal-weight mixture; labels are the mode indices."""
    modes = mixture_modes(name)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(modes), size=n)
    points = modes[labels] + std * rng.standard_normal((n, 2)).astype(np.float32)
    return Dataset(name, points.astype(np.float32), labels.astype(np.int32), 0, modes, std)


def read_image(path: Path) -> np.ndarray:
    """One image file as uint8 (H, W) grey or (H, W, 3) RGB."""
    from PIL import Image  # optional (the gan extra): only image folders need it

    try:
        with Image.open(path) as im:
            return np.asarray(im.convert("RGB" if im.mode not in ("L", "I", "F") else "L"))
    except Exception as e:
        raise DataError(f"cannot read image {path}: {e}") from None


def _folder(path: str, resolution: int, channels: int) -> Dataset:
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {path!r} is not a readable directory")
    try:
        subdirs = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as e:
        raise DataError(f"cannot list data.path {path!r}: {e}") from None
    groups = [(i, d) for i, d in enumerate(subdirs)] if subdirs else [(0, root)]
    images, labels, first = [], [], None
    for label, d in groups:
        for f in sorted(d.iterdir()):
            if f.suffix.lower() not in IMAGE_EXTS:
                continue
            img = read_image(f)
            if first is None:
                first = (img.shape, f)
            elif img.shape != first[0]:
                raise DataError(
                    f"images of mixed sizes in {path!r}: {first[1].name} is {first[0]}, "
                    f"{f.name} is {img.shape}; resize them to one size first"
                )
            images.append(img)
            labels.append(label)
    if not images:
        raise DataError(f"no images ({', '.join(IMAGE_EXTS)}) found under {path!r}")
    arr = np.stack(images)
    if arr.ndim == 3:
        arr = arr[..., None]
    return _to_dataset(
        f"folder:{root.name}", arr, np.asarray(labels), resolution, channels, max(len(subdirs), 1)
    )


def _to_dataset(name, arr, labels, resolution, channels, num_classes) -> Dataset:
    if arr.ndim == 3:
        arr = arr[..., None]
    if arr.ndim != 4:
        raise DataError(f"{name}: images must be (N, H, W[, C]); got shape {arr.shape}")
    if arr.shape[1] != arr.shape[2]:
        raise DataError(f"{name}: images must be square; got {arr.shape[1]}x{arr.shape[2]}")
    arr = convert_channels(arr, channels, f"{name} (model.channels={channels})")
    labels = labels.astype(np.int32)
    if arr.dtype == np.uint8:  # stays uint8 on the host
        return Dataset(name, resize_uint8(arr, resolution), labels, num_classes)
    arr = arr.astype(np.float32)
    if arr.min() < -1.0 - 1e-3 or arr.max() > 1.0 + 1e-3:
        raise DataError(f"{name}: float images must lie in [-1, 1]; got [{arr.min()}, {arr.max()}]")
    return Dataset(name, _resize(arr, resolution), labels, num_classes)


def _shards(path: str, resolution: int, channels: int, process: tuple[int, int]) -> Dataset:
    storage = ShardedStorage(path, *process)
    h, w, c = storage.image_shape
    if (h, w, c) != (resolution, resolution, channels):
        raise DataError(
            f"data.path {path!r} holds {h}x{w}x{c} images; the model wants {resolution}x"
            f"{resolution}x{channels} (prepare with --resolution {resolution} --channels "
            f"{channels})"
        )
    name = f"shards:{path.rstrip('/').rsplit('/', 1)[-1]}"
    return Dataset(
        name,
        ShardImages(storage),
        storage.labels,
        max(storage.num_classes, 1),
        epoch_size=storage.epoch_size,
    )


def _npy(path: str, resolution: int, channels: int) -> Dataset:
    root = Path(path)
    if not root.is_dir():
        raise DataError(f"data.path {path!r} is not a readable directory")
    shards = sorted(p for p in root.iterdir() if p.suffix in (".npy", ".npz"))
    if not shards:
        raise DataError(f"no .npy/.npz shards under {path!r}")
    images, labels = [], []
    for s in shards:
        try:
            if s.suffix == ".npz":
                with np.load(s) as z:
                    if "images" not in z:
                        raise DataError(f"shard {s} has no 'images' array (keys: {list(z)})")
                    img = z["images"]
                    lab = z["labels"] if "labels" in z else np.zeros(len(img), np.int32)
            else:
                img = np.load(s)
                lab = np.zeros(len(img), np.int32)
        except DataError:
            raise
        except Exception as e:
            raise DataError(f"cannot read shard {s}: {e}") from None
        if images and img.shape[1:] != images[0].shape[1:]:
            raise DataError(
                f"shards of mixed image sizes in {path!r}: {shards[0].name} has "
                f"{images[0].shape[1:]}, {s.name} has {img.shape[1:]}"
            )
        images.append(img)
        labels.append(lab)
    lab = np.concatenate(labels).astype(np.int32)
    return _to_dataset(
        f"npy:{root.name}", np.concatenate(images), lab, resolution, channels, int(lab.max()) + 1
    )


def load_dataset(config: TrainConfig, process_index: int = 0, process_count: int = 1) -> Dataset:
    """Loads the real samples a config asks for, checking them before any training step.

    Args:
      config: the run config.
      process_index, process_count: with ``data.source=shards``, load only the shards of process
        `process_index` of `process_count` (`paragan_jax.shards.ShardedStorage`); it must hold at
        least its share of a batch (``data.batch_size // process_count``) per epoch. Other
        sources are always loaded whole.

    Raises:
      DataError: unreadable directory, images of mixed sizes, wrong channel count or range.
    """
    d, m = config.data, config.model
    if d.source == "digits":
        ds = _digits(m.resolution)
        if m.channels != 1:
            ds = dataclasses.replace(ds, images=np.repeat(ds.images, m.channels, axis=-1))
    elif d.source in ("ring8", "grid25"):
        ds = gaussian_mixture(d.source, d.mixture_size, d.mixture_std, d.seed)
    elif d.source == "folder":
        ds = _folder(d.path, m.resolution, m.channels)
    elif d.source == "npy":
        ds = _npy(d.path, m.resolution, m.channels)
    elif d.source == "shards":
        ds = _shards(d.path, m.resolution, m.channels, (process_index, process_count))
    else:
        raise DataError(f"data.source={d.source!r} is not known")
    share = d.batch_size // process_count  # all of it with one process
    if ds.examples_per_epoch < share:
        raise DataError(
            f"{ds.name}: process {process_index} serves {ds.examples_per_epoch} samples an epoch, "
            f"fewer than its share of data.batch_size={d.batch_size} ({share})"
        )
    if m.num_classes and int(ds.labels.max()) >= m.num_classes:
        raise DataError(
            f"{ds.name}: labels go up to {int(ds.labels.max())}, but model.num_classes="
            f"{m.num_classes}"
        )
    return ds


def batch_at(dataset: Dataset, batch_size: int, seed: int, index: int) -> Batch:
    """Batch number `index` of the deterministic shuffled stream (see the module docstring)."""
    n = len(dataset)
    per_epoch = dataset.examples_per_epoch // batch_size
    epoch, k = divmod(index, per_epoch)
    idx = epoch_order(n, seed, epoch)[k * batch_size : (k + 1) * batch_size]
    return {"image": dataset.images[idx], "label": dataset.labels[idx]}


class PrefetchLoader(Iterator[Batch]):
    """Yields `batch_at(start)`, `batch_at(start + 1)`, ... prepared on a background thread.

    Attributes:
      position: index of the next batch `__next__` returns (the checkpointed data position).
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int, start: int = 0, prefetch: int = 2
    ):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.position = start
        self._queue: queue.Queue = queue.Queue(maxsize=max(prefetch, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(start,), daemon=True)
        self._thread.start()

    def _fill(self, index: int) -> None:
        while not self._stop.is_set():
            try:
                batch = batch_at(self.dataset, self.batch_size, self.seed, index)
            except Exception as e:  # surface loader errors in the consumer
                self._queue.put(e)
                return
            while not self._stop.is_set():
                try:
                    self._queue.put(batch, timeout=0.1)
                    break
                except queue.Full:
                    continue
            index += 1

    def __next__(self) -> Batch:
        item = self._queue.get()
        if isinstance(item, Exception):
            raise item
        self.position += 1
        return item

    def close(self) -> None:
        """Stops the background thread."""
        self._stop.set()
        self._thread.join(timeout=2.0)
