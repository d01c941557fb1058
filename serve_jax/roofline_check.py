"""The roofline step times (`serve_jax.costmodel`) checked against the real engine on this CPU.

The simulator prices every step with `serve_jax.costmodel.RooflineCostModel`. This module asks
whether that model, given the machine's own figures, predicts what the JAX executor measures:

1. `measure_cpu_profile` measures three figures with micro-benchmarks that share nothing with
   the engine's forward: the matmul FLOP/s at the model's widths (a ``[tokens, d_model] x
   [d_model, ffn_dim]`` product), the memory bandwidth of a streaming read as large as the
   weights, and the fixed cost of one executor step (a jitted call with the executor's argument
   list, donated pools and host transfers, but no work). They become a `HardwareProfile`
   (efficiencies 1: the rates are achieved rates) and the cost model's ``step_overhead_s``.
2. `measure_steps_seconds` runs `serve_jax.executor.JaxExecutor.execute` on hand-made steps (a
   prefill of ``n`` tokens from an empty cache; a decode of ``batch`` sequences of ``context``
   tokens each). Shapes are chosen so the executor pads nothing (powers of two,
   ``min_table_blocks=1``): the roofline prices the work as given.
3. `check_shapes` puts them side by side two ways: the cost model as the simulator runs it
   (compute and memory overlap) on the measured rates with nothing fitted, and the cost model
   without overlap (``overlap=False``, the CPU's cores do both) whose figures are fitted on
   `FIT_SHAPES` and checked on the held-out shapes: the efficiencies of matmuls, of weight reads
   in batched steps and in one-token steps (matrix-vector products, which a CPU streams, where
   several rows make it pack the weights first: about half the bandwidth), of paged-KV traffic,
   and the fixed cost of one paged-attention loop iteration (`serve_jax.costmodel`). Both sides
   price a step from `serve_jax.costmodel.RooflineCostModel.work`.

Every time is process CPU time (`time.process_time`), the fastest of ``repeats`` runs, on both
sides: the machine this runs on is shared, and CPU time is what other jobs disturb least (wall
time under a load average of 10 was off by 2-4x). The step shapes are timed in rounds (each
round runs every shape once), so a burst of other load slows one run of several shapes rather
than every run of one. The command is ``python -m serve_jax roofline-check`` (`main`); this
module imports JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from serve_jax.costmodel import RooflineCostModel, StepWork, weight_bytes
from serve_jax.executor import JaxExecutor
from serve_jax.interface import ScheduledChunk, SchedulerOutput
from serve_jax.model import init_model
from serve_jax.model_config import ModelConfig, get_model_config
from tapas_jax.commands import command_parser, write_json
from tapas_jax.config import load_config, preset_path
from tapas_jax.hardware import HardwareProfile, get_profile

__all__ = [
    "RooflineCheckConfig",
    "StepShape",
    "measure_cpu_profile",
    "measure_steps_seconds",
    "check_shapes",
    "DEFAULT_SHAPES",
    "FIT_SHAPES",
    "fit_efficiencies",
    "main",
]


@dataclasses.dataclass(frozen=True)
class StepShape:
    """One engine step: ``kind`` ``prefill`` (``tokens`` new tokens, empty cache) or ``decode``
    (``batch`` sequences holding ``context`` tokens each, one new token each)."""

    kind: str
    batch: int = 1
    tokens: int = 0
    context: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("prefill", "decode"):
            raise ValueError(f"unknown step kind {self.kind!r}: expected prefill or decode")
        if self.batch < 1 or (self.tokens if self.kind == "prefill" else self.context) < 1:
            raise ValueError(f"{self.kind} step needs a positive batch and length: {self}")

    def label(self) -> str:
        """A short description for tables."""
        if self.kind == "prefill":
            return f"prefill {self.tokens} tokens"
        return f"decode batch {self.batch}, context {self.context}"


DEFAULT_SHAPES = (
    StepShape("prefill", tokens=64),
    StepShape("prefill", tokens=128),
    StepShape("prefill", tokens=256),
    StepShape("prefill", tokens=512),
    StepShape("decode", batch=1, context=127),
    StepShape("decode", batch=4, context=127),
    StepShape("decode", batch=16, context=127),
    StepShape("decode", batch=1, context=255),
    StepShape("decode", batch=2, context=255),
    StepShape("decode", batch=8, context=255),
    StepShape("decode", batch=1, context=511),
    StepShape("decode", batch=4, context=511),
    StepShape("decode", batch=16, context=511),
)
"""Prefill and decode shapes of the check (a decode's context plus its new token fills a
power-of-two number of 16-token blocks, so the executor pads nothing)."""

FIT_SHAPES = (
    StepShape("prefill", tokens=64),
    StepShape("prefill", tokens=256),
    StepShape("decode", batch=1, context=127),
    StepShape("decode", batch=4, context=127),
    StepShape("decode", batch=1, context=511),
    StepShape("decode", batch=16, context=511),
)
"""The shapes the efficiencies are fitted on; the other shapes of `DEFAULT_SHAPES` are held out."""


@dataclasses.dataclass(frozen=True)
class RooflineCheckConfig:
    """What ``roofline-check`` measures."""

    model: str = "small"
    """Model preset (float32 on CPU)."""
    block_size: int = 16
    """Tokens per KV block."""
    repeats: int = 7
    """Timed runs per shape and micro-benchmark (after one compiling run); the fastest is kept
    on both sides (other jobs on the machine only add time)."""
    seed: int = 0
    """Weights seed."""


_clock = time.process_time


def _best_seconds(fn, repeats: int) -> float:
    """Fastest of ``repeats`` timed calls after one warm-up call (other load only adds time)."""
    fn()  # compile / warm
    best = float("inf")
    for _ in range(repeats):
        t0 = _clock()
        fn()
        best = min(best, _clock() - t0)
    return best


def _matmul_flops(model: ModelConfig, dev, repeats: int) -> float:
    """Best FLOP/s of a ``[t, d_model] x [d_model, ffn_dim]`` matmul over t in 64..512."""
    dt = jnp.dtype(model.dtype)
    w = jax.device_put(jnp.ones((model.d_model, model.ffn_dim), dt), dev)
    matmul = jax.jit(lambda a, b: a @ b)
    rates = []
    for tokens in (64, 128, 256, 512):
        x = jax.device_put(jnp.ones((tokens, model.d_model), dt), dev)
        t = _best_seconds(lambda x=x: matmul(x, w).block_until_ready(), repeats)
        rates.append(2.0 * tokens * model.d_model * model.ffn_dim / t)
    return max(rates)


def _read_bandwidth(num_bytes: int, dev, repeats: int) -> float:
    """B/s of a streaming read (a sum) of ``num_bytes`` of float32."""
    big = jax.device_put(jnp.ones((max(num_bytes // 4, 1),), jnp.float32), dev)
    read = jax.jit(jnp.sum)
    return big.nbytes / _best_seconds(lambda: read(big).block_until_ready(), repeats)


def _step_overhead(executor: JaxExecutor, repeats: int) -> float:
    """Seconds of the executor's call without work: the same weight leaves and donated pools,
    host arrays in, a token array out."""

    def noop(leaves, k_pool, v_pool, tokens, *rest):
        return tokens[:, 0], k_pool, v_pool

    step = jax.jit(noop, donate_argnums=(1, 2))
    leaves = jax.tree.leaves(executor.params)
    args = [np.zeros((1, 1), np.int32)] + [np.zeros((1,), np.int32)] * 8

    def call():
        toks, executor.k_pool, executor.v_pool = step(
            leaves, executor.k_pool, executor.v_pool, *jax.device_put(args, executor.device)
        )
        np.asarray(toks)

    return _best_seconds(call, repeats)


def measure_cpu_profile(
    model: ModelConfig, executor: JaxExecutor, repeats: int = 7
) -> tuple[HardwareProfile, float]:
    """This machine's matmul FLOP/s, memory bandwidth and per-step overhead (module docstring).

    Returns:
      A profile based on the ``cpu`` one with the measured ``peak_flops`` and
      ``hbm_bandwidth``, and the measured step overhead in seconds.
    """
    flops = _matmul_flops(model, executor.device, repeats)
    num_bytes = weight_bytes(model)
    bandwidth = _read_bandwidth(num_bytes, executor.device, repeats)
    overhead = _step_overhead(executor, repeats)
    profile = dataclasses.replace(
        get_profile("cpu"),
        name="cpu-measured",
        peak_flops=flops,
        hbm_bandwidth=bandwidth,
        source=f"measured on this machine: best of {model.d_model}x{model.ffn_dim} matmuls over "
        f"64-512 tokens, streaming read of {num_bytes / 1e6:.0f} MB",
    )
    return profile, overhead


def _step_output(shape: StepShape, block_size: int) -> SchedulerOutput:
    """A hand-made step of ``shape`` on distinct blocks (token ids are arbitrary)."""
    out = SchedulerOutput(step=0)
    if shape.kind == "prefill":
        n = shape.tokens
        out.prefills = [ScheduledChunk("p0", 0, n, tuple(range(1, n + 1)), True, 0)]
        out.block_tables = {"p0": list(range(-(-n // block_size)))}
        return out
    per_seq = -(-(shape.context + 1) // block_size)
    for i in range(shape.batch):
        rid = f"d{i}"
        out.decodes.append(ScheduledChunk(rid, shape.context, 1, (1,), True, 1))
        out.block_tables[rid] = list(range(i * per_seq, (i + 1) * per_seq))
    return out


def blocks_needed(shapes, block_size: int) -> int:
    """Device blocks the hand-made steps of ``shapes`` use."""
    need = [-(-s.tokens // block_size) for s in shapes if s.kind == "prefill"]
    need += [s.batch * -(-(s.context + 1) // block_size) for s in shapes if s.kind == "decode"]
    return max(need)


def measure_steps_seconds(
    executor: JaxExecutor, shapes, repeats: int = 7
) -> dict[StepShape, float]:
    """Fastest ``step_seconds`` of each shape over ``repeats`` rounds that run every shape once
    in turn (after one compiling run of each)."""
    steps = {s: _step_output(s, executor.block_size) for s in shapes}
    for so in steps.values():
        executor.execute(so)
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(repeats):
        for s, so in steps.items():
            t0 = _clock()
            executor.execute(so)
            best[s] = min(best[s], _clock() - t0)
    return best


def shape_work(costs: RooflineCostModel, shape: StepShape) -> StepWork:
    """What the cost model counts for ``shape``."""
    if shape.kind == "prefill":
        return costs.work(((shape.tokens, 0),))
    return costs.work((), shape.batch, shape.batch * shape.context)


def predicted_seconds(costs: RooflineCostModel, shape: StepShape) -> float:
    """The cost model's time of ``shape``."""
    return costs.seconds(shape_work(costs, shape))


