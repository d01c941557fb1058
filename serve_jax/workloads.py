"""Request workloads for the engine, the load generator and the simulator: one request type.

A `Workload` is a list of `RequestSpec` (arrival time, prompt length, output length) sorted by
arrival; ``replay``, ``bench`` and ``simulate`` all build theirs with `build_workload` from one
`WorkloadConfig` (the same flags on every command, see `serve_jax.cli_args`). Families:

- traces in the Azure LLM inference format (``TIMESTAMP, ContextTokens, GeneratedTokens``):
  ``azure-conv`` / ``azure-code`` (the full 2023 traces, shipped gzip-compressed in
  ``serve_jax/data/`` with their CC BY 4.0 attribution), ``conv`` / ``code`` (their first 500
  requests), or the path of any such CSV, plain or ``.csv.gz`` (`load_trace`). Prompt text is
  not part of these traces: the engine makes prompts of the given length and forces the given
  output length. ``rate`` replaces a trace's timestamps by a gamma process
  (`Workload.with_arrivals`).
- ``reasoning``: long outputs, a two-component log-normal mixture of output lengths with medians
  near 2k and 8k tokens (short and long chains of thought), moderate prompts.
- ``agentic``: multi-turn sessions whose context grows turn after turn: turn ``k`` re-sends the
  whole conversation so far (previous prompt + previous output) plus new tool/user tokens. A turn
  is *closed-loop*: it arrives ``think_time`` seconds after its parent turn finishes
  (`RequestSpec.parent_id`); ``arrival_time`` holds the open-loop estimate used by tools that
  cannot follow dependencies.

Arrivals of the synthetic families (and of a trace given a ``rate``) are a renewal process with
gamma inter-arrival times of shape ``burstiness``, vLLM's convention: 1 = Poisson, < 1 burstier,
> 1 more regular (the coefficient of variation is ``1 / sqrt(burstiness)``). ``rate_scale``
divides all arrival times (2 = twice the request rate). Everything is seeded
(`numpy.random.default_rng`). The module is ~500 lines on purpose: the request type, the trace
reader, the generators and the one builder that picks among them belong together (split, the
builder and the request type would import each other's modules).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
import gzip
import math
import zlib
from pathlib import Path

import numpy as np

__all__ = [
    "RequestSpec",
    "Workload",
    "WorkloadConfig",
    "build_workload",
    "gamma_arrivals",
    "reasoning_workload",
    "agentic_workload",
    "load_trace",
    "trace_path",
    "WORKLOAD_NAMES",
]

_DATA = Path(__file__).resolve().parent / "data"
_AZURE_FILES = {
    "azure-conv": "azure_llm_conv_2023.csv.gz",
    "azure-code": "azure_llm_code_2023.csv.gz",
}
_SAMPLE_ROWS = 500
_SAMPLES = {"conv": "azure-conv", "code": "azure-code"}
"""Short names of the first `_SAMPLE_ROWS` requests of a full trace."""
_SYNTHETIC = ("reasoning", "agentic")
WORKLOAD_NAMES = (*_SYNTHETIC, *_SAMPLES, *_AZURE_FILES)
_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


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

    def with_arrivals(self, rate: float, burstiness: float = 1.0, seed: int = 0) -> Workload:
        """The same requests, in order, arriving as a gamma process of ``rate`` req/s.

        The first request arrives at 0; ``rate=inf`` puts every arrival at 0. Open-loop only.
        """
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        if burstiness <= 0:
            raise ValueError(f"burstiness must be > 0, got {burstiness}")
        if any(r.parent_id is not None for r in self.requests):
            raise ValueError(f"workload {self.name!r} has follow-up turns: it keeps its arrivals")
        if math.isinf(rate):
            times = np.zeros(len(self.requests))
        else:
            rng = np.random.default_rng(seed)
            gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=len(self.requests))
            times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
        reqs = tuple(
            dataclasses.replace(r, arrival_time=float(t)) for r, t in zip(self.requests, times)
        )
        return Workload(self.name, reqs)

    def with_token_scale(
        self,
        factor: float,
        max_total: int | None = None,
        *,
        max_prompt: int | None = None,
        max_output: int | None = None,
    ) -> Workload:
        """Prompt and output lengths times ``factor`` (at least 1 token each), then clipped.

        Args:
          factor: length multiplier (e.g. 1/100 to fit a tiny CPU model).
          max_total: clip so that prompt + output stays within this many tokens.
          max_prompt: clip prompts to this many tokens.
          max_output: clip outputs to this many tokens.
        """
        if factor <= 0:
            raise ValueError(f"token scale must be positive, got {factor}")
        reqs = []
        for r in self.requests:
            p = max(int(round(r.prompt_len * factor)), 1)
            o = max(int(round(r.output_len * factor)), 1)
            if max_prompt:
                p = min(p, max_prompt)
            if max_output:
                o = min(o, max_output)
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
      burstiness: gamma shape of the inter-arrival times (1 = Poisson, < 1 burstier); their
        coefficient of variation is ``1 / sqrt(burstiness)``.

    Returns:
      Sorted arrival times.
    """
    if rate <= 0 or duration_s <= 0 or burstiness <= 0:
        raise ValueError(
            f"rate, duration_s and burstiness must be positive, got {rate}, {duration_s}, "
            f"{burstiness}"
        )
    shape = burstiness
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
      burstiness: gamma shape of inter-arrival times (1 = Poisson).
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
      burstiness: gamma shape of session inter-arrival times (1 = Poisson).
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


