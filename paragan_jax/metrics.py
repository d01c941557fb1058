"""Offline GAN metrics that need no download, and sample pictures.

Image data sets: a small classifier (an MLP in NNX on flattened images: 256 -> 64 -> classes) is
trained on the real data set itself with a fixed seed and cached as ``.npz`` under the cache
directory (``$PARAGAN_CACHE`` or ``~/.cache/paragan_jax``), keyed by a hash of the data. Its
64-wide penultimate layer gives the features for

- the Frechet distance (FD: ``|mu_r - mu_g|^2 + Tr(S_r + S_g - 2 (S_r S_g)^(1/2))``, the FID
  formula on our features, so values are not comparable with published FIDs);
- KID: unbiased MMD^2 with the cubic polynomial kernel ``(x.y / d + 1)^3``, averaged over subsets;
- the classifier score: ``exp(E_x KL(p(y|x) || p(y)))`` (the Inception score formula on our
  classifier; 1 = one class or no confidence, up to the number of classes).

2-D mixtures: the features are the points themselves; the classifier is the posterior over modes
of the true mixture; a sample is *high quality* if it lies within 3 standard deviations of its
nearest mode, and a mode is *covered* when it receives at least ``min_share`` of its fair share
(``n / num_modes``) of high-quality samples (default 0.1).
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from scipy import linalg

from .data import Dataset, as_float_images

__all__ = [
    "FeatureClassifier",
    "classifier_score",
    "evaluate_samples",
    "frechet_distance",
    "kernel_inception_distance",
    "load_or_train_classifier",
    "mode_statistics",
    "render_samples",
    "save_sample_png",
    "write_png",
]


def _sqrtm(m: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():  # dead ReLU features make covariances singular; harmless
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        out = linalg.sqrtm(m)
    return out[0] if isinstance(out, tuple) else out


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Frechet distance between Gaussians fitted to two feature sets ``(n, d)``."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    mu1, mu2 = a.mean(0), b.mean(0)
    s1, s2 = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    covmean = _sqrtm(s1 @ s2)
    if not np.isfinite(covmean).all():
        eps = 1e-6 * np.eye(s1.shape[0])
        covmean = _sqrtm((s1 + eps) @ (s2 + eps))
    covmean = np.real(covmean)
    return float(np.sum((mu1 - mu2) ** 2) + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


def kernel_inception_distance(
    a: np.ndarray, b: np.ndarray, subsets: int = 10, subset_size: int = 500, seed: int = 0
) -> float:
    """KID: unbiased MMD^2 with kernel ``(x.y/d + 1)^3``, mean over random subsets."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = a.shape[1]
    m = min(subset_size, len(a), len(b))
    rng = np.random.default_rng(seed)
    vals = []
    for _ in range(subsets):
        x = a[rng.choice(len(a), m, replace=False)]
        y = b[rng.choice(len(b), m, replace=False)]
        kxx = (x @ x.T / d + 1) ** 3
        kyy = (y @ y.T / d + 1) ** 3
        kxy = (x @ y.T / d + 1) ** 3
        vals.append(
            (kxx.sum() - np.trace(kxx)) / (m * (m - 1))
            + (kyy.sum() - np.trace(kyy)) / (m * (m - 1))
            - 2 * kxy.mean()
        )
    return float(np.mean(vals))


def classifier_score(probs: np.ndarray) -> float:
    """``exp(E_x KL(p(y|x) || p(y)))`` over rows of class probabilities."""
    p = np.clip(np.asarray(probs, np.float64), 1e-12, 1.0)
    py = p.mean(0, keepdims=True)
    return float(np.exp(np.mean(np.sum(p * (np.log(p) - np.log(py)), axis=1))))


