"""Engine and server configuration: frozen dataclasses loaded from ``serve_jax/presets/*.yaml``.

Load with ``load_engine_config("tiny_cpu", ["cache.num_device_blocks=64"])`` (a preset name or a
YAML path, then dotted overrides); unknown keys are errors naming the key and the file.
The same folder holds the simulator's presets (`serve_jax.simulator.SimConfig`, ``sim_*.yaml``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable

from tapas_jax.config import load_config, preset_path

__all__ = [
    "ModelSection",
    "CacheSection",
    "SchedulerSection",
    "ExecutorSection",
    "ServerSection",
    "EngineConfig",
    "load_engine_config",
]


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """Which model to serve."""

    preset: str = "tiny"
    """Model preset of `serve_jax.model_config.PRESETS` (tiny, small, llama-7b, ...)."""
    path: str | None = None
    """A Hugging Face checkpoint: a local directory with config.json, a cache folder
    (models--org--name) or a repository id already in the local cache; replaces preset,
    checkpoint and (unless set) tokenizer. ``serve --model DIR`` sets it."""
    dtype: str = "auto"
    """Parameter dtype: float32, bfloat16, float16, or auto (float32 on CPU, else bfloat16)."""
    seed: int = 0
    """Random-init seed (when no checkpoint is given)."""
    checkpoint: str | None = None
    """A safetensors file written by serve_jax.model.save_safetensors; None: random init."""
    tokenizer: str | None = None
    """A local tokenizer.json or model directory; None: the model path's, else the byte one."""
    max_seq_len: int | None = None
    """Override of the preset's context length."""
    name: str = "serve-jax"
    """Model id reported by /v1/models and accepted in requests."""


@dataclasses.dataclass(frozen=True)
class CacheSection:
    """Paged KV cache sizes."""

    block_size: int = 16
    """Tokens per page."""
    num_device_blocks: int = 256
    """Pages in device memory (replaced by the sizing when kv_cache_memory_fraction is set)."""
    kv_cache_memory_fraction: float | None = None
    """Fraction of the device's memory the engine may use for weights, activations and KV
    (vLLM's gpu_memory_utilization): the device pages are what is left after the weights and
    the largest step's activations (`serve_jax.sizing`); start-up is refused if they cannot
    hold one request of the model's maximum length. None: num_device_blocks as given."""
    device_memory_bytes: int | None = None
    """Memory to size against instead of the device's (``memory_stats()`` on GPU/TPU; on CPU the
    host memory available at start-up)."""
    num_host_blocks: int = 256
    """Pages in host (pinned) memory for offload; 0 disables the host tier."""
    enable_prefix_caching: bool = True
    """Automatic prefix caching (serve_jax.kv_blocks): full pages stay findable by content, so
    a shared, re-sent or resumed prefix is not prefilled again."""
    host_prefix_caching: bool = False
    """The host pool as a second prefix-cache level: cached pages evicted from device memory are
    copied to host pages and promoted back instead of recomputed (needs num_host_blocks > 0)."""
    host_retention: str = "predicted"
    """Which freed pages the host level keeps (serve_jax.host_retention): ``predicted``, those
    an online estimate of reuse expects back (for single-turn traffic, none), or ``all``."""


@dataclasses.dataclass(frozen=True)
class SchedulerSection:
    """Batching and preemption."""

    max_num_seqs: int = 16
    """Most requests running at once."""
    max_num_batched_tokens: int = 256
    """Token budget per step (chunked prefill)."""
    policy: str = "fcfs_last"
    """Victim policy name (fcfs_last; others when serve_jax.preemption is present)."""
    preempt_mode: str = "recompute"
    """Mode of fcfs_last victims: recompute or offload."""


@dataclasses.dataclass(frozen=True)
class ExecutorSection:
    """Padding of the jitted step's shapes (each distinct shape compiles once)."""

    min_batch: int = 1
    """Smallest padded decode batch (batches are padded to powers of two at least this)."""
    prefill_rows: int = 0
    """Rows per prefill call (more chunks: more calls); 0: one call, batch padded to pow2."""
    min_chunk: int = 1
    """Smallest padded prefill chunk length (decodes are length 1)."""
    min_table_blocks: int = 1
    """Smallest padded block-table width."""
    mesh: str | None = None
    """Mesh spec for tensor parallelism, e.g. ``model=2`` (None: one device)."""
    plan_memory_limit_bytes: float | None = None
    """Per-device memory budget for the tapas_jax plan of the weights (None: the chip's)."""
    warmup: bool = False
    """Compile every step shape when the engine starts (servers and replays)."""


@dataclasses.dataclass(frozen=True)
class ServerSection:
    """HTTP server."""

    host: str = "127.0.0.1"
    """Bind address (loopback by default)."""
    port: int = 8000
    """TCP port."""
    max_queue: int = 256
    """Most unfinished requests; beyond it requests get 503 with Retry-After."""
    retry_after_s: int = 1
    """Retry-After seconds on 503."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Largest request body; a larger one gets 413 before it is read (Content-Length) or as
    soon as the bytes read pass it (chunked)."""
    max_stop_strings: int = 64
    """Most entries in ``stop`` and in ``stop_token_ids`` (each); more is a 400."""
    max_stop_string_chars: int = 1024
    """Longest ``stop`` string; longer is a 400."""
    max_n: int = 64
    """Largest ``n`` (samples per request); more is a 400."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything `serve_jax.engine.Engine` and the server need."""

    model: ModelSection = dataclasses.field(default_factory=ModelSection)
    cache: CacheSection = dataclasses.field(default_factory=CacheSection)
    scheduler: SchedulerSection = dataclasses.field(default_factory=SchedulerSection)
    executor: ExecutorSection = dataclasses.field(default_factory=ExecutorSection)
    server: ServerSection = dataclasses.field(default_factory=ServerSection)


def load_engine_config(
    name_or_path: str | os.PathLike | None = None, overrides: Iterable[str] = ()
) -> EngineConfig:
    """An `EngineConfig` from a preset name or YAML path (None: defaults) and dotted overrides."""
    path = preset_path("serve", name_or_path) if name_or_path is not None else None
    return load_config(EngineConfig, path, list(overrides))
