"""``python -m paragan_jax scaling`` and the internal ``train-multihost``.

scaling: predicted step time and scaling efficiency of the sync and async schemes at several chip
counts (`paragan_jax.scaling`), optionally checked against measured 1/2/4-process CPU runs
(`paragan_jax.scaling_check`); JSON and a PNG of the efficiency curve with ParaGAN's published
point. Settings are `ScalingCommand` (a preset via ``--config``, flags, ``key=value`` overrides;
`paragan_jax.command_config`)::

    python -m paragan_jax scaling --model biggan128 --chips 8,64,256,1024 --hardware tpu-v3 \
        --json runs/scaling.json --check-cpu 1,2,4

train-multihost (internal, run on every TPU VM worker by ``scripts/tpu_run.sh``):
`jax.distributed.initialize()`, then ``train``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
from matplotlib.figure import Figure

from tapas_jax.commands import write_json
from tapas_jax.hardware import get_profile

from . import cli
from .command_config import command_config_parser, load_command_config
from .overlap import read_schedule, scheme_overlap
from .scaling import (
    PAPER_EFFICIENCY_1024_CORES,
    RANGES,
    ScalingParams,
    count_step_collectives,
    load_model_config,
    measure_step_costs,
    predict,
    predict_band,
)
from .scaling_check import check_cpu

__all__ = ["ScalingCommand", "main", "plot_scaling", "run_scaling", "train_multihost"]


@dataclasses.dataclass(frozen=True)
class ScalingCommand:
    """Settings of ``python -m paragan_jax scaling``."""

    model: str = "biggan128"
    """The GAN whose scaling is predicted: biggan128, biggan256 or a training preset."""
    chips: list[int] = dataclasses.field(default_factory=lambda: [8, 64, 256, 1024])
    """Chip counts to predict."""
    hardware: str = "tpu-v3"
    """tapas_jax hardware profile of the chips."""
    per_chip_batch: int = 8
    """Examples per chip (weak scaling: the global batch grows with the chips)."""
    achieved_fraction: float | None = None
    """Expected share of peak FLOP/s one chip's step reaches; empty: XLA's TPU cost-model
    estimate when the schedule is read for a TPU, else 0.5."""
    achieved_fraction_band: list[float] = dataclasses.field(
        default_factory=lambda: [RANGES["achieved_fraction"][0], RANGES["achieved_fraction"][2]]
    )
    """Low and high share of peak (the band's ends)."""
    jitter: float = RANGES["jitter"][1]
    """Expected relative std of one chip's step time."""
    jitter_band: list[float] = dataclasses.field(
        default_factory=lambda: [RANGES["jitter"][0], RANGES["jitter"][2]]
    )
    """Low and high jitter (the band's ends)."""
    schedule: str = ""
    """Read the overlap from the compiled programs: cpu (this machine's devices),
    tpu:<topology> (tpu:v3:4x4, deviceless, needs libtpu; compiler flags via LIBTPU_INIT_ARGS)
    or hlo:<dir> (programs written before by schedule_dump); empty: no overlap (assumed)."""
    schedule_dump: str = ""
    """Write the compiled programs read for `schedule` here (read them again: hlo:<dir>)."""
    overlap: float = ScalingParams.overlap
    """Hidden share of the all-reduce when the schedule is not read."""
    small_collectives: int = ScalingParams.small_collectives
    """Latency-bound collectives per step besides the gradient all-reduces."""
    count_collectives: bool = False
    """Count the step's small collectives from a narrow compiled copy of the model (slow)."""
    check_cpu: list[int] = dataclasses.field(default_factory=list)
    """Also measure these CPU process counts (1 and 2 fit, e.g. 1,2,3,4); empty: no check."""
    check_steps: int = 5
    """Steps per round per process count of the CPU check."""
    check_widths: list[int] = dataclasses.field(default_factory=lambda: [16, 32, 48])
    """Model widths of the CPU check: the first two fit the step's FLOP rate and fixed cost (one
    process), the others are only predicted (with two widths, only the first is fitted)."""
    check_schemes: list[str] = dataclasses.field(default_factory=lambda: ["sync", "async"])
    """Schemes the CPU check measures (async: G and D groups of processes, 2 processes and up;
    the first width at 2 processes fits its exchange's host cost)."""
    json: str | None = None
    """Write the rows and inputs here (and the plot next to it as .png)."""

    def __post_init__(self):
        if not self.chips or min(self.chips) < 1:
            raise ValueError(
                f"chips {self.chips}: expected positive integers such as 8,64,256,1024"
            )
        procs = sorted(set(self.check_cpu))
        if procs and (procs[:2] != [1, 2] or len(procs) < 3):
            raise ValueError(
                f"check_cpu {self.check_cpu}: needs 1 and 2 (calibration) and at least one "
                "larger process count, e.g. 1,2,4"
            )
        if not self.check_schemes or not set(self.check_schemes) <= {"sync", "async"}:
            raise ValueError(f"check_schemes {self.check_schemes}: expected sync and/or async")
        for name in ("achieved_fraction_band", "jitter_band"):
            band = getattr(self, name)
            if len(band) != 2 or band[0] > band[1]:
                raise ValueError(f"{name} {band}: expected two values, low then high")


def _inputs_table(cfg, hw, costs, params, ranges, schedule_info) -> list[dict[str, Any]]:
    """Every input of the prediction, its value and where it comes from."""
    cmd = "python -m paragan_jax scaling (XLA cost analysis of the lowered trainer pieces)"
    sched = schedule_info["target"] if schedule_info else None
    af_src = (
        ("compiled", f"XLA TPU cost model of the compiled sync step (schedule={sched})")
        if schedule_info and schedule_info.get("achieved_from_compiler")
        else ("assumed", "range of conv training steps on TPUs; none measured here (no TPU)")
    )
    if cfg.achieved_fraction is not None:
        af_src = ("given", "achieved_fraction= on the command line / preset")
    rows = [
        ("D update FLOPs", costs.d_update_flops, "measured", cmd),
        ("G update FLOPs", costs.g_update_flops, "measured", cmd),
        ("fakes FLOPs", costs.fakes_flops, "measured", cmd),
        ("G / D parameter bytes", [costs.g_param_bytes, costs.d_param_bytes], "measured",
         "abstract train state (jax.eval_shape of the trainer's init)"),
        ("n_disc, staleness k", [costs.n_disc, costs.staleness], "config",
         f"preset of model {cfg.model!r} (BigGAN: Brock et al. 2019, ICLR)"),
        ("per-chip batch", cfg.per_chip_batch, "config", "per_chip_batch="),
        ("peak FLOP/s per chip", hw.peak_flops, "published", hw.source),
        ("ICI per-axis bandwidth B/s", hw.axis_bandwidth, "published", hw.source),
        ("per-hop latency s", hw.collective_latency, "published", hw.source),
        ("torus shape", "most square a x b", "published",
         "TPU v3 pods are 2-D tori: jax-ml scaling book, 'How to Think About TPUs'"),
        ("achieved_fraction (low, expected, high)", list(ranges["achieved_fraction"]), *af_src),
        ("jitter (low, expected, high)", list(ranges["jitter"]),
         "given" if list(ranges["jitter"]) != list(RANGES["jitter"]) else "assumed",
         "no published per-chip spread found (ParaGAN arXiv:2411.03999 gives none); "
         "0 dedicated, 2% expected, 5% congested host"),
        ("overlap", "per row (overlap_hidden)" if sched else params.overlap,
         "compiled" if sched else "assumed",
         f"scheduled HLO of each scheme's programs (schedule={sched})" if sched
         else "schedule not read: nothing hidden"),
        ("small collectives per step", params.small_collectives,
         "compiled" if (sched or cfg.count_collectives) else "assumed",
         "collectives under 64 KiB in the compiled sync step" if sched else
         ("--count-collectives" if cfg.count_collectives else "not counted: 0")),
    ]  # fmt: skip
    return [{"input": n, "value": v, "kind": k, "source": src} for n, v, k, src in rows]


def run_scaling(cfg: ScalingCommand) -> dict[str, Any]:
    """The predictions (and CPU check) of one `ScalingCommand`, printed and returned."""
    hw = get_profile(cfg.hardware)
    small, counted = cfg.small_collectives, None
    if cfg.count_collectives:
        narrow = load_model_config(
            cfg.model,
            cfg.per_chip_batch,
            [
                "model.g_width=4",
                "model.d_width=4",
                "model.dtype=float32",
                "sharding.params=replicated",
            ],
        )
        counted = count_step_collectives(narrow)
        # XLA combines the gradient all-reduces into a few; count them all as small ones
        # (an over-estimate by those few latency terms).
        small = int(sum(counted.values()))
    model_cfg = load_model_config(cfg.model, cfg.per_chip_batch)
    costs = measure_step_costs(model_cfg, cfg.model)
    reports, info = {}, None
    af = cfg.achieved_fraction
    if cfg.schedule:
        reports, info = read_schedule(
            model_cfg, cfg.schedule, cfg.per_chip_batch, dump_dir=cfg.schedule_dump or None
        )
        sync = reports["sync"]
        small = sum(c.payload_bytes < 1 << 16 for c in sync.collectives)
        prog = info["programs"]["sync"]
        if af is None and prog["xla_estimated_seconds"] > 0:
            per_device_peak = hw.peak_flops / info["devices_per_chip"]
            af = prog["xla_flops"] / (prog["xla_estimated_seconds"] * per_device_peak)
            info["achieved_from_compiler"] = af
    expected_af = af if af is not None else RANGES["achieved_fraction"][1]
    ranges = {
        "achieved_fraction": (
            min(cfg.achieved_fraction_band[0], expected_af),
            expected_af,
            max(cfg.achieved_fraction_band[1], expected_af),
        ),
        "jitter": (
            min(cfg.jitter_band[0], cfg.jitter),
            cfg.jitter,
            max(cfg.jitter_band[1], cfg.jitter),
        ),
    }
    base = ScalingParams(expected_af, cfg.jitter, cfg.overlap, small)
    rows = []
    for n in sorted(set(cfg.chips) | {512}):
        for scheme in ("sync", "async"):
            params = base
            if reports:
                first = predict(costs, n, scheme, hw, base)
                hidden = scheme_overlap(reports, first, hw)
                params = dataclasses.replace(base, overlap=hidden)
            row = predict_band(costs, n, scheme, hw, params, ranges)
            row["overlap_hidden"] = params.overlap
            if reports:
                row["overlap_possible"] = scheme_overlap(reports, row, hw, scheduled=False)
                row["efficiency_if_possible_hidden"] = predict(
                    costs,
                    n,
                    scheme,
                    hw,
                    dataclasses.replace(params, overlap=row["overlap_possible"]),
                )["efficiency"]
            rows.append(row)
    at_512 = {r["scheme"]: r for r in rows if r["chips"] == 512}
    rows = [r for r in rows if r["chips"] in cfg.chips]
    paper = {
        "published_efficiency": PAPER_EFFICIENCY_1024_CORES,
        "published_at": "1024 TPU v3 cores = 512 chips",
        "source": "Shi, Li, You, ParaGAN, SoCC 2024, arXiv:2411.03999",
        **{
            f"predicted_{s}_512_chips{suffix}": at_512[s][f"efficiency{suffix}"]
            for s in ("sync", "async")
            for suffix in ("", "_low", "_high")
        },
    }
    paper["what_if_async_512_chips"] = _what_if(costs, hw, at_512["async"], base)
    inputs = _inputs_table(cfg, hw, costs, base, ranges, info)
    _print_prediction(cfg, hw, rows, inputs, paper, info)
    out: dict[str, Any] = {
        "model": cfg.model,
        "hardware": hw.name,
        "rows": rows,
        "inputs": inputs,
        "ranges": {k: list(v) for k, v in ranges.items()},
        "params": dataclasses.asdict(base),
        "costs": dataclasses.asdict(costs),
        "paper": paper,
        "schedule": info,
        "counted_collectives": counted,
    }
    if cfg.check_cpu:
        check = check_cpu(
            tuple(cfg.check_cpu),
            steps=cfg.check_steps,
            widths=tuple(cfg.check_widths),
            schemes=tuple(cfg.check_schemes),
        )
        out["cpu_check"] = check
        _print_check(check)
    return out


def _what_if(costs, hw, row: dict[str, Any], params: ScalingParams) -> dict[str, float]:
    """Expected async efficiency at 512 chips under each design change that would close the gap
    to ParaGAN's 91%, one at a time (the rest as predicted)."""
    p = dataclasses.replace(params, overlap=row["overlap_hidden"])
    half = dataclasses.replace(
        costs, g_param_bytes=costs.g_param_bytes / 2, d_param_bytes=costs.d_param_bytes / 2
    )
    cases = {
        "as predicted": (costs, p),
        "gradients all-reduced in bf16": (half, p),
        "all-reduce fully hidden (per-layer async all-reduce)": (
            costs,
            dataclasses.replace(p, overlap=1.0),
        ),
        "no jitter": (costs, dataclasses.replace(p, jitter=0.0)),
        "staleness k = 8": (dataclasses.replace(costs, staleness=8), p),
        "bf16 gradients + fully hidden": (half, dataclasses.replace(p, overlap=1.0)),
    }
    return {k: predict(c, 512, "async", hw, q)["efficiency"] for k, (c, q) in cases.items()}


def _print_prediction(cfg, hw, rows, inputs, paper, info) -> None:
    print(f"{cfg.model} on {hw.name}, per-chip batch {cfg.per_chip_batch}. Inputs:")
    for i in inputs:
        v = i["value"]
        text = (
            ", ".join(f"{x:.3g}" for x in v)
            if isinstance(v, list)
            else (f"{v:.3g}" if isinstance(v, float | int) else str(v))
        )
        print(f"  {i['input']:<40} {text:<28} {i['kind']:<9} {i['source'][:90]}")
    if info:
        for name, p in info["programs"].items():
            print(
                f"  schedule {name} ({info['target']}, {info['devices']} devices): "
                f"{p['collectives']} collectives, {p['async_collectives']} async; large ones: "
                f"{p['scheduled_share_mean_large']:.1%} of compute scheduled inside, "
                f"{p['independent_share_mean_large']:.1%} independent"
            )
    print(
        f"{'chips':>6} {'scheme':>6} {'step ms':>9} {'efficiency':>10} {'band':>15} "
        f"{'allreduce ms':>12} {'hidden':>7}"
    )
    for r in rows:
        print(
            f"{r['chips']:6d} {r['scheme']:>6} {1e3 * r['step_seconds']:9.2f} "
            f"{r['efficiency']:10.1%} {r['efficiency_low']:7.1%}-{r['efficiency_high']:.1%} "
            f"{1e3 * r['allreduce_s']:12.2f} {r['overlap_hidden']:7.1%}"
        )
    print(
        f"ParaGAN published {PAPER_EFFICIENCY_1024_CORES:.0%} at 1024 v3 cores (512 chips); "
        f"predicted here at 512 chips: async {paper['predicted_async_512_chips']:.1%} "
        f"({paper['predicted_async_512_chips_low']:.1%}-"
        f"{paper['predicted_async_512_chips_high']:.1%}), sync "
        f"{paper['predicted_sync_512_chips']:.1%} ({paper['predicted_sync_512_chips_low']:.1%}-"
        f"{paper['predicted_sync_512_chips_high']:.1%})"
    )
    print("  what would close the gap (async, 512 chips, expected inputs, one change each):")
    for name, eff in paper["what_if_async_512_chips"].items():
        print(f"    {name:<55} {eff:.1%}")


def _print_check(check: dict[str, Any]) -> None:
    print(
        f"CPU check ({check['cores']} cores; fitted on width {check['fitted_width']} at 1 and 2 "
        f"processes: {check['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s plus "
        f"{1e3 * check.get('fixed_step_s', 0.0):.2f} ms fixed per step, "
        f"{check['cores_busy_1_process']:.2f} cores busy per process, per-hop latency in the "
        f"step {1e3 * check['alpha_s']:.2f} ms (lone all-reduce: "
        f"{1e3 * check['alpha_lone_allreduce_s']:.2f} ms), {check['bandwidth_Bps'] / 1e9:.2f} "
        f"GB/s"
        + (
            f"; async exchange host cost {1e3 * check['exchange_host_s']:.2f} ms"
            if check.get("exchange_host_s") is not None
            else ""
        )
        + "):"
    )
    print(f"  load average {check['load_average'][0]:.1f} -> {check['load_average'][1]:.1f}")
    for label, key in (("median", "rows"), ("fastest", "rows_min")):
        for r in check[key]:
            load = r["load_average"]
            print(
                f"  {label:>7} {r.get('scheme', 'sync'):>5} width {r['width']} {r['processes']} "
                "processes: measured "
                f"{1e3 * r['measured_s']:.1f} ms, predicted {1e3 * r['predicted_s']:.1f} ms "
                f"({r['error']:+.0%}, {r['role']}, load {load if load is None else f'{load:.1f}'})"
            )


def scaling(argv: list[str]) -> int:
    """``python -m paragan_jax scaling [--config preset] [--flags] [key=value ...]``."""
    parser = command_config_parser(
        "scaling",
        ScalingCommand,
        "Predicted step time and scaling efficiency of sync and async ParaGAN at pod scale.",
    )
    cfg = load_command_config(ScalingCommand, parser.parse_intermixed_args(argv))
    out = run_scaling(cfg)
    path = write_json(cfg.json, out)
    if path:
        png = path.with_suffix(".png")
        plot_scaling(out, png)
        print(f"wrote {png}")
    return 0


def plot_scaling(out: dict[str, Any], path: Path) -> None:
    """Predicted efficiency per chip count with its band (sync, async, ParaGAN's published
    point) and, when the CPU check ran, measured against predicted step time per pair."""
    check = out.get("cpu_check")
    fig = Figure(figsize=(12 if check else 6, 4.2))
    axes = fig.subplots(1, 2 if check else 1)
    ax = axes[0] if check else axes
    for scheme, marker in (("sync", "o"), ("async", "s")):
        rows = [r for r in out["rows"] if r["scheme"] == scheme]
        x = [r["chips"] for r in rows]
        (line,) = ax.plot(
            x, [100 * r["efficiency"] for r in rows], marker=marker, label=f"{scheme} (expected)"
        )
        ax.fill_between(
            x,
            [100 * r["efficiency_low"] for r in rows],
            [100 * r["efficiency_high"] for r in rows],
            color=line.get_color(),
            alpha=0.2,
            label=f"{scheme} band",
        )
    ax.plot([512], [100 * PAPER_EFFICIENCY_1024_CORES], "k*", ms=12, label="ParaGAN, published")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chips")
    ax.set_ylabel("scaling efficiency (%)")
    ax.set_title(f"{out['model']} on {out['hardware']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if check:
        ax = axes[1]
        rows = check["rows"]
        x = range(len(rows))
        ax.bar([i - 0.2 for i in x], [1e3 * r["measured_s"] for r in rows], 0.4, label="measured")
        ax.bar([i + 0.2 for i in x], [1e3 * r["predicted_s"] for r in rows], 0.4, label="model")
        ax.set_xticks(
            list(x),
            [
                f"{'a' if r.get('scheme') == 'async' else ''}w{r['width']} {r['processes']}p\n"
                + ("fit" if r["role"] != "prediction" else f"{r['error']:+.0%}")
                for r in rows
            ],
            fontsize=8,
        )
        ax.set_ylabel("step, median (ms; aw: async)")
        ax.set_title(f"CPU check: gloo processes on {check['cores']} cores")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def train_multihost(argv: list[str]) -> int:
    """``python -m paragan_jax train-multihost <train args>`` on every TPU VM worker.

    Joins the slice's JAX runtime (`jax.distributed.initialize()` with no arguments: on a TPU VM
    the runtime supplies coordinator, process count and index), then runs the ordinary
    ``paragan_jax train`` command with the remaining arguments. `scripts/tpu_run.sh` calls this.
    """
    jax.distributed.initialize()
    print(
        f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} local "
        f"of {jax.device_count()} devices ({jax.devices()[0].device_kind})",
        flush=True,
    )
    return int(cli.main(["train", *argv]) or 0)


def main(argv: list[str]) -> int:
    """Entry point of the ``scaling`` and ``train-multihost`` commands (``argv[0]``)."""
    if argv[0] == "train-multihost":
        return train_multihost(argv[1:])
    return scaling(argv[1:])
