"""KV-cache sizing from device memory: ``cache.kv_cache_memory_fraction`` (vLLM's
``--gpu-memory-utilization``).

With a fraction ``f`` set, the engine may use ``f`` of the device's memory for everything it
holds there, and the device KV pages are what is left after the weights and the activations of
the largest step::

    pages = floor((f * device_memory - weights - activations) / page_bytes)

* device memory: ``memory_stats()["bytes_limit"]`` of the first device on GPU and TPU; on CPU,
  where ``memory_stats()`` is None, the device is host RAM and the budget is the memory
  available when the engine starts (``MemAvailable`` of /proc/meminfo, else the physical
  memory). ``cache.device_memory_bytes`` replaces either (sizing for another chip, tests).
* weights: the bytes of one device's shard of every parameter (the model as loaded, so a
  tensor-parallel plan counts once per device), or the shape's parameter count x dtype bytes
  when no model is built (the simulator's executor).
* activations: an estimate of the largest step's live buffers (`activation_bytes`): the token
  budget's hidden states, q/k/v and SwiGLU intermediates, one context chunk of paged attention
  per sequence, and float32 logits of the sampled rows, times 2 for XLA's temporaries.
* page bytes: ``block_size x kv_bytes_per_token`` over the devices of the mesh's ``model``
  axis (the KV heads are split over it).

Start-up is refused (ValueError with every number above) when the pages cannot hold one request
of the model's maximum length, as vLLM refuses a ``max_model_len`` larger than its KV cache.
Without a fraction, ``cache.num_device_blocks`` is used as given (the engine then caps the
context at what the pool holds).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

from serve_jax.config import EngineConfig
from serve_jax.model_config import ModelConfig

__all__ = ["KVSizing", "activation_bytes", "device_memory_bytes", "size_kv_cache"]

_GIB = 2**30
_ACTIVATION_SAFETY = 2.0


@dataclasses.dataclass(frozen=True)
class KVSizing:
    """How the device pages were sized (all bytes per device)."""

    fraction: float
    device_memory_bytes: int
    memory_source: str
    """``memory_stats``, ``host MemAvailable``, ``host physical memory`` or ``configured``."""
    weight_bytes: int
    activation_bytes: int
    page_bytes: int
    num_pages: int
    block_size: int
    max_model_len: int

    @property
    def kv_bytes(self) -> int:
        """Bytes the pages take."""
        return self.num_pages * self.page_bytes

    def describe(self) -> str:
        """One line with every number of the sizing."""
        return (
            f"kv_cache_memory_fraction {self.fraction:g} of "
            f"{self.device_memory_bytes / _GIB:.2f} GiB ({self.memory_source}) = "
            f"{self.fraction * self.device_memory_bytes / _GIB:.2f} GiB; weights "
            f"{self.weight_bytes / _GIB:.2f} GiB, activations {self.activation_bytes / _GIB:.2f} "
            f"GiB, KV {self.kv_bytes / _GIB:.2f} GiB = {self.num_pages} pages of "
            f"{self.block_size} tokens ({self.page_bytes} B each) = "
            f"{self.num_pages * self.block_size} tokens"
        )


def device_memory_bytes(device, configured: int | None = None) -> tuple[int, str]:
    """The memory to size against and where it came from (see the module docstring)."""
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"cache.device_memory_bytes must be > 0, got {configured}")
        return int(configured), "configured"
    stats = device.memory_stats()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "memory_stats"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "host MemAvailable"
    except OSError:
        pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host physical memory"


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """Estimated peak bytes of one step's activations (see the module docstring)."""
    t = max_num_batched_tokens + max_num_seqs
    item = cfg.dtype_bytes
    hidden = 4 * t * cfg.d_model * item
    qkv = t * (cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim * item
    mlp = 3 * t * cfg.ffn_dim * item
    chunk = 32  # context tokens per paged-attention iteration (serve_jax.attention)
    # float32 scores and probabilities of every query over one chunk, and each sequence's
    # gathered K and V chunk
    attention = 4 * (
        2 * cfg.n_heads * t * chunk + 2 * max_num_seqs * cfg.n_kv_heads * chunk * cfg.head_dim
    )
    logits = 2 * max_num_seqs * cfg.vocab_size * 4
    return int(_ACTIVATION_SAFETY * (hidden + qkv + mlp + attention + logits))


def _weight_bytes(model, cfg: ModelConfig) -> int:
    if model is None:
        return cfg.num_params() * cfg.dtype_bytes
    total = 0
    for leaf in jax.tree.leaves(nnx.state(model)):
        shards = getattr(leaf, "addressable_shards", None)
        total += shards[0].data.nbytes if shards else leaf.nbytes
    return total


def size_kv_cache(
    config: EngineConfig, model_config: ModelConfig, model=None, mesh=None
) -> tuple[EngineConfig, KVSizing | None]:
    """``config`` with ``cache.num_device_blocks`` sized from memory, and the sizing.

    Without ``cache.kv_cache_memory_fraction`` the config comes back unchanged (sizing None).

    Raises:
      ValueError: a fraction outside (0, 1], or pages that cannot hold one request of
        ``model_config.max_seq_len`` tokens (the message has every number).
    """
    cc, sc = config.cache, config.scheduler
    fraction = cc.kv_cache_memory_fraction
    if fraction is None:
        return config, None
    if not 0 < fraction <= 1:
        raise ValueError(f"cache.kv_cache_memory_fraction must be in (0, 1], got {fraction}")
    device = mesh.devices.flat[0] if mesh is not None else jax.devices()[0]
    total, source = device_memory_bytes(device, cc.device_memory_bytes)
    kv_shards = 1
    if mesh is not None and "model" in mesh.shape:
        n = mesh.shape["model"]
        kv_shards = n if model_config.n_kv_heads % n == 0 else 1
    page = cc.block_size * model_config.kv_bytes_per_token() // kv_shards
    weights = _weight_bytes(model, model_config)
    acts = activation_bytes(model_config, sc.max_num_batched_tokens, sc.max_num_seqs)
    pages = max(0, int(fraction * total - weights - acts) // page)
    sizing = KVSizing(
        fraction, total, source, weights, acts, page, pages, cc.block_size,
        model_config.max_seq_len,
    )  # fmt: skip
    if pages * cc.block_size < model_config.max_seq_len:
        need = -(-model_config.max_seq_len // cc.block_size)
        raise ValueError(
            f"the KV cache cannot hold one request of max_model_len {model_config.max_seq_len} "
            f"tokens: {sizing.describe()}; it needs {need} pages ({need * page / _GIB:.2f} GiB). "
            "Raise cache.kv_cache_memory_fraction (or cache.device_memory_bytes), or lower "
            "model.max_seq_len"
        )
    cache = dataclasses.replace(cc, num_device_blocks=pages)
    return dataclasses.replace(config, cache=cache), sizing
