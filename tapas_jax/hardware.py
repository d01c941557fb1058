"""Hardware profiles: per-chip compute, memory and link figures used by every cost model here.

The sharding search (`tapas_jax`), the ParaGAN scaling model and the serving simulator all price
work with the same numbers, so they live in one table. Conventions follow the jax-ml scaling book:
``T_math = FLOPs / peak_flops``, ``T_hbm = bytes / hbm_bandwidth``, ``T_comm = bytes / bandwidth``.

Figures are per chip (a GPU counts as one chip) and dense bf16. ``ici_link_bandwidth`` is one-way
per link; ``axis_bandwidth`` is what one device can push into a ring collective over one mesh
axis (both directions of a torus ring on TPU; the NVLink one-way figure on an NVSwitch GPU node).
Sources are kept next to each profile; the CPU profile is a rough calibration of the simulated
8-device mesh on a 2-core VM, good for ranking plans, not for predicting seconds.
"""

from __future__ import annotations

import dataclasses
import re

__all__ = [
    "HardwareProfile",
    "PROFILES",
    "TpuSlice",
    "get_profile",
    "profile_for_device",
    "tpu_slice",
]

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One accelerator chip and the links around it."""

    name: str
    """Short name used on command lines, e.g. ``tpu-v5e``."""
    kind: str
    """``tpu``, ``gpu`` or ``cpu``."""
    peak_flops: float
    """Dense bf16 FLOP/s per chip."""
    hbm_bytes: float
    """Device memory per chip in bytes."""
    hbm_bandwidth: float
    """Device memory bandwidth per chip, B/s."""
    ici_link_bandwidth: float
    """Chip-to-chip link bandwidth, one way, per link, B/s (ICI on TPU, NVLink on GPU)."""
    axis_bandwidth: float
    """B/s one device moves in a ring collective along one mesh axis."""
    collective_latency: float
    """Per-hop latency (the alpha of the alpha-beta model), seconds."""
    host_link_bandwidth: float
    """Chip to host memory (PCIe), one way, B/s: what a KV-page offload pays."""
    dcn_bandwidth: float
    """Data-centre network bandwidth per host, B/s (between slices or nodes)."""
    chips_per_host: int
    """Chips attached to one host."""
    source: str
    """Where the figures come from."""

    @property
    def hbm_gib(self) -> float:
        return self.hbm_bytes / GiB


_SCALING_BOOK = "jax-ml scaling book, 'How to Think About TPUs' (chip and ICI tables)"

PROFILES: dict[str, HardwareProfile] = {
    p.name: p
    for p in [
        HardwareProfile(
            name="tpu-v3",
            kind="tpu",
            peak_flops=1.23e14,
            hbm_bytes=32 * GiB,
            hbm_bandwidth=9.0e11,
            ici_link_bandwidth=1.0e11,
            axis_bandwidth=2.0e11,
            collective_latency=1e-6,
            host_link_bandwidth=1.5e10,
            dcn_bandwidth=2.5e10,
            chips_per_host=4,
            source="cloud.google.com/tpu/docs/v3 (123 TFLOP/s bf16, 32 GiB, 900 GB/s); ICI: "
            + _SCALING_BOOK,
        ),
        HardwareProfile(
            name="tpu-v4",
            kind="tpu",
            peak_flops=2.75e14,
            hbm_bytes=32 * GiB,
            hbm_bandwidth=1.2e12,
            ici_link_bandwidth=4.5e10,
            axis_bandwidth=9.0e10,
            collective_latency=1e-6,
            host_link_bandwidth=1.5e10,
            dcn_bandwidth=2.5e10,
            chips_per_host=4,
            source="cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB, 1200 GB/s); ICI: "
            + _SCALING_BOOK,
        ),
        HardwareProfile(
            name="tpu-v5e",
            kind="tpu",
            peak_flops=1.97e14,
            hbm_bytes=16 * GiB,
            hbm_bandwidth=8.1e11,
            ici_link_bandwidth=4.5e10,
            axis_bandwidth=9.0e10,
            collective_latency=1e-6,
            host_link_bandwidth=1.5e10,
            dcn_bandwidth=2.5e10,
            chips_per_host=8,
            source="cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, 16 GiB, 819 GB/s); ICI, PCIe, "
            "DCN: " + _SCALING_BOOK,
        ),
        HardwareProfile(
            name="tpu-v5p",
            kind="tpu",
            peak_flops=4.59e14,
            hbm_bytes=95 * GiB,
            hbm_bandwidth=2.76e12,
            ici_link_bandwidth=9.0e10,
            axis_bandwidth=1.8e11,
            collective_latency=1e-6,
            host_link_bandwidth=1.5e10,
            dcn_bandwidth=2.5e10,
            chips_per_host=4,
            source="cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB, 2765 GB/s); ICI: "
            + _SCALING_BOOK,
        ),
        HardwareProfile(
            name="tpu-v6e",
            kind="tpu",
            peak_flops=9.18e14,
            hbm_bytes=32 * GiB,
            hbm_bandwidth=1.64e12,
            ici_link_bandwidth=9.0e10,
            axis_bandwidth=1.8e11,
            collective_latency=1e-6,
            host_link_bandwidth=1.5e10,
            dcn_bandwidth=2.5e10,
            chips_per_host=8,
            source="cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, 32 GiB, 1640 GB/s); ICI: "
            + _SCALING_BOOK,
        ),
        HardwareProfile(
            name="h100",
            kind="gpu",
            peak_flops=9.89e14,
            hbm_bytes=80e9,
            hbm_bandwidth=3.35e12,
            ici_link_bandwidth=4.5e11,
            axis_bandwidth=4.5e11,
            collective_latency=5e-6,
            host_link_bandwidth=5.0e10,
            dcn_bandwidth=5.0e10,
            chips_per_host=8,
            source="NVIDIA H100 SXM5 datasheet (989 TFLOP/s dense bf16, 80 GB HBM3, 3.35 TB/s, "
            "NVLink "
            "900 GB/s bidirectional, PCIe Gen5 x16 ~64 GB/s one way, 400 Gb/s InfiniBand per GPU)",
        ),
        HardwareProfile(
            name="h200",
            kind="gpu",
            peak_flops=9.89e14,
            hbm_bytes=141e9,
            hbm_bandwidth=4.8e12,
            ici_link_bandwidth=4.5e11,
            axis_bandwidth=4.5e11,
            collective_latency=5e-6,
            host_link_bandwidth=5.0e10,
            dcn_bandwidth=5.0e10,
            chips_per_host=8,
            source="NVIDIA H200 SXM datasheet (989 TFLOP/s dense bf16, 141 GB HBM3e, 4.8 TB/s, "
            "NVLink "
            "900 GB/s bidirectional, PCIe Gen5 x16 ~64 GB/s one way)",
        ),
        HardwareProfile(
            name="cpu",
            kind="cpu",
            peak_flops=5.0e10,
            hbm_bytes=2 * GiB,
            hbm_bandwidth=1.0e10,
            ici_link_bandwidth=5.0e9,
            axis_bandwidth=5.0e9,
            collective_latency=2e-5,
            host_link_bandwidth=1.0e10,
            dcn_bandwidth=1.0e10,
            chips_per_host=8,
            source="rough calibration of one simulated device of the 8-device CPU test mesh on a "
            "2-core "
            "VM (XLA_FLAGS=--xla_force_host_platform_device_count=8); for ranking plans only",
        ),
    ]
}


def get_profile(name: str | HardwareProfile) -> HardwareProfile:
    """Looks up a profile by name (case-insensitive); passes a profile through."""
    if isinstance(name, HardwareProfile):
        return name
    key = name.strip().lower()
    if key not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


# Substrings of ``jax.Device.device_kind`` (lower case) -> profile, most specific first.
_DEVICE_KINDS = (
    ("v6", "tpu-v6e"),
    ("v5p", "tpu-v5p"),
    ("v5 lite", "tpu-v5e"),
    ("v5e", "tpu-v5e"),
    ("v5", "tpu-v5p"),  # a v5p reports "TPU v5"
    ("v4", "tpu-v4"),
    ("v3", "tpu-v3"),
    ("h200", "h200"),
    ("h100", "h100"),
)
# A platform whose device kind names no profile above.
_PLATFORM_DEFAULTS = {"tpu": "tpu-v5e", "gpu": "h100", "cuda": "h100", "rocm": "h100", "cpu": "cpu"}


def profile_for_device(platform: str, device_kind: str = "") -> HardwareProfile:
    """The profile of the chip a program runs on: the one place that maps a backend to figures.

    Args:
      platform: ``jax.default_backend()`` (``tpu``, ``gpu``, ``cpu``).
      device_kind: ``jax.devices()[0].device_kind`` (``"TPU v5 lite"``, ``"NVIDIA H200"``); it
        picks the generation when it names one, else the platform's default profile is used.

    Takes strings rather than devices so that pure-Python users (the serving cost model) need no
    jax import.
    """
    kind = device_kind.lower()
    for needle, name in _DEVICE_KINDS:
        if needle in kind:
            return PROFILES[name]
    key = platform.strip().lower()
    if key not in _PLATFORM_DEFAULTS:
        raise ValueError(f"no hardware profile for platform {platform!r}")
    return PROFILES[_PLATFORM_DEFAULTS[key]]


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """The chips, TensorCores and hosts of one Cloud TPU accelerator type."""

    accelerator: str
    """The type as given, e.g. ``v3-32``."""
    chips: int
    cores: int
    """TensorCores."""
    hosts: int
    """TPU VM workers (hosts) of the slice."""
    profile: str
    """The `PROFILES` name of its chip."""


_TPU_TYPE = re.compile(r"(v2|v3|v4|v5p|v5litepod|v5e|v6e)-(\d+)")


def tpu_slice(accelerator: str) -> TpuSlice:
    """Chips, TensorCores and hosts of a Cloud TPU accelerator type (``v3-32``, ``v6e-16``).

    v2, v3, v4 and v5p types count TensorCores (two per chip); v5e (``v5litepod-N``) and v6e
    count chips. Hosts hold 4 chips, except single-host v5e/v6e slices of up to 8 chips.
    """
    m = _TPU_TYPE.fullmatch(accelerator.strip().lower())
    if not m:
        raise ValueError(
            f"unknown accelerator type {accelerator!r}; expected e.g. v3-8, v3-32, v4-16, "
            "v5p-8, v5litepod-16, v6e-8"
        )
    gen, n = m.group(1), int(m.group(2))
    if gen in ("v2", "v3", "v4", "v5p"):
        if n % 2:
            raise ValueError(f"{accelerator}: {gen} sizes count TensorCores, two per chip")
        chips, cores = n // 2, n
    else:
        chips, cores = n, n
    hosts = 1 if (gen in ("v5litepod", "v5e", "v6e") and chips <= 8) else max(1, -(-chips // 4))
    profile = {"v5litepod": "tpu-v5e", "v5e": "tpu-v5e"}.get(gen, f"tpu-{gen}")
    return TpuSlice(accelerator, chips, cores, hosts, profile)
