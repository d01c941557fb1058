"""Request-level latency metrics, as vLLM's serving benchmark reports them.

Used by ``replay`` (engine timestamps), ``bench`` (client-side timestamps of streamed tokens)
and the simulator (simulated timestamps): anything with the `RequestRecord` fields works.

* TTFT: first token time - arrival.
* TPOT: (last token time - first token time) / (output tokens - 1), per request with > 1 token.
* ITL: every gap between consecutive tokens of a request.
* E2EL: last token (or finish) time - arrival.
* Throughput: completed requests, output tokens and all tokens per second of the run.
* Goodput: completed requests per second that met both SLOs (TTFT and TPOT).
Mean, median and p99 are reported in milliseconds, by every command (replay, bench, simulate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "RequestRecord",
    "Slo",
    "record_from",
    "request_latencies",
    "summarize",
    "format_table",
]


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """Timestamps (seconds, any common origin) and sizes of one request."""

    arrival_time: float
    first_token_time: float | None
    token_times: tuple[float, ...]
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int = 0
    success: bool = True
    """False for requests that failed or were aborted (excluded from latencies)."""


@dataclasses.dataclass(frozen=True)
class Slo:
    """Service-level objectives for goodput."""

    ttft_ms: float = 2000.0
    tpot_ms: float = 200.0


def record_from(obj, success: bool = True) -> RequestRecord:
    """A `RequestRecord` from anything with the same attribute names (a scheduler `Request`,
    an engine `RequestMetrics`)."""
    return RequestRecord(
        arrival_time=float(obj.arrival_time),
        first_token_time=obj.first_token_time,
        token_times=tuple(obj.token_times),
        finish_time=obj.finish_time,
        num_prompt_tokens=int(obj.num_prompt_tokens),
        num_output_tokens=int(obj.num_output_tokens),
        num_preemptions=int(getattr(obj, "num_preemptions", 0)),
        success=success,
    )


def _stats(values: np.ndarray) -> dict[str, float]:
    if len(values) == 0:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    arr = np.asarray(values, dtype=np.float64)
    return {
        "mean": float(arr.mean()),
        "median": float(np.median(arr)),
        "p99": float(np.percentile(arr, 99)),
    }


def _done(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.success and r.first_token_time is not None]


def request_latencies(records: Iterable[RequestRecord]) -> dict[str, np.ndarray]:
    """Per-request latencies in ms of the successful requests: ``ttft``, ``e2el``, ``tpot``
    (requests with more than one token) and ``itl`` (every gap between two tokens)."""
    ttft, tpot, e2el, itl = [], [], [], []
    for r in _done(list(records)):
        last = r.token_times[-1] if r.token_times else r.first_token_time
        ttft.append((r.first_token_time - r.arrival_time) * 1e3)
        e2el.append((max(last, r.finish_time or last) - r.arrival_time) * 1e3)
        if r.num_output_tokens > 1 and len(r.token_times) > 1:
            tpot.append((last - r.first_token_time) / (r.num_output_tokens - 1) * 1e3)
        if len(r.token_times) > 1:
            itl.append(np.diff(np.asarray(r.token_times, dtype=np.float64)))
    return {
        "ttft": np.asarray(ttft, dtype=np.float64),
        "tpot": np.asarray(tpot, dtype=np.float64),
        "e2el": np.asarray(e2el, dtype=np.float64),
        "itl": np.concatenate(itl) * 1e3 if itl else np.zeros(0),
    }


def summarize(
    records: Iterable[RequestRecord], duration: float | None = None, slo: Slo | None = None
) -> dict:
    """Aggregates request records into the benchmark summary (a JSON-able dict).

    Args:
      records: one per request sent (failed ones with ``success=False``).
      duration: wall time of the run in seconds; default first arrival to last finish.
      slo: objectives for goodput (default `Slo()`).

    Returns:
      Counts, throughputs, ``goodput`` (requests/s meeting both SLOs; ``slo_met`` of them),
      ``preemptions``, and mean/median/p99 of ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``.
    """
    slo = slo or Slo()
    records = list(records)
    done = _done(records)
    lat = request_latencies(done)
    good = 0
    for r in done:
        t_first = (r.first_token_time - r.arrival_time) * 1e3
        if t_first > slo.ttft_ms:
            continue
        if r.num_output_tokens > 1 and len(r.token_times) > 1:
            per_tok = (r.token_times[-1] - r.first_token_time) / (r.num_output_tokens - 1) * 1e3
            if per_tok > slo.tpot_ms:
                continue
        good += 1
    if duration is None:
        if done:
            start = min(r.arrival_time for r in records)
            end = max((r.token_times[-1] if r.token_times else r.first_token_time) for r in done)
            duration = max(end - start, 1e-9)
        else:
            duration = float("nan")
    out_tokens = sum(r.num_output_tokens for r in done)
    in_tokens = sum(r.num_prompt_tokens for r in done)
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "goodput": good / duration,
        "slo_met": good,
        "slo": dataclasses.asdict(slo),
        "preemptions": sum(r.num_preemptions for r in records),
        "ttft_ms": _stats(lat["ttft"]),
        "tpot_ms": _stats(lat["tpot"]),
        "itl_ms": _stats(lat["itl"]),
        "e2el_ms": _stats(lat["e2el"]),
    }


def format_table(summary: dict, title: str = "Serving benchmark result") -> str:
    """The summary as a fixed-width table (the layout of vLLM's benchmark_serving)."""
    lines = [f"{'=' * 18} {title} {'=' * 18}"]
    width = len(lines[0])

    def row(name: str, value) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{name:<40}{text:>{max(10, width - 40)}}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"])
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"])
    row("Output token throughput (tok/s):", summary["output_throughput"])
    row("Total token throughput (tok/s):", summary["total_token_throughput"])
    slo = summary["slo"]
    row(
        f"Goodput (req/s, TTFT<={slo['ttft_ms']:g}ms TPOT<={slo['tpot_ms']:g}ms):",
        summary["goodput"],
    )
    row("Preemptions:", summary["preemptions"])
    for key, label in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2el_ms", "End-to-end Latency"),
    ):
        lines.append(f"{'-' * 16}{label}{'-' * max(2, width - 16 - len(label))}")
        abbrev = key.split("_")[0].upper()
        for stat in ("mean", "median", "p99"):
            row(
                f"{stat.capitalize() if stat != 'p99' else 'P99'} {abbrev} (ms):",
                summary[key][stat],
            )
    lines.append("=" * width)
    return "\n".join(lines)