_FITTED = (
    "flops_efficiency",
    "hbm_efficiency",
    "kv_efficiency",
    "gemv_efficiency",
    "attention_chunk_s",
)


def fit_efficiencies(
    model: ModelConfig,
    profile: HardwareProfile,
    overhead_s: float,
    samples: list[tuple[StepShape, float]],
) -> dict[str, float | None]:
    """The cost model's efficiencies and attention-loop cost fitted to measured step times,
    with no overlap.

    With ``overlap=False`` a step takes ``o + F / (peak * e_f) + W / (bw * e_w) + K / (bw *
    e_k) + C * a``, where the weights ``W`` count at ``e_w`` in a step of several tokens and at
    ``e_gemv`` in a step of one, and ``C`` is the step's attention-loop iterations: linear in
    ``1 / e`` and ``a``, fitted by least squares on the relative error. A term no sample
    exercises (no one-token step, no step of several tokens, or an attention-loop cost fitted
    below zero) is left out of the fit: ``gemv_efficiency`` and ``hbm_efficiency`` are None
    (the cost model's default: ``gemv_efficiency`` None reads at ``hbm_efficiency``), and
    ``attention_chunk_s`` is 0.

    Args:
      model: the model the steps ran.
      profile: peak FLOP/s and bandwidth.
      overhead_s: fixed seconds per step.
      samples: (shape, measured seconds), at least as many as the terms fitted.

    Returns:
      ``flops_efficiency``, ``hbm_efficiency``, ``kv_efficiency`` and ``gemv_efficiency``, each
      clipped to (0, 1] (``hbm_efficiency`` and ``gemv_efficiency`` None when left out), and
      ``attention_chunk_s``.

    Raises:
      ValueError: fewer samples than terms.
    """
    costs = RooflineCostModel(model, profile)
    bw = profile.hbm_bandwidth
    rows = []
    for shape, _ in samples:
        w = shape_work(costs, shape)
        one = w.new_tokens == 1
        weights = w.weight_bytes / bw
        rows.append(
            (
                w.flops / profile.peak_flops,
                0.0 if one else weights,
                w.kv_bytes / bw,
                weights if one else 0.0,
                w.attention_chunks,
            )
        )
    a = np.array(rows).reshape(len(samples), len(_FITTED))
    y = np.array([max(t - overhead_s, 1e-9) for _, t in samples])
    terms = [j for j in range(len(_FITTED)) if j in (0, 2) or a[:, j].any()]
    while True:
        if len(samples) < len(terms):
            raise ValueError(
                f"fitting {len(terms)} terms needs >= {len(terms)} step times, got {len(samples)}"
            )
        x, *_ = np.linalg.lstsq(a[:, terms] / y[:, None], np.ones_like(y), rcond=None)
        if 4 not in terms or x[-1] >= 0:
            break
        terms.remove(4)
    fitted = dict(zip([_FITTED[j] for j in terms], map(float, x)))
    out: dict[str, float | None] = {
        name: float(np.clip(1.0 / max(fitted[name], 1e-6), 1e-3, 1.0)) if name in fitted else None
        for name in _FITTED[:4]
    }
    out["attention_chunk_s"] = fitted.get("attention_chunk_s", 0.0)
    return out


