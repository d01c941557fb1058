"""Request traces in the Azure LLM inference format (TIMESTAMP, ContextTokens, GeneratedTokens).

`load_trace` reads a CSV into `TraceRequest` rows with arrival times relative to the first row.
Prompt text is not part of these traces: replay and bench make prompts of the given length and
force the given output length. Small samples ship in ``serve_jax/data/`` (with attribution).
"""

from __future__ import annotations

import csv
import dataclasses
import datetime as dt
from pathlib import Path

import numpy as np

__all__ = [
    "TraceRequest",
    "load_trace",
    "sample_trace_path",
    "with_arrivals",
    "scale_lengths",
]

_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_DATA = Path(__file__).resolve().parent / "data"


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    arrival_s: float
    """Seconds after the first request."""
    prompt_tokens: int
    output_tokens: int


def sample_trace_path(name: str = "conv") -> Path:
    """Path of a shipped sample: ``conv`` or ``code``."""
    if name not in ("conv", "code"):
        raise ValueError(f"no sample trace {name!r}; known: conv, code")
    return _DATA / f"azure_llm_{name}_2023_sample.csv"


def _parse_time(text: str, path, line: int) -> float:
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
        raise ValueError(f"{path}:{line}: bad TIMESTAMP {text!r}") from None


def load_trace(path: str | Path, limit: int | None = None, skip: int = 0) -> list[TraceRequest]:
    """Reads an Azure-format CSV trace.

    Args:
      path: the CSV file (``sample_trace_path("conv")`` for the shipped sample).
      limit: keep at most this many rows (after ``skip``).
      skip: drop this many rows first.

    Raises:
      ValueError: a missing column or a malformed row, naming the file and line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"trace file {str(path)!r} does not exist")
    rows: list[tuple[float, int, int]] = []
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing column(s) {missing}; expected {list(_COLUMNS)}")
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
            rows.append((_parse_time(row["TIMESTAMP"], path, line), ctx, gen))
    if not rows:
        raise ValueError(f"{path}: no requests")
    t0 = min(r[0] for r in rows)
    rows.sort(key=lambda r: r[0])
    return [TraceRequest(t - t0, max(1, c), max(1, g)) for t, c, g in rows]


def with_arrivals(
    trace: list[TraceRequest], rate: float | None, burstiness: float = 1.0, seed: int = 0
) -> list[TraceRequest]:
    """Replaces arrival times with a gamma process of ``rate`` req/s (Poisson at burstiness 1).

    ``rate=None`` (or ``inf``) keeps the trace's own timestamps ("inf": all at time 0).
    """
    if rate is None:
        return list(trace)
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if np.isinf(rate):
        return [dataclasses.replace(r, arrival_s=0.0) for r in trace]
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=len(trace))
    times = np.concatenate([[0.0], np.cumsum(gaps[:-1])])
    return [dataclasses.replace(r, arrival_s=float(t)) for r, t in zip(trace, times)]


def scale_lengths(
    trace: list[TraceRequest],
    token_scale: float = 1.0,
    max_prompt: int | None = None,
    max_output: int | None = None,
) -> list[TraceRequest]:
    """Multiplies token counts by ``token_scale`` and clips them (to fit a small model)."""
    out = []
    for r in trace:
        p = max(1, round(r.prompt_tokens * token_scale))
        o = max(1, round(r.output_tokens * token_scale))
        if max_prompt:
            p = min(p, max_prompt)
        if max_output:
            o = min(o, max_output)
        out.append(dataclasses.replace(r, prompt_tokens=p, output_tokens=o))
    return out
