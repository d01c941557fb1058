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

``bench`` (the HTTP client) measures what vLLM's ``vllm bench serve`` measures, per request, in a
`ClientRecord`, and writes `bench_result`: the flat JSON of ``vllm bench serve --save-result
--save-detailed`` (same keys, same definitions: TTFT from the send, one ITL per streamed chunk,
TPOT ``(latency - ttft) / (output tokens - 1)``, ``mean_/median_/std_/p<N>_<metric>_ms`` for the
metrics and percentiles chosen with ``--percentile-metrics`` / ``--metric-percentiles``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = [
    "RequestRecord",
    "ClientRecord",
    "PERCENTILE_METRICS",
    "bench_result",
    "format_bench_table",
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
    records: Iterable[RequestRecord],
    duration: float | None = None,
    slo: Slo | None = None,
    latencies: dict[str, np.ndarray] | None = None,
) -> dict:
    """Aggregates request records into the benchmark summary (a JSON-able dict).

    Args:
      records: one per request sent (failed ones with ``success=False``).
      duration: wall time of the run in seconds; default first arrival to last finish.
      slo: objectives for goodput (default `Slo()`).
      latencies: `request_latencies` of ``records``, when the caller has computed it already.

    Returns:
      Counts, throughputs, ``goodput`` (requests/s meeting both SLOs; ``slo_met`` of them),
      ``preemptions``, and mean/median/p99 of ``ttft_ms``, ``tpot_ms``, ``itl_ms``, ``e2el_ms``.
    """
    slo = slo or Slo()
    records = list(records)
    done = _done(records)
    lat = request_latencies(done) if latencies is None else latencies
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


# ---- the client side, as vllm bench serve reports it --------------------------------------

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
"""Metrics ``--percentile-metrics`` may name (vLLM's generative ones)."""


@dataclasses.dataclass
class ClientRecord:
    """One request as an HTTP client saw it (the fields of vLLM's ``RequestFuncOutput``)."""

    prompt_len: int
    success: bool = False
    output_tokens: int = 0
    ttft: float = 0.0
    """Seconds from sending the request to the first streamed chunk (0 if none)."""
    itl: list[float] = dataclasses.field(default_factory=list)
    """Seconds between consecutive streamed chunks."""
    latency: float = 0.0
    """Seconds from sending the request to its last chunk."""
    start_time: float = 0.0
    """When the request was sent (``time.perf_counter``)."""
    queue_time: float = 0.0
    """Seconds the request waited on the client for ``--max-concurrency``."""
    generated_text: str = ""
    error: str = ""
    num_preemptions: int = 0
    """The server's count for this request (``usage.num_preemptions``; serve_jax only)."""


def _percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def bench_result(
    records: Sequence[ClientRecord],
    duration: float,
    percentile_metrics: Sequence[str] = PERCENTILE_METRICS,
    percentiles: Sequence[float] = (99.0,),
    slo: Slo | None = None,
) -> dict:
    """The flat result dict of ``vllm bench serve --save-result --save-detailed``.

    Args:
      records: one per request sent, in sending order.
      duration: wall seconds from the first send to the last response.
      percentile_metrics: which of `PERCENTILE_METRICS` get mean/median/std/percentile keys.
      percentiles: e.g. ``(50, 99)`` gives ``p50_ttft_ms`` and ``p99_ttft_ms``.
      slo: ``request_goodput`` counts requests with TTFT and TPOT within it (vLLM's
        ``--goodput ttft:<ms> tpot:<ms>``; a one-token request has TPOT 0); None: null.

    Raises:
      ValueError: an unknown metric name or a percentile outside [0, 100].
    """
    bad = [m for m in percentile_metrics if m not in PERCENTILE_METRICS]
    if bad:
        raise ValueError(
            f"--percentile-metrics: unknown {bad}; choose from {','.join(PERCENTILE_METRICS)}"
        )
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"--metric-percentiles must lie in [0, 100], got {list(percentiles)}")
    ok = [r for r in records if r.success]
    values: dict[str, list[float]] = {m: [] for m in PERCENTILE_METRICS}
    good = 0
    for r in ok:
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            values["tpot"].append(tpot)
        values["ttft"].append(r.ttft)
        values["e2el"].append(r.latency)
        values["itl"] += r.itl
        if slo and r.ttft * 1e3 <= slo.ttft_ms and tpot * 1e3 <= slo.tpot_ms:
            good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if slo else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [list(r.itl) for r in records],
        "latencies": [r.latency for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.queue_time for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    out.update(_peaks(ok))
    for metric in percentile_metrics:
        arr = np.asarray(values[metric] or [0.0], dtype=np.float64) * 1e3
        out[f"mean_{metric}_ms"] = float(arr.mean())
        out[f"median_{metric}_ms"] = float(np.median(arr))
        out[f"std_{metric}_ms"] = float(arr.std())
        for p in percentiles:
            out[f"p{_percentile_word(p)}_{metric}_ms"] = float(np.percentile(arr, p))
    return out


def _peaks(ok: Sequence[ClientRecord]) -> dict:
    """vLLM's ``max_output_tokens_per_s`` (chunks per 1 s bucket) and peak concurrency."""
    if not ok:
        return {"max_output_tokens_per_s": 0.0, "max_concurrent_requests": 0}
    t0 = min(r.start_time for r in ok)
    end = max(r.start_time + r.latency for r in ok)
    per_second = np.zeros(int(np.ceil(end - t0)) + 1)
    events = []
    for r in ok:
        t = r.start_time + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for t in times:
            per_second[min(int(t - t0), len(per_second) - 1)] += 1
        events += [(r.start_time, 1), (r.start_time + r.latency, -1)]
    peak = cur = 0
    for _, delta in sorted(events):
        cur += delta
        peak = max(peak, cur)
    return {"max_output_tokens_per_s": float(per_second.max()), "max_concurrent_requests": peak}


def format_bench_table(result: dict, percentile_metrics: Sequence[str]) -> str:
    """``result`` (of `bench_result`) in the layout ``vllm bench serve`` prints."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(name: str, v) -> None:
        lines.append(f"{name:<40} {v:<10.2f}" if isinstance(v, float) else f"{name:<40} {v:<10}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    row("Benchmark duration (s):", result["duration"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"])
    row("Peak concurrent requests:", float(result["max_concurrent_requests"]))
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    headers = {
        "ttft": ("TTFT", "Time to First Token"),
        "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
        "itl": ("ITL", "Inter-token Latency"),
        "e2el": ("E2EL", "End-to-end Latency"),
    }
    for metric in percentile_metrics:
        short, header = headers[metric]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", result[f"mean_{metric}_ms"])
        row(f"Median {short} (ms):", result[f"median_{metric}_ms"])
        suffix = f"_{metric}_ms"
        for key in result:
            if key.startswith("p") and key.endswith(suffix) and key[1 : -len(suffix)][:1].isdigit():
                row(f"P{key[1 : -len(suffix)]} {short} (ms):", result[key])
    lines.append("=" * 50)
    return "\n".join(lines)