def make_executor(config: RooflineCheckConfig, shapes) -> tuple[ModelConfig, JaxExecutor]:
    """The model (random weights) and an executor that pads no shape of ``shapes``."""
    model_cfg = get_model_config(config.model, dtype="float32")
    model = init_model(model_cfg, config.seed)
    blocks = blocks_needed(shapes, config.block_size)
    return model_cfg, JaxExecutor(model, blocks, config.block_size, use_host_tier=False)


def check_shapes(
    config: RooflineCheckConfig, shapes=DEFAULT_SHAPES, fit_on=FIT_SHAPES
) -> dict[str, Any]:
    """Predicted against measured step time for each shape, two ways.

    ``roofline``: the cost model as the simulator uses it (compute and memory overlap) with the
    measured peak rates and efficiencies 1. ``fitted``: no overlap, with the efficiencies and
    the attention-loop cost fitted (`fit_efficiencies`) on the shapes ``fit_on`` only; the
    others are held out.

    Returns:
      ``rows`` (per shape: ``shape``, ``kind``, ``batch``, ``tokens``, ``context``,
      ``measured_ms``, ``roofline_ms``, ``roofline_error``, ``fitted_ms``, ``fitted_error``
      (errors are predicted / measured - 1), ``fitted_on``), ``profile``, ``step_overhead_s``
      and ``efficiencies``.
    """
    model_cfg, executor = make_executor(config, shapes)
    profile, overhead = measure_cpu_profile(model_cfg, executor, config.repeats)
    measured = measure_steps_seconds(executor, shapes, config.repeats)
    eff = fit_efficiencies(
        model_cfg, profile, overhead, [(s, measured[s]) for s in shapes if s in fit_on]
    )
    common = dict(block_size=config.block_size, step_overhead_s=overhead)
    roofline = RooflineCostModel(
        model_cfg, profile, flops_efficiency=1.0, hbm_efficiency=1.0, **common
    )
    given = {k: v for k, v in eff.items() if v is not None}  # (None: the cost model's default)
    fitted = RooflineCostModel(model_cfg, profile, overlap=False, **given, **common)
    rows = []
    for s in shapes:
        t = measured[s]
        r, f = predicted_seconds(roofline, s), predicted_seconds(fitted, s)
        rows.append(
            {
                "shape": s.label(),
                **dataclasses.asdict(s),
                "measured_ms": t * 1e3,
                "roofline_ms": r * 1e3,
                "roofline_error": r / t - 1.0,
                "fitted_ms": f * 1e3,
                "fitted_error": f / t - 1.0,
                "fitted_on": s in fit_on,
            }
        )
    return {
        "rows": rows,
        "profile": dataclasses.asdict(profile),
        "step_overhead_s": overhead,
        "efficiencies": eff,
    }


