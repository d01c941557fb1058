"""Prometheus metrics of the HTTP server, under vLLM's names, so vLLM's dashboards work unchanged.

`ServeMetrics` registers standard prometheus_client metric objects once, in its own
`CollectorRegistry` (one per served engine), and updates them while the engine runs; ``/metrics``
only renders them (`ServeMetrics.render`). Two hooks feed it, both called from the engine thread:

* `ServeMetrics.observe_step` (a `serve_jax.core.StepObserver`): queue gauges, KV usage,
  preemptions, tokens per step, host-tier copies, prefix-cache counters;
* `ServeMetrics.observe_outputs` (the `RequestOutput` list of each `Engine.step`): the
  per-request histograms (TTFT, inter-token latency, e2e, queue/prefill/decode times, lengths)
  and the finished-request counter.

Names, label names (``model_name``, ``engine``) and histogram buckets are those of vLLM's
``vllm/v1/metrics/loggers.py`` (``PrometheusStatLogger``), as of its 0.11+ releases: the
inter-token histogram is ``vllm:inter_token_latency_seconds`` (``time_per_output_token_seconds``
is deprecated there and not exported here), the per-request TPOT is
``vllm:request_time_per_output_token_seconds``. Counters are exported with prometheus_client's
``_total`` suffix (``vllm:num_preemptions_total``), as vLLM's are.

Ours, under ``serve_jax:``: offloaded requests and host-tier pages, bytes copied to and from the
host tier, engine step errors, output tokens/s over the last 5 s, and the length predictor's
absolute error (tokens; only with the ``predictive`` policy).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["ServeMetrics", "CONTENT_TYPE_LATEST", "build_1_2_5_buckets"]

_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_PREDICTOR_ERROR_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
_FINISH_REASONS = ("stop", "length", "abort")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class ServeMetrics:
    """The server's metrics for one engine (see the module docstring).

    Args:
      engine: the `serve_jax.engine.Engine` served (its scheduler, pool sizes, policy).
      model_name: the ``model_name`` label (the served model id).
    """

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.registry = CollectorRegistry()
        labels = ("model_name", "engine")
        values = (model_name, "0")
        reg = self.registry
        max_len = int(engine.max_model_len)
        cc = engine.config.cache
        self._block_bytes = cc.block_size * engine.model_config.kv_bytes_per_token()
        self._num_device_blocks = max(1, cc.num_device_blocks)
        self._num_host_blocks = cc.num_host_blocks

        def make(kind, name, doc, buckets=None):
            if kind is Histogram:
                return Histogram(name, doc, labels, buckets=buckets, registry=reg).labels(*values)
            return kind(name, doc, labels, registry=reg).labels(*values)

        tok_buckets = build_1_2_5_buckets(max_len)
        lat = _REQUEST_LATENCY_BUCKETS
        for attr, kind, name, doc, buckets in (
            # vLLM's scheduler state and counters.
            ("running", Gauge, "vllm:num_requests_running",
             "Number of requests in model execution batches.", None),
            ("waiting", Gauge, "vllm:num_requests_waiting",
             "Number of requests waiting to be processed.", None),
            ("kv_usage", Gauge, "vllm:kv_cache_usage_perc",
             "KV-cache usage. 1 means 100 percent usage.", None),
            ("preemptions", Counter, "vllm:num_preemptions",
             "Cumulative number of preemption from the engine.", None),
            ("prompt_tokens", Counter, "vllm:prompt_tokens",
             "Number of prefill tokens processed.", None),
            ("generation_tokens", Counter, "vllm:generation_tokens",
             "Number of generation tokens processed.", None),
            ("prefix_queries", Counter, "vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.", None),
            ("prefix_hits", Counter, "vllm:prefix_cache_hits",
             "Prefix cache hits, in terms of number of cached tokens.", None),
            # vLLM's histograms of counts and of times.
            ("iteration_tokens", Histogram, "vllm:iteration_tokens_total",
             "Histogram of number of tokens per engine_step.", _ITERATION_TOKEN_BUCKETS),
            ("req_prompt_tokens", Histogram, "vllm:request_prompt_tokens",
             "Number of prefill tokens processed.", tok_buckets),
            ("req_generation_tokens", Histogram, "vllm:request_generation_tokens",
             "Number of generation tokens processed.", tok_buckets),
            ("ttft", Histogram, "vllm:time_to_first_token_seconds",
             "Histogram of time to first token in seconds.", _TTFT_BUCKETS),
            ("itl", Histogram, "vllm:inter_token_latency_seconds",
             "Histogram of inter-token latency in seconds.", _ITL_BUCKETS),
            ("tpot", Histogram, "vllm:request_time_per_output_token_seconds",
             "Histogram of time_per_output_token_seconds per request.", _ITL_BUCKETS),
            ("e2e", Histogram, "vllm:e2e_request_latency_seconds",
             "Histogram of e2e request latency in seconds.", lat),
            ("queue", Histogram, "vllm:request_queue_time_seconds",
             "Histogram of time spent in WAITING phase for request.", lat),
            ("inference", Histogram, "vllm:request_inference_time_seconds",
             "Histogram of time spent in RUNNING phase for request.", lat),
            ("prefill", Histogram, "vllm:request_prefill_time_seconds",
             "Histogram of time spent in PREFILL phase for request.", lat),
            ("decode", Histogram, "vllm:request_decode_time_seconds",
             "Histogram of time spent in DECODE phase for request.", lat),
            # Ours.
            ("offloaded", Gauge, "serve_jax:num_requests_offloaded",
             "Requests preempted to the host KV tier.", None),
            ("host_pages_used", Gauge, "serve_jax:host_kv_pages_used",
             "Host-tier KV pages in use.", None),
            ("host_usage", Gauge, "serve_jax:host_kv_cache_usage_perc",
             "Host-tier KV usage. 1 means 100 percent usage.", None),
            ("offload_bytes", Counter, "serve_jax:kv_offload_bytes",
             "KV bytes copied device -> host.", None),
            ("restore_bytes", Counter, "serve_jax:kv_restore_bytes",
             "KV bytes copied host -> device.", None),
            ("offload_preemptions", Counter, "serve_jax:offload_preemptions",
             "Preemptions by offload to the host tier.", None),
            ("step_errors", Counter, "serve_jax:engine_step_errors",
             "Engine steps that raised.", None),
            ("tokens_per_s", Gauge, "serve_jax:generation_tokens_per_second",
             "Output tokens/s over the last 5 s.", None),
            ("predictor_error", Histogram, "serve_jax:predictor_abs_error_tokens",
             "Absolute error of the predicted remaining output length, tokens "
             "(predictive policy).", _PREDICTOR_ERROR_BUCKETS),
        ):  # fmt: skip
            setattr(self, attr, make(kind, name, doc, buckets))
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            (*labels, "finished_reason"),
            registry=reg,
        )
        self.success = {r: success.labels(*values, r) for r in _FINISH_REASONS}
        self._seen = {"preemptions": 0, "offload_preemptions": 0, "queries": 0, "hits": 0}
        self._predictor_seen = 0
        self._window: collections.deque[tuple[float, int]] = collections.deque()
        engine.core.add_observer(self.observe_step)

    # ---- hooks (engine thread) ------------------------------------------------------------
    def observe_step(self, out) -> None:
        """`serve_jax.core.StepObserver`: gauges, step counters and host-tier copies."""
        plan = out.scheduler_output
        self.iteration_tokens.observe(plan.num_scheduled_tokens)
        self.offload_bytes.inc(len(plan.offloads) * self._block_bytes)
        self.restore_bytes.inc(len(plan.restores) * self._block_bytes)
        self.refresh()

    def refresh(self) -> None:
        """Sets the gauges and advances the cumulative counters from the engine's state."""
        engine = self.engine
        s = engine.scheduler.stats()
        self.running.set(s["running"])
        self.waiting.set(s["waiting"])
        self.offloaded.set(s["offloaded"])
        self.kv_usage.set(1.0 - s["free_device_blocks"] / self._num_device_blocks)
        used_host = self._num_host_blocks - s["free_host_blocks"]
        self.host_pages_used.set(used_host)
        self.host_usage.set(used_host / self._num_host_blocks if self._num_host_blocks else 0.0)
        self._advance(self.preemptions, "preemptions", s["preemptions"])
        self._advance(
            self.offload_preemptions,
            "offload_preemptions",
            engine.scheduler.num_offload_preemptions,
        )
        bs = engine.config.cache.block_size  # the block manager counts blocks; vLLM counts tokens
        self._advance(self.prefix_queries, "queries", s["prefix_cache_queries"] * bs)
        self._advance(self.prefix_hits, "hits", s["prefix_cache_hits"] * bs)
        log = getattr(engine.policy, "log", None)
        errors = getattr(log, "abs_errors", None)
        if errors is not None:
            for err in errors[self._predictor_seen :]:
                self.predictor_error.observe(err)
            self._predictor_seen = len(errors)

    def _advance(self, counter, key: str, total: float) -> None:
        if total > self._seen[key]:
            counter.inc(total - self._seen[key])
        self._seen[key] = total

    def observe_outputs(self, outputs: Iterable) -> None:
        """Per-request histograms from the `RequestOutput` list of one `Engine.step`."""
        n_new = 0
        for out in outputs:
            m = out.metrics
            new = len(out.new_token_ids)
            n_new += new
            self.generation_tokens.inc(new)
            times = m.token_times
            before = len(times) - new
            if before <= 0 and times and m.first_token_time is not None:  # its first token
                self.prompt_tokens.inc(m.num_prompt_tokens)
                self.ttft.observe(m.first_token_time - m.arrival_time)
            for i in range(max(before, 1), len(times)):
                self.itl.observe(times[i] - times[i - 1])
            if out.finished:
                self._finished(out)
        self._rate(n_new)

    def _finished(self, out) -> None:
        m = out.metrics
        reason = out.finish_reason if out.finish_reason in self.success else "abort"
        self.success[reason].inc()
        end = m.finish_time if m.finish_time is not None else (m.token_times or [0.0])[-1]
        self.e2e.observe(max(0.0, end - m.arrival_time))
        self.req_prompt_tokens.observe(m.num_prompt_tokens)
        self.req_generation_tokens.observe(m.num_output_tokens)
        if m.first_scheduled_time is None or m.first_token_time is None:
            return
        last = m.token_times[-1] if m.token_times else m.first_token_time
        self.queue.observe(m.first_scheduled_time - m.arrival_time)
        self.prefill.observe(m.first_token_time - m.first_scheduled_time)
        self.decode.observe(last - m.first_token_time)
        self.inference.observe(last - m.first_scheduled_time)
        if m.num_output_tokens > 1:
            self.tpot.observe((last - m.first_token_time) / (m.num_output_tokens - 1))

    def record_abort(self) -> None:
        """Counts a request aborted by its client (vLLM's ``finished_reason="abort"``)."""
        self.success["abort"].inc()

    def _rate(self, n: int) -> None:
        now = time.monotonic()
        self._window.append((now, n))
        while self._window and self._window[0][0] < now - 5.0:
            self._window.popleft()
        span = max(now - self._window[0][0], 1.0)  # at least 1 s: no spikes at start
        self.tokens_per_s.set(sum(c for _, c in self._window) / span)

    # ---- scrape (any thread) ----------------------------------------------------------------
    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
