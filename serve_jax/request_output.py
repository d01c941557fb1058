"""What the caller of `serve_jax.engine.Engine.step` sees of a request, and how it is built.

`RequestOutput` is the state of one sample of a request after a step: its token ids, its text
so far and what is new, its logprobs, whether it (and the whole request) finished, and its
`RequestMetrics`. `SampleState` is the engine's per-sample bookkeeping behind it: an incremental
decoder (one decode step per token), stop strings (searched only in new text, never before
``min_tokens``; text that may begin a stop string is held back until the next tokens decide
it), and how much of the ids, text and logprobs the caller has already been sent. The stop
token that ended a sample (EOS or one of ``stop_token_ids``) stays in the ids but is not text.

Pure Python: no JAX here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from serve_jax.interface import Request, RequestStatus, TokenLogprobs

if TYPE_CHECKING:
    from serve_jax.sampling import SamplingParams
    from serve_jax.tokenizer import IncrementalDecoder

__all__ = ["RequestMetrics", "RequestOutput", "SampleState", "request_metrics"]

_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """Timestamps of one request (engine clock, seconds)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: tuple[float, ...]
    finish_time: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """The state of one request after a step."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    """All output token ids so far."""
    text: str
    """All output text so far (stop string removed)."""
    new_token_ids: tuple[int, ...]
    new_text: str
    """Text added since the last output of this request."""
    finished: bool
    finish_reason: str | None
    """``stop``, ``length`` or ``abort`` once finished."""
    metrics: RequestMetrics
    index: int = 0
    """Which of the request's ``n`` samples this is."""
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """Per output token (when the request asked for logprobs)."""
    new_logprobs: tuple[TokenLogprobs, ...] | None = None
    """Those of ``new_token_ids``."""
    request_finished: bool = True
    """Whether every sample of the request has finished (this output is the request's last)."""


def request_metrics(req: Request) -> RequestMetrics:
    """Timestamps of a scheduler `Request`."""
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        token_times=tuple(req.token_times),
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
    text: str = ""
    """Decoded output text (cut at a stop string once one is found)."""
    decoded: int = 0
    """Output tokens fed to the decoder."""
    sent_text: int = 0
    sent_tokens: int = 0

    def advance_text(self, finished: bool) -> bool:
        """Decodes the new output tokens and cuts the text at a stop string; returns whether a
        stop string was found (the caller then ends the request)."""
        req = self.request
        ids = req.output_token_ids
        end = len(ids)
        if req.status == RequestStatus.FINISHED_STOPPED and ids and ids[-1] in req.stop_token_ids:
            end -= 1  # the stop token ends the text; it is not part of it
        old_len = len(self.text)
        if self.decoded < end:
            step = self.decoder.step
            self.text += "".join(step(t) for t in ids[self.decoded : end])
            self.decoded = end
        if finished:
            self.text += self.decoder.flush()
        stops = self.params.stop
        if not stops or len(ids) < self.params.min_tokens:
            return False
        # Only text that is new (plus what a stop string straddling it needs) is searched.
        start = max(0, old_len - max(map(len, stops)) + 1)
        hits = [h for h in (self.text.find(s, start) for s in stops) if h >= 0]
        if hits:
            self.text = self.text[: min(hits)]
        return bool(hits)

    def emit(self, finished: bool, request_finished: bool) -> RequestOutput:
        """The output after `advance_text`: everything so far, and what was not sent yet."""
        req = self.request
        ids = req.output_token_ids
        stops = self.params.stop
        # Hold back what may be the start of a stop string until the next tokens decide it.
        stable = len(self.text)
        if stops and not finished:
            stable = max(self.sent_text, stable - max(map(len, stops)) + 1)
        new_text = self.text[self.sent_text : stable]
        self.sent_text = stable
        new_ids = tuple(ids[self.sent_tokens :])
        lps = self.logprobs
        new_lps = tuple(lps[self.sent_tokens :]) if lps is not None else None
        self.sent_tokens = len(ids)
        return RequestOutput(
            request_id=self.parent,
            prompt_token_ids=tuple(req.prompt_token_ids),
            token_ids=tuple(ids),
            text=self.text[:stable],
            new_token_ids=new_ids,
            new_text=new_text,
            finished=finished,
            finish_reason=_FINISH_REASON.get(req.status) if finished else None,
            metrics=request_metrics(req),
            index=self.index,
            logprobs=tuple(lps) if lps is not None else None,
            new_logprobs=new_lps,
            request_finished=finished and request_finished,
        )