def build_parser(prog: str = "roofline-check") -> argparse.ArgumentParser:
    """The command-line parser of ``roofline-check``."""
    p = command_parser(
        "serve_jax",
        prog,
        RooflineCheckConfig,
        description="Measure this machine's FLOP/s, bandwidth and step overhead, then compare "
        "the roofline step times with the JAX engine's measured prefill and decode steps.",
        example="repeats=11",
    )
    p.add_argument("--json", default=None, help="write the rows (and the profile) here")
    return p


def main(argv: list[str]) -> int:
    """Runs ``roofline-check``; ``argv[0]`` is the command name."""
    args = build_parser(argv[0] if argv else "roofline-check").parse_args(argv[1:])
    path = preset_path("serve", args.config) if args.config else None
    config = load_config(RooflineCheckConfig, path, list(args.overrides))
    out = check_shapes(config)
    prof, eff = out["profile"], out["efficiencies"]
    print(
        f"{config.model} on {jax.devices()[0].device_kind}: matmul {prof['peak_flops'] / 1e9:.1f} "
        f"GFLOP/s, read {prof['hbm_bandwidth'] / 1e9:.1f} GB/s, step overhead "
        f"{out['step_overhead_s'] * 1e3:.2f} ms (process CPU time); fitted "
        + ", ".join(f"{k} {v:.3g}" for k, v in eff.items() if v is not None)
    )
    print(
        f"{'shape':30s} {'measured':>9s} {'roofline':>9s} {'error':>7s} {'fitted':>9s} "
        f"{'error':>7s}  (ms)"
    )
    for r in out["rows"]:
        print(
            f"{r['shape']:30s} {r['measured_ms']:9.2f} {r['roofline_ms']:9.2f} "
            f"{r['roofline_error']:+7.1%} {r['fitted_ms']:9.2f} {r['fitted_error']:+7.1%}"
            + ("  (fitted on)" if r["fitted_on"] else "")
        )
    write_json(args.json, out)
    return 0
