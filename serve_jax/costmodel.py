"""Roofline step-time model of a decoder-only LLM on one chip, for the serving simulator.

The simulator and the predictive preemption policy both price work with this module: how long a
prefill of ``n`` tokens takes, how long one decode step of a batch takes, and how long moving KV
blocks over the host link takes. Figures follow the jax-ml scaling-book conventions::

    T_math = FLOPs / (peak_flops * flops_efficiency)
    T_hbm  = weight bytes / (hbm_bandwidth * hbm_efficiency)
           + KV bytes / (hbm_bandwidth * kv_efficiency)
    T_step = max(T_math, T_hbm) + step_overhead_s      (T_math + T_hbm with overlap=False)

FLOPs of a forward pass over ``t`` new tokens are ``2 * P * t`` for the matmuls (``P`` the
non-embedding parameters plus the output projection) plus ``4 * H * D * L`` per (query, key) pair
for attention. Bytes are the weights read once per step, the KV cache read by attention and the
new KV written; KV traffic has its own efficiency (``kv_efficiency``, by default the weights')
because a paged cache is read as a gather of blocks. An accelerator overlaps compute with memory
traffic (the max); a CPU, whose cores do both, is closer to their sum (``overlap=False``):
`serve_jax.roofline_check` measures which figures fit the CPU engine. Chip figures come from
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

from serve_jax.model_config import ModelConfig, get_model_config
from tapas_jax.hardware import HardwareProfile, get_profile

__all__ = [
    "matmul_params",
    "weight_bytes",
    "RooflineCostModel",
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
        for name in ("flops_efficiency", "hbm_efficiency", "kv_efficiency", "host_link_efficiency"):
            v = getattr(self, name)
            if name == "kv_efficiency" and v is None:
                continue
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.host_link_bandwidth is not None and self.host_link_bandwidth <= 0:
            raise ValueError(
                f"host_link_bandwidth must be positive, got {self.host_link_bandwidth}"
            )
        if self.step_overhead_s < 0 or self.transfer_latency_s < 0:
            raise ValueError("step_overhead_s and transfer_latency_s must be >= 0")
        # Constants of forward_seconds, computed once (the simulator calls it every step).
        m, hw = self.model, self.hardware
        consts = {
            "_flops_per_token": 2.0 * matmul_params(m),
            "_flops_per_pair": 4.0 * m.n_heads * m.head_dim * m.n_layers,
            "_weight_bytes": float(weight_bytes(m)),
            "_kv_bytes": float(m.kv_bytes_per_token()),
            "_flops_rate": hw.peak_flops * self.flops_efficiency,
            "_hbm_rate": hw.hbm_bandwidth * self.hbm_efficiency,
            "_kv_rate": hw.hbm_bandwidth * (self.kv_efficiency or 1.0),
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

    def forward_seconds(
        self, new_tokens: float, attention_pairs: float, kv_read_tokens: float
    ) -> float:
        """Time of one forward pass (one engine step) with the given work.

        Args:
          new_tokens: tokens processed this step (prefill chunks plus one per decode).
          attention_pairs: (query, key) pairs attention computes over all new tokens.
          kv_read_tokens: cached tokens whose K and V attention reads from HBM.

        Returns:
          Seconds, including the fixed per-step overhead; 0 when there is no work.
        """
        if new_tokens < 0 or attention_pairs < 0 or kv_read_tokens < 0:
            raise ValueError("forward_seconds needs non-negative work")
        if new_tokens == 0:
            return 0.0
        flops = self._flops_per_token * new_tokens + self._flops_per_pair * attention_pairs
        kv_bytes = self._kv_bytes * (kv_read_tokens + new_tokens)
        t_math = flops / self._flops_rate
        if self.kv_efficiency is None:  # one rate: the same arithmetic as before kv_efficiency
            t_hbm = (self._weight_bytes + kv_bytes) / self._hbm_rate
        else:
            t_hbm = self._weight_bytes / self._hbm_rate + kv_bytes / self._kv_rate
        t = max(t_math, t_hbm) if self.overlap else t_math + t_hbm
        return t + self.step_overhead_s

    # -- CostHints ----------------------------------------------------------------------------

    def prefill_seconds(self, num_tokens: int, cached_tokens: int = 0) -> float:
        """Time to prefill ``num_tokens`` new tokens after ``cached_tokens`` already in cache."""
        if num_tokens <= 0:
            return 0.0
        n, c = float(num_tokens), float(cached_tokens)
        pairs = n * c + n * (n + 1) / 2.0
        return self.forward_seconds(n, pairs, c)

    def decode_seconds(self, batch: int, context_tokens: int) -> float:
        """Time of one decode step of ``batch`` sequences holding ``context_tokens`` in total."""
        if batch <= 0:
            return 0.0
        return self.forward_seconds(batch, context_tokens, context_tokens)

    def transfer_seconds(self, num_blocks: int) -> float:
        """Time to copy ``num_blocks`` KV blocks one way over the host link."""
        if num_blocks <= 0:
            return 0.0
        bw = self.host_link_bandwidth or self.hardware.host_link_bandwidth
        return self.transfer_latency_s + num_blocks * self.block_bytes / (
            bw * self.host_link_efficiency
        )

    def step_seconds(
        self, chunks: Iterable[tuple[int, int]], decode_batch: int = 0, decode_context: int = 0
    ) -> float:
        """Time of one mixed step: prefill chunks plus a decode batch in one forward pass.

        Args:
          chunks: ``(new_tokens, cached_tokens)`` per prefill chunk.
          decode_batch: sequences decoding one token.
          decode_context: tokens those sequences hold in cache, in total.
        """
        new, pairs, read = float(decode_batch), float(decode_context), float(decode_context)
        for n, c in chunks:
            if n < 0 or c < 0:
                raise ValueError(f"bad prefill chunk ({n}, {c})")
            new += n
            pairs += n * c + n * (n + 1) / 2.0
            read += c
        return self.forward_seconds(new, pairs, read)

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