def trace_path(name: str | Path) -> Path:
    """The file of a trace name (``azure-conv``, ``azure-code``, ``conv``, ``code``: the files in
    ``serve_jax/data/``) or a path (``.csv`` or ``.csv.gz``).

    Raises:
      FileNotFoundError: the file does not exist.
    """
    key = str(name)
    key = _SAMPLES.get(key, key)
    path = _DATA / _AZURE_FILES[key] if key in _AZURE_FILES else Path(key)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    return path


def _parse_time(text: str, path: Path, line: int) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if "." in text:  # the Azure files carry 7 fractional digits; datetime takes 6
        head, frac = text.split(".", 1)
        text = f"{head}.{frac[:6]}"
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ValueError(f"{path}:{line}: bad TIMESTAMP") from None


def load_trace(name: str | Path, limit: int | None = None, skip: int = 0) -> Workload:
    """Reads an Azure-format CSV trace into a `Workload` (arrivals relative to its first row).

    Args:
      name: a trace name (see `trace_path`) or the CSV's path.
      limit: keep at most this many rows (after ``skip``).
      skip: drop this many rows first.

    Raises:
      FileNotFoundError: no such file.
      ValueError: a missing column or a malformed row, naming the file and line (never its text).
    """
    path = trace_path(name)
    if str(name) in _SAMPLES:  # the first rows of a full trace
        skip = min(skip, _SAMPLE_ROWS)
        limit = _SAMPLE_ROWS - skip if limit is None else min(limit, _SAMPLE_ROWS - skip)
    try:
        rows = _read_rows(path, limit, skip)
    except (gzip.BadGzipFile, EOFError, zlib.error):
        raise ValueError(f"{path}: not a gzip-compressed CSV trace") from None
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = min(r[0] for r in rows)
    rows.sort(key=lambda r: r[0])
    reqs = tuple(
        RequestSpec(f"a{skip + i}", t - t0, max(1, c), max(1, g))
        for i, (t, c, g) in enumerate(rows)
    )
    key = str(name)
    return Workload(key if key in _SAMPLES or key in _AZURE_FILES else path.name, reqs)


def _read_rows(path: Path, limit: int | None, skip: int) -> list[tuple[float, int, int]]:
    """(time, context tokens, generated tokens) of rows ``skip`` to ``skip + limit``."""
    rows: list[tuple[float, int, int]] = []
    gz = path.name.endswith(".gz")
    with gzip.open(path, "rt", newline="") if gz else path.open(newline="") as f:
        reader = csv.DictReader(f)
        try:
            fields = reader.fieldnames or []
        except (UnicodeDecodeError, csv.Error):
            raise ValueError(f"{path}: not a CSV trace") from None
        missing = [c for c in _COLUMNS if c not in fields]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; expected {list(_COLUMNS)}")
        try:
            for i, row in enumerate(reader):
                if i < skip:
                    continue
                if limit is not None and len(rows) >= limit:
                    break
                line = i + 2
                try:
                    ctx, gen = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (TypeError, ValueError):
                    raise ValueError(f"{path}:{line}: token counts must be integers") from None
                if ctx < 0 or gen < 0:
                    raise ValueError(f"{path}:{line}: negative token count")
                rows.append((_parse_time(row["TIMESTAMP"] or "", path, line), ctx, gen))
        except (UnicodeDecodeError, csv.Error):
            raise ValueError(f"{path}: not a CSV trace") from None
    return rows


