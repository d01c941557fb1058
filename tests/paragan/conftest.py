"""paragan tests: a JAX persistent compilation cache shared by this area's tests and subprocesses.

Many tests build the same tiny programs (the init and step of one preset) in fresh `Trainer`s or
subprocesses; the persistent cache is keyed by the compiled program, so each is compiled once per
session. The previous cache settings are restored afterwards, so other areas' tests are unaffected.
"""

import os

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

RING = [
    "model.arch=mlp",
    "data.source=ring8",
    "model.num_classes=0",
    "model.g_width=16",
    "model.d_width=16",
    "model.mlp_layers=2",
    "model.spectral_norm=true",
    "data.batch_size=32",
    "data.mixture_size=512",
    "eval.num_samples=256",
    "ema_decay=0.5",
]
"""Overrides turning the ``tiny`` preset into a tiny ring-of-8 MLP GAN (fast to compile)."""


@pytest.fixture(scope="session")
def jax_cache_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture(autouse=True, scope="module")
def _persistent_compilation_cache(jax_cache_dir):
    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {k: getattr(jax.config, k) for k in keys}
    old_env = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_compilation_cache_dir", jax_cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = jax_cache_dir
    compilation_cache.reset_cache()  # JAX decides once whether to use the cache; re-decide
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    if old_env is None:
        os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = old_env
    compilation_cache.reset_cache()
