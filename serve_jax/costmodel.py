"""Roofline step-time model of a decoder-only LLM on one chip, for the serving simulator.

The simulator and the predictive preemption policy both price work with this module: how long a
prefill of ``n`` tokens takes, how long one decode step of a batch takes, and how long moving KV
blocks over the host link takes. Figures follow the jax-ml scaling-book conventions::

    T_math = FLOPs / (peak_flops * flops_efficiency)
    T_hbm  = weight bytes / (hbm_bandwidth * hbm_efficiency)
           + KV bytes / (hbm_bandwidth * kv_efficiency)
    T_step = max(T_math, T_hbm) + step_overhead_s      (T_math + T_hbm with overlap=False)
           + attention_chunks * attention_chunk_s

FLOPs of a forward pass over ``t`` new tokens are ``2 * P * t`` for the matmuls (``P`` the
non-embedding parameters plus the output projection) plus ``4 * H * D * L`` per (query, key) pair
for attention. Bytes are the weights read once per step, the KV cache read by attention and the
new KV written; KV traffic has its own efficiency (``kv_efficiency``, by default the weights')
because a paged cache is read as a gather of blocks. An accelerator overlaps compute with memory
traffic (the max); a CPU, whose cores do both, is closer to their sum (``overlap=False``):
`serve_jax.roofline_check` measures which figures fit the CPU engine. Two terms are there for
that CPU engine and are off by default (so accelerator figures are the plain roofline): a step of
a single token multiplies by the weights as matrix-vector products, which a CPU streams once,
while several rows make it pack the weights into panels first (about twice the traffic), hence a
weight-read efficiency of its own (``gemv_efficiency``); and the engine's paged attention
(`serve_jax.attention.paged_attention`) walks the longest sequence's context a chunk of
``attention_chunk_tokens`` at a time in every layer, each loop iteration with a fixed cost
(``attention_chunk_s``) whatever the batch. `RooflineCostModel.work` counts a step's work (the
simulator's step times and the CPU check both price it with `RooflineCostModel.seconds`). Chip
figures come from
`tapas_jax.hardware` so every cost model of the stack agrees; the model shapes are the
`serve_jax.model_config.ModelConfig` presets the engine serves (``llama-7b``, ``llama-13b``,
``llama3-8b``, ``tiny``, ...), at their parameter dtype.

KV capacity: a paged cache of ``block_size`` tokens per block holds
``floor(kv_bytes / (block_size * kv_bytes_per_token))`` blocks, where ``kv_bytes`` is either given
(``--kv-memory-gb``) or what is left of HBM after the weights at a memory utilisation fraction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import NamedTuple

from serve_jax.model_config import ModelConfig, get_model_config
from tapas_jax.hardware import HardwareProfile, get_profile

_new_tuple = tuple.__new__

__all__ = [
    "matmul_params",
    "weight_bytes",
    "RooflineCostModel",
    "StepWork",
    "kv_capacity_blocks",
]


def matmul_params(model: ModelConfig) -> int:
    """Parameters a matmul touches per token: the blocks plus the output projection."""
    d, kv = model.d_model, model.n_kv_heads * model.head_dim
    q = model.n_heads * model.head_dim
    attn = d * q + 2 * d * kv + q * d
    mlp = 3 * d * model.ffn_dim
    return model.n_layers * (attn + mlp) + d * model.vocab_size


def weight_bytes(model: ModelConfig) -> int:
    """Bytes of the weights in HBM (matmul weights and the input embedding; norms neglected)."""
    return (matmul_params(model) + model.d_model * model.vocab_size) * model.dtype_bytes


def kv_capacity_blocks(
    model: ModelConfig | str,
    hardware: HardwareProfile | str,
    *,
    block_size: int = 16,
    kv_memory_gb: float | None = None,
    memory_utilization: float = 0.9,
) -> int:
    """Number of KV blocks that fit in device memory.

    Args:
      model: model config or its preset name.
      hardware: hardware profile or its name.
      block_size: tokens per KV block.
      kv_memory_gb: bytes (in 1e9) given to the KV cache; None takes
        ``hbm * memory_utilization - weights`` (vLLM's ``gpu_memory_utilization`` rule).
      memory_utilization: fraction of HBM the server may use when ``kv_memory_gb`` is None.

    Returns:
      Whole blocks that fit.

    Raises:
      ValueError: non-positive sizes, or weights that do not fit the chip.
    """
    model, hw = get_model_config(model), get_profile(hardware)
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if kv_memory_gb is None:
        if not 0.0 < memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {memory_utilization}")
        weights = weight_bytes(model)
        kv_bytes = hw.hbm_bytes * memory_utilization - weights
        if kv_bytes <= 0:
            raise ValueError(
                f"the model's weights ({weights / 1e9:.1f} GB) do not fit "
                f"{hw.name} at memory_utilization={memory_utilization}"
            )
    else:
        if kv_memory_gb <= 0:
            raise ValueError(f"kv_memory_gb must be positive, got {kv_memory_gb}")
        kv_bytes = kv_memory_gb * 1e9
    return int(kv_bytes // (block_size * model.kv_bytes_per_token()))


class StepWork(NamedTuple):
    """The work of one engine step as the roofline counts it (`RooflineCostModel.work`)."""

    new_tokens: float
    """Tokens processed (prefill chunks plus one per decode)."""
    flops: float
    """Matmul FLOPs of the new tokens plus attention's over every (query, key) pair."""
    weight_bytes: float
    """Weights read (once per step)."""
    kv_bytes: float
    """Paged KV read by attention plus the new tokens' K and V written."""
    attention_chunks: float
    """Iterations of the paged-attention loop, all layers together: per layer, the longest
    prefill's and the longest decode's context in chunks of ``attention_chunk_tokens`` (the
    engine runs prefill chunks and decodes as separate batches, each walking its longest; the
    decodes are counted as sequences of one length)."""


@dataclasses.dataclass(frozen=True)
class RooflineCostModel:
    """Step times of one model on one chip; also the scheduler's `CostHints`.

    Efficiency factors turn the roofline (a lower bound) into achievable figures; the defaults
    are typical of well-tuned serving kernels (about 60% of peak FLOP/s in prefill, 80% of HBM
    bandwidth in decode), and the per-step overhead stands for launch and scheduling costs.
    """

    model: ModelConfig
    """Model shapes and dtype."""
    hardware: HardwareProfile
    """Chip profile."""
    block_size: int = 16
    """Tokens per KV block."""
    flops_efficiency: float = 0.6
    """Achieved fraction of peak FLOP/s."""
    hbm_efficiency: float = 0.8
    """Achieved fraction of HBM bandwidth reading the weights."""
    kv_efficiency: float | None = None
    """Achieved fraction of HBM bandwidth reading and writing paged KV; None: ``hbm_efficiency``."""
    gemv_efficiency: float | None = None
    """Achieved fraction of HBM bandwidth reading the weights in a step of one token (matrix-
    vector products); None: ``hbm_efficiency``."""
    attention_chunk_s: float = 0.0
    """Fixed cost of one iteration of the paged-attention loop (one layer, one chunk)."""
    attention_chunk_tokens: int = 32
    """Context tokens per iteration of that loop (`serve_jax.attention.paged_attention`'s
    ``chunk_tokens``)."""
    overlap: bool = True
    """Compute overlaps memory traffic (step = the larger); False adds them (a CPU)."""
    host_link_bandwidth: float | None = None
    """Device-to-host B/s for KV offload; None takes the profile's figure."""
    host_link_efficiency: float = 0.8
    """Achieved fraction of the host link bandwidth."""
    transfer_latency_s: float = 2e-5
    """Fixed cost of one batch of block copies."""
    step_overhead_s: float = 1e-3
    """Fixed cost of one engine step (launches, sampling, scheduling)."""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        for name in (
            "flops_efficiency",
            "hbm_efficiency",
            "kv_efficiency",
            "gemv_efficiency",
            "host_link_efficiency",
        ):
            v = getattr(self, name)
            if v is None:  # kv_efficiency, gemv_efficiency: hbm_efficiency's
                continue
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.host_link_bandwidth is not None and self.host_link_bandwidth <= 0:
            raise ValueError(
                f"host_link_bandwidth must be positive, got {self.host_link_bandwidth}"
            )
        if self.step_overhead_s < 0 or self.transfer_latency_s < 0 or self.attention_chunk_s < 0:
            raise ValueError(
                "step_overhead_s, transfer_latency_s and attention_chunk_s must be >= 0"
            )
        if self.attention_chunk_tokens <= 0:
            raise ValueError(
                f"attention_chunk_tokens must be positive, got {self.attention_chunk_tokens}"
            )
        # Constants of work and seconds, computed once (the simulator prices every step).
        m, hw = self.model, self.hardware
        consts = {
            "_flops_per_token": 2.0 * matmul_params(m),
            "_flops_per_pair": 4.0 * m.n_heads * m.head_dim * m.n_layers,
            "_weight_bytes": float(weight_bytes(m)),
            "_kv_bytes": float(m.kv_bytes_per_token()),
            "_flops_rate": hw.peak_flops * self.flops_efficiency,
            "_hbm_rate": hw.hbm_bandwidth * self.hbm_efficiency,
            "_kv_rate": hw.hbm_bandwidth * (self.kv_efficiency or self.hbm_efficiency),
            "_gemv_rate": hw.hbm_bandwidth * (self.gemv_efficiency or self.hbm_efficiency),
            "_one_rate": self.kv_efficiency is None and self.gemv_efficiency is None,
            "_layers": float(m.n_layers),
            "_count_loops": self.attention_chunk_s != 0,  # else they cost nothing: skip them
        }
        for k, v in consts.items():
            object.__setattr__(self, k, v)

    @classmethod
    def create(
        cls, model: str | ModelConfig = "llama-7b", hardware: str | HardwareProfile = "h100", **kw
    ) -> RooflineCostModel:
        """Builds a cost model from a model preset name (or config) and a hardware name."""
        return cls(model=get_model_config(model), hardware=get_profile(hardware), **kw)

    # -- primitive --------------------------------------------------------------------------

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block."""
        return self.block_size * self.model.kv_bytes_per_token()

    def work(
        self,
        chunks: Iterable[tuple[int, int]] = (),
        decode_batch: int = 0,
        decode_context: int = 0,
    ) -> StepWork:
        """The work of one step: prefill chunks plus a decode batch in one forward pass.

        Args:
          chunks: ``(new_tokens, cached_tokens)`` per prefill chunk.
          decode_batch: sequences decoding one token.
          decode_context: tokens those sequences hold in cache, in total (the attention loop
            is counted as for sequences of one length: the longest holds the mean).

        Raises:
          ValueError: negative work.
        """
        # tuple.__new__: a NamedTuple's own __new__ is a Python call.
        return _new_tuple(StepWork, self._count(chunks, decode_batch, decode_context, True))

    def _count(
        self, chunks: Iterable[tuple[int, int]], decode_batch: int, decode_context: int, loops: bool
    ) -> tuple[float, float, float, float, float]:
        """`work`'s counts as a plain tuple (no `StepWork` to build: the simulator prices every
        step through here); the attention-loop iterations are counted only when ``loops``
        (else 0: `step_seconds` skips them when an iteration costs nothing)."""
        size = self.attention_chunk_tokens
        new, pairs, read = float(decode_batch), float(decode_context), float(decode_context)
        n_loops = 0
        if decode_batch:
            if decode_batch < 0 or decode_context < 0:
                raise ValueError(f"bad decode batch ({decode_batch}, {decode_context})")
            if loops:
                longest = -(-decode_context // decode_batch)
                n_loops = -(-(longest + 1) // size)
        if chunks:
            longest = 0  # tokens of the longest prefill sequence, cached plus new
            for n, c in chunks:
                if n < 0 or c < 0:
                    raise ValueError(f"bad prefill chunk ({n}, {c})")
                new += n
                pairs += n * c + n * (n + 1) / 2.0
                read += c
                if n + c > longest:
                    longest = n + c
            if loops:
                n_loops += -(-longest // size)
        return (
            new,
            self._flops_per_token * new + self._flops_per_pair * pairs,
            self._weight_bytes,
            self._kv_bytes * (read + new),
            self._layers * n_loops,
        )

    def seconds(self, work: StepWork | tuple[float, ...]) -> float:
        """Time of one step that does ``work`` (`work`, or `_count`'s tuple of the same
        fields): 0 when there are no new tokens."""
        new, flops, weights, kv, loops = work
        if new == 0:
            return 0.0
        t_math = flops / self._flops_rate
        if self._one_rate:  # one rate: the same arithmetic as before kv_efficiency
            t_hbm = (weights + kv) / self._hbm_rate
        else:
            t_hbm = weights / (self._gemv_rate if new == 1 else self._hbm_rate) + kv / self._kv_rate
        t = (t_math if t_math > t_hbm else t_hbm) if self.overlap else t_math + t_hbm
        return t + self.step_overhead_s + loops * self.attention_chunk_s

    # -- CostHints ----------------------------------------------------------------------------

    def prefill_seconds(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``num_tokens`` new tokens after ``cached_tokens`` already in cache."""
        if num_tokens <= 0:
            return 0.0
        return self.seconds(self._count(((num_tokens, cached_tokens),), 0, 0, self._count_loops))

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch`` sequences holding ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return self.seconds(self._count((), batch, context_tokens, self._count_loops))

    def transfer_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` KV blocks one way over the host link."""
        if num_blocks <= 0:
            return 0.0
        bw = self.host_link_bandwidth or self.hardware.host_link_bandwidth
        return self.transfer_latency_s + num_blocks * self.block_bytes / (
            bw * self.host_link_efficiency
        )

    def step_seconds(
        self,
        chunks: Iterable[tuple[int, int]],
        decode_batch: int = 0,
        decode_context: int = 0,
    ) -> float:
        """Time of one mixed step: prefill chunks plus a decode batch in one forward pass (the
        arguments are `work`'s)."""
        return self.seconds(self._count(chunks, decode_batch, decode_context, self._count_loops))

    def kv_capacity_blocks(
        self, kv_memory_gb: float | None = None, memory_utilization: float = 0.9
    ) -> int:
        """KV blocks that fit this chip (see the module function)."""
        return kv_capacity_blocks(
            self.model,
            self.hardware,
            block_size=self.block_size,
            kv_memory_gb=kv_memory_gb,
            memory_utilization=memory_utilization,
        )