def mode_statistics(
    points: np.ndarray, modes: np.ndarray, std: float, min_share: float = 0.1
) -> dict[str, float]:
    """High-quality fraction and modes covered of 2-D samples (see the module docstring)."""
    dist = np.linalg.norm(points[:, None, :] - modes[None], axis=-1)
    nearest = dist.argmin(1)
    hq = dist[np.arange(len(points)), nearest] <= 3 * std
    counts = np.bincount(nearest[hq], minlength=len(modes))
    need = max(1.0, min_share * len(points) / len(modes))
    return {
        "modes_covered": int(np.sum(counts >= need)),
        "num_modes": len(modes),
        "high_quality_fraction": float(hq.mean()),
    }


def _mixture_posterior(points: np.ndarray, modes: np.ndarray, std: float) -> np.ndarray:
    d2 = np.sum((points[:, None, :] - modes[None]) ** 2, axis=-1)
    logits = -d2 / (2 * std**2)
    logits -= logits.max(1, keepdims=True)
    p = np.exp(logits)
    return p / p.sum(1, keepdims=True)


class FeatureClassifier(nnx.Module):
    """MLP classifier whose penultimate layer gives the metric features."""

    def __init__(self, in_dim: int, num_classes: int, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(in_dim, 256, rngs=rngs)
        self.l2 = nnx.Linear(256, 64, rngs=rngs)
        self.out = nnx.Linear(64, num_classes, rngs=rngs)

    def features(self, x: jax.Array) -> jax.Array:
        h = x.reshape(x.shape[0], -1)
        return jax.nn.relu(self.l2(jax.nn.relu(self.l1(h))))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.features(x))


def _cache_dir() -> Path:
    return Path(os.environ.get("PARAGAN_CACHE", Path.home() / ".cache" / "paragan_jax"))


def _data_key(dataset: Dataset) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(dataset.images).tobytes())
    h.update(np.ascontiguousarray(dataset.labels).tobytes())
    return h.hexdigest()[:16]


