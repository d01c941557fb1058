"""What the caller of `serve_jax.engine.Engine.step` sees of a request, and how it is built.

`RequestOutput` is the state of one sample of a request after a step: its token ids, its text
so far and what is new, its logprobs, whether it (and the whole request) finished, and its
`RequestMetrics`. `SampleState` is the engine's per-sample bookkeeping behind it: an incremental
decoder (one decode step per token), stop strings (searched only in new text, never before
``min_tokens``; text that may begin a stop string is held back until the next tokens decide
it), and how much of the ids, text and logprobs the caller has already been sent. The stop
token that ended a sample (EOS or one of ``stop_token_ids``) stays in the ids but is not text.

A step's work per sample follows what is new, not the whole output: the histories an output
carries (prompt and output ids, logprobs, token times) are `History` views of the engine's lists,
which only grow, and its full text is joined from the decoded pieces only when read. (Copying
them every step made a long generation quadratic in its length.)

Pure Python: no JAX here.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from serve_jax.interface import Request, RequestStatus, TokenLogprobs

if TYPE_CHECKING:
    from serve_jax.sampling import SamplingParams
    from serve_jax.tokenizer import IncrementalDecoder

__all__ = ["History", "RequestMetrics", "RequestOutput", "SampleState", "request_metrics"]

T = TypeVar("T")

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class History(Sequence[T]):
    """The first ``n`` items of a list that only grows, read in place (made in O(1)).

    Compares equal to a tuple or list of the same items; a slice is a tuple.
    """

    __slots__ = ("_items", "_n")

    def __init__(self, items: Sequence[T], n: int | None = None):
        self._items = items
        self._n = len(items) if n is None else n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return tuple(self._items[j] for j in range(*i.indices(self._n)))
        j = i + self._n if i < 0 else i
        if not 0 <= j < self._n:
            raise IndexError(f"index {i} out of range for {self._n} items")
        return self._items[j]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, History | tuple | list):
            return NotImplemented
        return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=False))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Timestamps of one request (engine clock, seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: Sequence[float]
    """When each output token arrived (a `History`)."""
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step."""

    request_id: str
    prompt_token_ids: Sequence[int]
    token_ids: Sequence[int]
    """All output token ids so far (a `History`)."""
    new_token_ids: tuple[int, ...]
    new_text: str
    """Text added since the last output of this request."""
    finished: bool
    finish_reason: str | None
    """``stop``, ``length`` or ``abort`` once finished."""
    metrics: RequestMetrics
    index: int = 0
    """Which of the request's ``n`` samples this is."""
    logprobs: Sequence[TokenLogprobs] | None = None
    """Per output token (when the request asked for logprobs; a `History`)."""
    new_logprobs: tuple[TokenLogprobs, ...] | None = None
    """Those of ``new_token_ids``."""
    request_finished: bool = True
    """Whether every sample of the request has finished (this output is the request's last)."""
    text_pieces: Sequence[str] = ()
    """The decoded pieces of the output text (stop string removed), joined by `text`."""
    text_length: int = 0
    """Characters of them that are text so far (the rest is held back)."""

    @functools.cached_property
    def text(self) -> str:
        """All output text so far (stop string removed)."""
        return "".join(self.text_pieces)[: self.text_length]


def request_metrics(req: Request) -> RequestMetrics:
    """Timestamps of a scheduler `Request` (its token times as a `History`)."""
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        token_times=History(req.token_times),
        finish_time=req.finish_time,
        num_prompt_tokens=req.num_prompt_tokens,
        num_output_tokens=req.num_output_tokens,
        num_preemptions=req.num_preemptions,
    )


@dataclasses.dataclass
class SampleState:
    request: Request
    params: SamplingParams
    decoder: IncrementalDecoder
    parent: str
    """The id the caller knows (the request's; samples of ``n > 1`` have their own ids)."""
    index: int = 0
    logprobs: list[TokenLogprobs] | None = None
    pieces: list[str] = dataclasses.field(default_factory=list)
    """Decoded output text in pieces, one per step (a stop string cut joins them into one)."""
    text_length: int = 0
    """Characters of text (the pieces' total, up to a stop string once one is found)."""
    decoded: int = 0
    """Output tokens fed to the decoder."""
    sent_text: int = 0
    sent_tokens: int = 0

    def text_from(self, start: int) -> str:
        """The text from character ``start`` on, joined from the last pieces only."""
        need, taken = self.text_length - start, []
        got = 0
        for piece in reversed(self.pieces):
            if got >= need:
                break
            taken.append(piece)
            got += len(piece)
        tail = "".join(reversed(taken))
        return tail[len(tail) - need :] if need > 0 else ""

    def _append(self, piece: str) -> None:
        if piece:
            self.pieces.append(piece)
            self.text_length += len(piece)

    def advance_text(self, finished: bool) -> bool:
        """Decodes the new output tokens and cuts the text at a stop string; returns whether a
        stop string was found (the caller then ends the request)."""
        req = self.request
        ids = req.output_token_ids
        end = len(ids)
        if req.status == RequestStatus.FINISHED_STOPPED and ids and ids[-1] in req.stop_token_ids:
            end -= 1  # the stop token ends the text; it is not part of it
        old_len = self.text_length
        if self.decoded < end:
            step = self.decoder.step
            self._append("".join(step(t) for t in ids[self.decoded : end]))
            self.decoded = end
        if finished:
            self._append(self.decoder.flush())
        stops = self.params.stop
        if not stops or len(ids) < self.params.min_tokens:
            return False
        # Only text that is new (plus what a stop string straddling it needs) is searched.
        start = max(0, old_len - max(map(len, stops)) + 1)
        tail = self.text_from(start)
        hits = [h for h in (tail.find(s) for s in stops) if h >= 0]
        if hits:
            cut = start + min(hits)
            # A new list: outputs already handed out keep reading the old one.
            self.pieces = ["".join(self.pieces)[:cut]]
            self.text_length = cut
        return bool(hits)

    def emit(self, finished: bool, request_finished: bool) -> RequestOutput:
        """The output after `advance_text`: everything so far, and what was not sent yet.

        Work and copies follow the new tokens: the histories are views and the full text is
        joined only if the caller reads it.
        """
        req = self.request
        ids = req.output_token_ids
        stops = self.params.stop
        # Hold back what may be the start of a stop string until the next tokens decide it.
        stable = self.text_length
        if stops and not finished:
            stable = max(self.sent_text, stable - max(map(len, stops)) + 1)
        new_text = self.text_from(self.sent_text)[: stable - self.sent_text]
        self.sent_text = stable
        n = len(ids)
        new_ids = tuple(ids[self.sent_tokens :])
        lps = self.logprobs
        new_lps = tuple(lps[self.sent_tokens :]) if lps is not None else None
        self.sent_tokens = n
        return RequestOutput(
            request_id=self.parent,
            prompt_token_ids=History(req.prompt_token_ids),
            token_ids=History(ids, n),
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=_FINISH_REASON.get(req.status) if finished else None,
            metrics=request_metrics(req),
            index=self.index,
            logprobs=History(lps) if lps is not None else None,
            new_logprobs=new_lps,
            request_finished=finished and request_finished,
            text_pieces=History(self.pieces),
            text_length=stable,
        )
