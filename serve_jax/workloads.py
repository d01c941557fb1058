"""Request workloads for the serving simulator and the engine: traces and synthetic generators.

A `Workload` is a list of `RequestSpec` (arrival time, prompt length, output length) sorted by
arrival. Four families:

- ``azure-conv`` / ``azure-code`` (or any CSV path in the Azure format ``TIMESTAMP,
  ContextTokens, GeneratedTokens``): real production arrivals and lengths, read through
  `serve_jax.traces`.
- ``reasoning``: long outputs, a two-component log-normal mixture of output lengths with medians
  near 2k and 8k tokens (short and long chains of thought), moderate prompts.
- ``agentic``: multi-turn sessions whose context grows turn after turn: turn ``k`` re-sends the
  whole conversation so far (previous prompt + previous output) plus new tool/user tokens. A turn
  is *closed-loop*: it arrives ``think_time`` seconds after its parent turn finishes
  (`RequestSpec.parent_id`); ``arrival_time`` holds the open-loop estimate used by tools that
  cannot follow dependencies.

Arrivals of the synthetic families are a renewal process with gamma inter-arrival times whose
coefficient of variation is ``burstiness`` (1 = Poisson, > 1 bursty). ``rate_scale`` divides all
arrival times (2 = twice the request rate). Everything is seeded (`numpy.random.default_rng`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np

__all__ = [
    "RequestSpec",
    "Workload",
    "gamma_arrivals",
    "reasoning_workload",
    "agentic_workload",
    "azure_workload",
    "make_workload",
    "WORKLOAD_NAMES",
    "TRACE_DIR",
]

TRACE_DIR = Path(__file__).resolve().parent.parent.parent / "shared" / "traces"
_AZURE_FILES = {
    "azure-conv": "azure_llm_conv_2023.csv",
    "azure-code": "azure_llm_code_2023.csv",
}
WORKLOAD_NAMES = ("reasoning", "agentic", "azure-conv", "azure-code")


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    """One request of a workload."""

    request_id: str
    """Unique id."""
    arrival_time: float
    """Seconds from the start of the workload (open-loop estimate for follow-up turns)."""
    prompt_len: int
    """Prompt tokens."""
    output_len: int
    """Output tokens the request generates before it stops."""
    session_id: str | None = None
    """Session of a multi-turn conversation, if any."""
    parent_id: str | None = None
    """Previous turn: this request arrives ``think_time`` after the parent finishes."""
    think_time: float = 0.0
    """Seconds between the parent's completion and this request's arrival."""

    def __post_init__(self) -> None:
        if self.prompt_len <= 0 or self.output_len <= 0:
            raise ValueError(
                f"request {self.request_id!r}: prompt_len and output_len must be positive, got "
                f"{self.prompt_len} and {self.output_len}"
            )
        if self.arrival_time < 0 or self.think_time < 0:
            raise ValueError(f"request {self.request_id!r}: negative time")


@dataclasses.dataclass(frozen=True)
class Workload:
    """A named list of requests sorted by arrival time."""

    name: str
    """Workload name (or trace path)."""
    requests: tuple[RequestSpec, ...]
    """Requests, sorted by ``arrival_time``."""

    @property
    def duration_s(self) -> float:
        """Time of the last (open-loop) arrival."""
        return max((r.arrival_time for r in self.requests), default=0.0)

    def total_output_tokens(self) -> int:
        """Output tokens over all requests."""
        return sum(r.output_len for r in self.requests)

    def scaled(self, rate_scale: float) -> Workload:
        """The same requests arriving ``rate_scale`` times faster (think times scaled too)."""
        if rate_scale <= 0:
            raise ValueError(f"rate_scale must be positive, got {rate_scale}")
        reqs = tuple(
            dataclasses.replace(
                r, arrival_time=r.arrival_time / rate_scale, think_time=r.think_time / rate_scale
            )
            for r in self.requests
        )
        return Workload(self.name, reqs)

    def with_token_scale(self, factor: float, max_total: int | None = None) -> Workload:
        """Prompt and output lengths times ``factor`` (at least 1 token each).

        Args:
          factor: length multiplier (e.g. 1/100 to fit a tiny CPU model).
          max_total: clip so that prompt + output stays within this many tokens.
        """
        if factor <= 0:
            raise ValueError(f"token scale must be positive, got {factor}")
        reqs = []
        for r in self.requests:
            p = max(int(round(r.prompt_len * factor)), 1)
            o = max(int(round(r.output_len * factor)), 1)
            if max_total is not None:
                p = min(p, max(max_total // 2, 1))
                o = max(min(o, max_total - p), 1)
            reqs.append(dataclasses.replace(r, prompt_len=p, output_len=o))
        return Workload(self.name, tuple(reqs))

    def head(self, num_requests: int) -> Workload:
        """The first ``num_requests`` requests (with any parent they depend on kept)."""
        keep = list(self.requests[:num_requests])
        ids = {r.request_id for r in keep}
        keep = [r for r in keep if r.parent_id is None or r.parent_id in ids]
        return Workload(self.name, tuple(keep))

    def summary(self) -> dict[str, float]:
        """Counts and length statistics (for reports)."""
        p = np.array([r.prompt_len for r in self.requests], dtype=np.float64)
        o = np.array([r.output_len for r in self.requests], dtype=np.float64)
        if len(p) == 0:
            return {"requests": 0}
        return {
            "requests": float(len(p)),
            "duration_s": self.duration_s,
            "prompt_mean": float(p.mean()),
            "prompt_p50": float(np.median(p)),
            "output_mean": float(o.mean()),
            "output_p50": float(np.median(o)),
            "output_p99": float(np.percentile(o, 99)),
        }


def gamma_arrivals(
    rng: np.random.Generator, rate: float, duration_s: float, burstiness: float = 1.0
) -> np.ndarray:
    """Arrival times of a renewal process with gamma inter-arrivals.

    Args:
      rng: random generator.
      rate: mean arrivals per second.
      duration_s: arrivals are drawn in ``[0, duration_s)``.
      burstiness: coefficient of variation of the inter-arrival times (1 = Poisson).

    Returns:
      Sorted arrival times.
    """
    if rate <= 0 or duration_s <= 0 or burstiness <= 0:
        raise ValueError(
            f"rate, duration_s and burstiness must be positive, got {rate}, {duration_s}, "
            f"{burstiness}"
        )
    shape = 1.0 / burstiness**2
    scale = 1.0 / (rate * shape)
    n_guess = int(rate * duration_s * 1.5 + 10 * math.sqrt(rate * duration_s) + 16)
    gaps = rng.gamma(shape, scale, size=n_guess)
    t = np.cumsum(gaps)
    while t[-1] < duration_s:
        more = np.cumsum(rng.gamma(shape, scale, size=n_guess)) + t[-1]
        t = np.concatenate([t, more])
    return t[t < duration_s]


def _lognormal_int(rng, median: float, sigma: float, size: int, lo: int, hi: int) -> np.ndarray:
    x = rng.lognormal(math.log(median), sigma, size=size)
    return np.clip(np.round(x), lo, hi).astype(np.int64)


def reasoning_workload(
    *,
    rate: float = 0.05,
    duration_s: float = 3600.0,
    burstiness: float = 1.0,
    prompt_median: float = 600.0,
    prompt_sigma: float = 0.8,
    short_median: float = 2048.0,
    long_median: float = 8192.0,
    long_fraction: float = 0.4,
    output_sigma: float = 0.5,
    max_prompt: int = 8192,
    max_output: int = 32768,
    seed: int = 0,
) -> Workload:
    """Synthetic reasoning workload: long outputs from a log-normal mixture.

    Args:
      rate: requests per second.
      duration_s: span of arrivals.
      burstiness: coefficient of variation of inter-arrival times.
      prompt_median, prompt_sigma: log-normal prompt lengths.
      short_median, long_median: medians of the two output-length components.
      long_fraction: probability of the long component.
      output_sigma: log-space spread of each component.
      max_prompt, max_output: clipping bounds.
      seed: random seed.
    """
    if not 0.0 <= long_fraction <= 1.0:
        raise ValueError(f"long_fraction must be in [0, 1], got {long_fraction}")
    rng = np.random.default_rng(seed)
    t = gamma_arrivals(rng, rate, duration_s, burstiness)
    n = len(t)
    prompts = _lognormal_int(rng, prompt_median, prompt_sigma, n, 16, max_prompt)
    is_long = rng.random(n) < long_fraction
    short = _lognormal_int(rng, short_median, output_sigma, n, 16, max_output)
    long_ = _lognormal_int(rng, long_median, output_sigma, n, 16, max_output)
    outputs = np.where(is_long, long_, short)
    reqs = tuple(
        RequestSpec(f"r{i}", float(t[i]), int(prompts[i]), int(outputs[i])) for i in range(n)
    )
    return Workload("reasoning", reqs)


def agentic_workload(
    *,
    session_rate: float = 0.05,
    duration_s: float = 3600.0,
    burstiness: float = 1.0,
    mean_turns: float = 6.0,
    system_prompt_median: float = 1500.0,
    tool_tokens_median: float = 400.0,
    output_median: float = 300.0,
    output_sigma: float = 0.8,
    think_time_median: float = 2.0,
    max_context: int = 12000,
    max_output: int = 4096,
    seed: int = 0,
) -> Workload:
    """Synthetic agentic workload: multi-turn sessions with growing context.

    Turn ``k + 1`` of a session re-sends everything so far (turn ``k``'s prompt and output) plus
    new tool or user tokens, and arrives ``think_time`` after turn ``k`` finishes. A session ends
    after a geometric number of turns or when its context would pass ``max_context``.

    Args:
      session_rate: new sessions per second.
      duration_s: span of session starts.
      burstiness: coefficient of variation of session inter-arrival times.
      mean_turns: mean turns per session (geometric).
      system_prompt_median: median first-turn prompt (system prompt + task).
      tool_tokens_median: median tokens added by each tool result or user message.
      output_median, output_sigma: log-normal output length of a turn.
      think_time_median: median seconds between a turn's end and the next turn (tool execution).
      max_context: cap on prompt + output of a turn.
      max_output: cap on one turn's output.
      seed: random seed.
    """
    if mean_turns < 1:
        raise ValueError(f"mean_turns must be >= 1, got {mean_turns}")
    rng = np.random.default_rng(seed)
    starts = gamma_arrivals(rng, session_rate, duration_s, burstiness)
    reqs: list[RequestSpec] = []
    for s, t0 in enumerate(starts):
        turns = int(rng.geometric(1.0 / mean_turns))
        prompt = int(_lognormal_int(rng, system_prompt_median, 0.5, 1, 64, max_context // 2)[0])
        parent: str | None = None
        t = float(t0)
        for k in range(turns):
            out = int(_lognormal_int(rng, output_median, output_sigma, 1, 8, max_output)[0])
            if prompt + out > max_context:
                break
            think = 0.0 if parent is None else float(rng.lognormal(math.log(think_time_median), 1))
            rid = f"s{s}t{k}"
            reqs.append(RequestSpec(rid, t + think, prompt, out, f"s{s}", parent, think))
            # Open-loop estimate of the next arrival: assume ~30 ms per output token.
            t = t + think + 0.03 * out
            parent = rid
            prompt = prompt + out + int(_lognormal_int(rng, tool_tokens_median, 0.8, 1, 8, 8192)[0])
    reqs.sort(key=lambda r: (r.arrival_time, r.request_id))
    return Workload("agentic", tuple(reqs))


def azure_workload(
    name_or_path: str | Path,
    *,
    duration_s: float | None = None,
    max_requests: int | None = None,
    max_output: int | None = None,
) -> Workload:
    """A workload from an Azure-format trace (a known name or a CSV path).

    Args:
      name_or_path: ``azure-conv``, ``azure-code`` or the path of a CSV with columns
        ``TIMESTAMP, ContextTokens, GeneratedTokens``.
      duration_s: keep requests arriving in the first ``duration_s`` seconds.
      max_requests: keep at most this many requests.
      max_output: clip output lengths (e.g. to a model's context).

    Raises:
      FileNotFoundError: the trace file does not exist.
      ValueError: a malformed trace (raised by `serve_jax.traces`).
    """
    from serve_jax import traces

    key = str(name_or_path)
    path = TRACE_DIR / _AZURE_FILES[key] if key in _AZURE_FILES else Path(key)
    if not path.exists():
        raise FileNotFoundError(f"trace {str(path)!r} does not exist")
    rows = traces.load_trace(path)
    reqs = []
    for i, row in enumerate(rows):
        t = float(row.arrival_s)
        if duration_s is not None and t >= duration_s:
            break
        if max_requests is not None and len(reqs) >= max_requests:
            break
        out = max(int(row.output_tokens), 1)
        if max_output is not None:
            out = min(out, max_output)
        reqs.append(RequestSpec(f"a{i}", t, max(int(row.prompt_tokens), 1), out))
    name = key if key in _AZURE_FILES else path.name
    return Workload(name, tuple(reqs))


def make_workload(
    name: str,
    *,
    rate_scale: float = 1.0,
    burstiness: float = 1.0,
    duration_s: float | None = None,
    max_requests: int | None = None,
    seed: int = 0,
) -> Workload:
    """Builds a workload by name (``reasoning``, ``agentic``, ``azure-conv``, ``azure-code``)
    or from the path of an Azure-format CSV.

    Args:
      name: workload name or CSV path.
      rate_scale: arrivals ``rate_scale`` times faster.
      burstiness: inter-arrival coefficient of variation (synthetic workloads only).
      duration_s: span of arrivals before scaling; default one hour (traces: all of it).
      max_requests: keep the first ``max_requests`` requests.
      seed: random seed (synthetic workloads only).
    """
    if name == "reasoning":
        wl = reasoning_workload(duration_s=duration_s or 3600.0, burstiness=burstiness, seed=seed)
    elif name == "agentic":
        wl = agentic_workload(duration_s=duration_s or 3600.0, burstiness=burstiness, seed=seed)
    elif name in _AZURE_FILES or name.endswith(".csv") or Path(name).exists():
        if burstiness != 1.0:
            raise ValueError("burstiness applies to synthetic workloads; a trace keeps its own")
        wl = azure_workload(name, duration_s=duration_s)
    else:
        raise ValueError(
            f"unknown workload {name!r}: expected one of {', '.join(WORKLOAD_NAMES)} or the "
            "path of an Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens)"
        )
    if max_requests is not None:
        wl = wl.head(max_requests)
    return wl.scaled(rate_scale) if rate_scale != 1.0 else wl