@dataclasses.dataclass(frozen=True)
class WorkloadConfig:
    """Which requests a command runs (the same fields, and flags, for replay, bench, simulate)."""

    name: str = "conv"
    """reasoning, agentic, conv, code, azure-conv, azure-code, or an Azure-format CSV path."""
    num_requests: int | None = None
    """Keep the first N requests (None: all)."""
    skip: int = 0
    """Trace rows skipped first (traces only)."""
    duration_s: float | None = None
    """Span of arrivals: a trace keeps its first ``duration_s`` seconds; a generator draws
    arrivals over it (None: a trace's whole length, one hour for a generator)."""
    rate: float | None = None
    """Arrival rate, req/s (agentic: sessions/s). A trace's timestamps are replaced by a gamma
    process of this rate (None: keep them); a generator draws at it (None: 0.05)."""
    burstiness: float = 1.0
    """Gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 more regular."""
    rate_scale: float = 1.0
    """Arrivals this many times faster (think times of follow-up turns too)."""
    token_scale: float = 1.0
    """Multiply prompt and output lengths by this."""
    max_input_len: int | None = None
    """Clip prompt lengths."""
    max_output_len: int | None = None
    """Clip output lengths."""
    seed: int = 0
    """Seed of the generators and of the arrival process."""


def _is_trace(name: str) -> bool:
    return (
        name in _SAMPLES
        or name in _AZURE_FILES
        or name.endswith((".csv", ".csv.gz"))
        or Path(name).is_file()
    )


def _tightest(*limits: int | None) -> int | None:
    given = [x for x in limits if x]
    return min(given) if given else None


def build_workload(
    cfg: WorkloadConfig, *, max_prompt: int | None = None, max_output: int | None = None
) -> Workload:
    """The workload ``cfg`` describes, lengths clipped to a model's limits too.

    Args:
      cfg: the workload settings.
      max_prompt: the model's longest prompt (clips with ``cfg.max_input_len``).
      max_output: the model's longest output (clips with ``cfg.max_output_len``).

    Raises:
      ValueError: an unknown name, a bad value, or an option that does not apply to the workload.
      FileNotFoundError: a trace file that does not exist.
    """
    if cfg.name in _SYNTHETIC:
        if cfg.skip:
            raise ValueError("skip applies to traces, not to a generated workload")
        kw = dict(duration_s=cfg.duration_s or 3600.0, burstiness=cfg.burstiness, seed=cfg.seed)
        if cfg.rate is not None:
            kw["rate" if cfg.name == "reasoning" else "session_rate"] = cfg.rate
        wl = (reasoning_workload if cfg.name == "reasoning" else agentic_workload)(**kw)
        if cfg.num_requests is not None:
            wl = wl.head(cfg.num_requests)
    elif _is_trace(cfg.name):
        if cfg.duration_s is None:
            wl = load_trace(cfg.name, limit=cfg.num_requests, skip=cfg.skip)
        else:
            wl = load_trace(cfg.name, skip=cfg.skip)
            keep = tuple(r for r in wl.requests if r.arrival_time < cfg.duration_s)
            wl = Workload(wl.name, keep[: cfg.num_requests])
        if cfg.rate is not None:
            wl = wl.with_arrivals(cfg.rate, cfg.burstiness, cfg.seed)
        elif cfg.burstiness != 1.0:
            raise ValueError("burstiness shapes generated arrivals: give a rate with a trace")
    else:
        raise ValueError(
            f"unknown workload {cfg.name!r}: expected one of {', '.join(WORKLOAD_NAMES)} or the "
            "path of an Azure-format CSV (TIMESTAMP, ContextTokens, GeneratedTokens)"
        )
    if cfg.rate_scale != 1.0:
        wl = wl.scaled(cfg.rate_scale)
    mp, mo = _tightest(cfg.max_input_len, max_prompt), _tightest(cfg.max_output_len, max_output)
    if cfg.token_scale != 1.0 or mp or mo:
        wl = wl.with_token_scale(cfg.token_scale, max_prompt=mp, max_output=mo)
    return wl