def load_or_train_classifier(
    dataset: Dataset, steps: int = 600, seed: int = 0, cache_dir: str | Path | None = None
) -> tuple[FeatureClassifier, float]:
    """The feature classifier for `dataset`, from cache or trained now (a few seconds on CPU).

    Returns:
      ``(classifier, held_out_accuracy)``; 10% of the data (fixed split) is held out.
    """
    if dataset.num_classes < 2:
        raise ValueError(f"{dataset.name}: the feature classifier needs >= 2 classes")
    in_dim = int(np.prod(dataset.images.shape[1:]))
    model = FeatureClassifier(in_dim, dataset.num_classes, nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    path = Path(cache_dir or _cache_dir()) / f"classifier-{_data_key(dataset)}-s{steps}.npz"
    leaves, treedef = jax.tree.flatten(params)
    if path.exists():
        with np.load(path) as z:
            leaves = [jnp.asarray(z[f"p{i}"]) for i in range(len(leaves))]
            acc = float(z["accuracy"])
        return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), acc
    rng = np.random.default_rng(seed)
    perm = rng.permutation(len(dataset))
    n_test = max(len(dataset) // 10, 1)
    test, train = perm[:n_test], perm[n_test:]
    x, y = jnp.asarray(as_float_images(dataset.images)), jnp.asarray(dataset.labels)
    tx = optax.adam(1e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, idx):
        def loss_fn(p):
            logits = nnx.merge(graphdef, p)(x[idx])
            return optax.softmax_cross_entropy_with_integer_labels(logits, y[idx]).mean()

        grads = jax.grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    for i in range(steps):
        idx = np.random.default_rng([seed, i]).choice(train, 128)
        params, opt = step(params, opt, jnp.asarray(idx))
    model = nnx.merge(graphdef, params)
    acc = float(jnp.mean(jnp.argmax(model(x[test]), -1) == y[test]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp, accuracy=acc, **{f"p{i}": np.asarray(v) for i, v in enumerate(jax.tree.leaves(params))}
    )
    tmp.replace(path)
    return model, acc


def evaluate_samples(
    samples: np.ndarray,
    dataset: Dataset,
    num_real: int | None = None,
    classifier: FeatureClassifier | None = None,
) -> dict[str, float]:
    """All offline metrics of generated `samples` against the real `dataset`.

    Returns:
      ``fd``, ``kid``, ``classifier_score``; on mixtures also ``modes_covered``, ``num_modes``,
      ``high_quality_fraction``; on images also ``classifier_accuracy`` (held out, real data).
    """
    n = len(samples)
    rng = np.random.default_rng(1)
    real_idx = rng.choice(len(dataset), min(num_real or n, len(dataset)), replace=False)
    real = as_float_images(dataset.images[real_idx])
    if dataset.is_mixture:
        out = {
            "fd": frechet_distance(real, samples),
            "kid": kernel_inception_distance(real, samples),
            "classifier_score": classifier_score(
                _mixture_posterior(samples, dataset.modes, dataset.mode_std)
            ),
        }
        out.update(mode_statistics(samples, dataset.modes, dataset.mode_std))
        return out
    acc = float("nan")
    if classifier is None:
        classifier, acc = load_or_train_classifier(dataset)
    feats = nnx.jit(lambda m, x: m.features(x))
    logits = nnx.jit(lambda m, x: m(x))
    f_real = np.asarray(feats(classifier, jnp.asarray(real)))
    f_fake = np.asarray(feats(classifier, jnp.asarray(samples)))
    probs = np.asarray(jax.nn.softmax(logits(classifier, jnp.asarray(samples))))
    return {
        "fd": frechet_distance(f_real, f_fake),
        "kid": kernel_inception_distance(f_real, f_fake),
        "classifier_score": classifier_score(probs),
        "classifier_accuracy": acc,
    }


def render_samples(
    samples: np.ndarray, rows: int = 8, real: np.ndarray | None = None, title: str = ""
) -> np.ndarray:
    """The picture of `samples` as an RGB ``uint8`` array ``(H, W, 3)``: a square grid of images
    (``rows`` x ``rows``, grey gaps, small images upscaled), or a scatter plot of 2-D points with
    `real` behind; what `save_sample_png` writes and what TensorBoard's image tab shows."""
    if samples.ndim == 2:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 5), dpi=100)
        if real is not None:
            ax.scatter(real[:, 0], real[:, 1], s=2, c="tab:gray", alpha=0.3, label="real")
        ax.scatter(samples[:, 0], samples[:, 1], s=2, c="tab:red", alpha=0.6, label="generated")
        ax.set_aspect("equal")
        ax.legend(loc="upper right", markerscale=4)
        ax.set_title(title)
        fig.canvas.draw()
        rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
        plt.close(fig)
        return rgb
    n = rows * rows
    imgs = np.asarray(samples[:n])
    if len(imgs) < n:
        imgs = np.concatenate([imgs, np.zeros((n - len(imgs),) + imgs.shape[1:], imgs.dtype)])
    imgs = np.pad(imgs, ((0, 0), (0, 1), (0, 1), (0, 0)), constant_values=0.0)  # grey gaps
    h, w, c = imgs.shape[1:]
    grid = imgs.reshape(rows, rows, h, w, c).transpose(0, 2, 1, 3, 4).reshape(rows * h, rows * w, c)
    grid = np.clip((grid + 1) / 2, 0, 1)
    scale = max(1, 384 // grid.shape[0])  # small images: nearest-neighbour upscale to view
    grid = np.kron(grid, np.ones((scale, scale, 1), grid.dtype))
    if c == 1:
        grid = np.repeat(grid, 3, axis=-1)
    return np.round(grid * 255).astype(np.uint8)


def save_sample_png(
    samples: np.ndarray,
    path: str | os.PathLike,
    rows: int = 8,
    real: np.ndarray | None = None,
    title: str = "",
) -> epath.Path:
    """Writes `render_samples` of `samples` as a PNG (local or ``gs://``); returns the path."""
    return write_png(render_samples(samples, rows, real, title), path)


def write_png(image: np.ndarray, path: str | os.PathLike) -> epath.Path:
    """Writes an RGB ``uint8`` array as a PNG at `path` (local or ``gs://``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = epath.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    plt.imsave(png, image, format="png")
    path.write_bytes(png.getvalue())
    return path
