"""The OpenAI API as vLLM's server speaks it: request bodies, their checks, errors, responses.

Request bodies are pydantic models in strict mode (``true`` is not an integer, ``"4"`` is not
4) that reject unknown fields, except the fields of the OpenAI and vLLM APIs serve_jax does not
implement (`IGNORED_FIELDS`): those are dropped with a logged warning, as vLLM does. Every
error is the OpenAI shape ``{"error": {"message", "type", "param", "code"}}`` (`error_body`),
``param`` naming the offending field as the client wrote it (``prompt``, ``messages.0.role``;
never pydantic's union tags like ``prompt.str``).

Responses follow OpenAI's shapes (and vLLM's extras: ``token_ids`` per choice,
``num_preemptions`` in usage): `Responder` builds the non-streamed body and each streamed
chunk of ``text_completion`` / ``chat.completion`` objects, logprobs included
(completions: ``tokens``/``token_logprobs``/``top_logprobs``/``text_offset``; chat:
``content`` entries with ``bytes`` and ``top_logprobs``).
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_jax.config import ServerSection
from serve_jax.interface import TokenLogprobs
from serve_jax.request_output import RequestOutput
from serve_jax.sampling import MAX_LOGPROBS, SamplingParams

__all__ = [
    "IGNORED_FIELDS",
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "Responder",
    "error_body",
    "parse_body",
    "sampling_params",
]

log = logging.getLogger("serve_jax.server")

IGNORED_FIELDS = frozenset(
    {
        # OpenAI fields serve_jax does not implement
        "best_of",
        "echo",
        "suffix",
        "logit_bias",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "functions",
        "function_call",
        "service_tier",
        "store",
        "metadata",
        "prediction",
        "modalities",
        "audio",
        "reasoning_effort",
        "web_search_options",
        # vLLM extras serve_jax does not implement
        "use_beam_search",
        "length_penalty",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        "truncate_prompt_tokens",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
        "structured_outputs",
        "priority",
        "request_id",
        "return_tokens_as_token_ids",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template",
        "chat_template_kwargs",
        "documents",
        "mm_processor_kwargs",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
        # message fields (tool calling is not implemented)
        "tool_calls",
        "tool_call_id",
        "refusal",
    }
)
"""Accepted and ignored with a logged warning (vLLM warns the same way about what it ignores)."""


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` and the OpenAI error fields (``kind``
    None: `error_body` picks it from the status)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.kind = kind


_KINDS = {404: "not_found_error", 413: "invalid_request_error", 503: "server_busy"}


def error_body(status: int, message: str, param: str | None = None, kind: str | None = None):
    """The OpenAI error object."""
    kind = kind or ("server_error" if status >= 500 else _KINDS.get(status))
    return {
        "error": {
            "message": message,
            "type": kind or "invalid_request_error",
            "param": param,
            "code": status,
        }
    }


# ---- request bodies ------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data: Any) -> Any:
        if isinstance(data, dict):
            ignored = sorted(k for k in data if k in IGNORED_FIELDS)
            if ignored:
                log.warning("ignoring request fields serve_jax does not implement: %s", ignored)
                data = {k: v for k, v in data.items() if k not in IGNORED_FIELDS}
        return data


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    n: int = Field(default=1, ge=1)
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined with newlines, as vLLM does)."""
        if isinstance(self.content, list):
            return "\n".join(p.text for p in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


_FIELDS = {
    name
    for m in (CompletionRequest, ChatRequest, ChatMessage, TextPart, StreamOptions)
    for name in m.model_fields
}


def _param(loc, unknown: bool = False) -> str | None:
    """The field path of a pydantic error location, without union-member tags (``unknown``:
    the location ends in the name of an unknown field)."""
    known = loc[:-1] if unknown else loc
    parts = [str(x) for x in known if isinstance(x, int) or x in _FIELDS]
    if unknown:
        parts.append(str(loc[-1]))
    return ".".join(parts) or None


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """Decodes, parses and validates a request body.

    Raises:
      RequestError: not UTF-8, not JSON, not an object, or a field that fails validation.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise RequestError(400, f"request body is not valid JSON: {e}") from None
    except RecursionError:
        raise RequestError(400, "request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        # Of a union's member errors, the deepest says most (a bad part of a list of parts).
        first = max(e.errors(), key=lambda err: len(err["loc"]))
        param = _param(first["loc"], first["type"] == "extra_forbidden")
        if first["type"] == "extra_forbidden":
            raise RequestError(400, f"unknown field {param!r}", param) from None
        if first["type"] == "missing":
            raise RequestError(400, f"{param} is required", param) from None
        raise RequestError(400, f"{param or 'body'}: {first['msg']}", param) from None


def sampling_params(
    body: _Sampling, server: ServerSection, default_max_tokens: int = 16
) -> SamplingParams:
    """The engine's `SamplingParams` of a request body (no seed: a random one; no max_tokens:
    ``default_max_tokens``).

    Raises:
      RequestError: too many or too long stop strings, too many stop ids, too large ``n``, or a
        value `SamplingParams` refuses.
    """
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or ())
    stop_ids = list(body.stop_token_ids or ())
    cap = server.max_stop_strings
    for name, values in (("stop", stop), ("stop_token_ids", stop_ids)):
        if len(values) > cap:
            raise RequestError(400, f"{name} has {len(values)} entries; at most {cap}", name)
    longest = max(map(len, stop), default=0)
    if longest > server.max_stop_string_chars:
        raise RequestError(
            400,
            f"stop strings must be at most {server.max_stop_string_chars} characters, "
            f"one has {longest}",
            "stop",
        )
    if body.stream_options is not None and not body.stream:
        raise RequestError(400, "stream_options needs stream: true", "stream_options")
    if body.n > server.max_n:
        raise RequestError(400, f"n must be at most {server.max_n}, got {body.n}", "n")
    if isinstance(body, ChatRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs is not None and not body.logprobs:
            raise RequestError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    else:
        max_tokens, logprobs = body.max_tokens, body.logprobs
    try:
        return SamplingParams(
            max_tokens=max_tokens or default_max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            seed=secrets.randbelow(2**31) if body.seed is None else body.seed,
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            n=body.n,
        )
    except ValueError as e:
        raise RequestError(400, str(e), str(e).split(" ", 1)[0]) from None


# ---- responses -----------------------------------------------------------------------------


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI usage of a request's samples (prompt counted once), plus vLLM-style extras."""
    prompt = len(outputs[0].prompt_token_ids) if outputs else 0
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "num_preemptions": sum(o.metrics.num_preemptions for o in outputs),
    }


class Responder:
    """Builds the response objects of one request (``chat`` or completions)."""

    def __init__(self, rid: str, model: str, created: int, chat: bool, tokenizer):
        self.rid, self.model, self.created, self.chat = rid, model, created, chat
        self._tok = tokenizer
        self._offset: dict[int, int] = {}

    def _token(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def logprobs(self, index: int, ids, lps: tuple[TokenLogprobs, ...] | None):
        """The choice's ``logprobs`` object for tokens ``ids`` (None when not asked for)."""
        if lps is None:
            return None
        if self.chat:
            content = []
            for t, lp in zip(ids, lps, strict=True):
                text = self._token(t)
                top = [
                    {"token": s, "logprob": x, "bytes": list(s.encode())}
                    for s, x in ((self._token(i), x) for i, x in zip(lp.top_ids, lp.top_logprobs))
                ]
                entry = {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}
                content.append({**entry, "top_logprobs": top})
            return {"content": content}
        tokens = [self._token(t) for t in ids]
        offsets = []
        pos = self._offset.get(index, 0)
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
        self._offset[index] = pos
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [self._top(lp) for lp in lps],
            "text_offset": offsets,
        }

    def _top(self, lp: TokenLogprobs) -> dict[str, float]:
        """Completions' ``{token text: logprob}``; ids with the same text keep the likelier."""
        top: dict[str, float] = {}
        for i, x in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top.setdefault(self._token(i), x)
        return top

    def _object(self, kind: str, choices: list, **extra) -> dict:
        name = ("chat.completion" if self.chat else "text_completion") + kind
        head = {"id": self.rid, "object": name, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    def complete(self, outputs: list[RequestOutput]) -> dict:
        """The non-streamed response of the request's finished samples."""
        choices = []
        for out in sorted(outputs, key=lambda o: o.index):
            choice: dict[str, Any] = {"index": out.index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": out.text}
            else:
                choice["text"] = out.text
            choice["logprobs"] = self.logprobs(out.index, out.token_ids, out.logprobs)
            choice["finish_reason"] = out.finish_reason
            choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        return self._object("", choices, usage=usage(outputs))

    def first_chunks(self, n: int) -> list[dict]:
        """Chat streams open each choice with an assistant-role delta; completions with none."""
        if not self.chat:
            return []
        return [
            self._object(
                ".chunk",
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ],
            )
            for i in range(n)
        ]

    def chunk(self, out: RequestOutput) -> dict:
        """The streamed chunk of one output (its new text and tokens)."""
        reason = out.finish_reason if out.finished else None
        choice: dict[str, Any] = {"index": out.index}
        if self.chat:
            choice["delta"] = {"content": out.new_text} if out.new_text or not reason else {}
        else:
            choice["text"] = out.new_text
        choice["logprobs"] = self.logprobs(out.index, out.new_token_ids, out.new_logprobs)
        choice["finish_reason"] = reason
        choice["token_ids"] = list(out.new_token_ids)
        return self._object(".chunk", [choice])

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        """The last chunk when ``stream_options.include_usage``: no choices, the usage."""
        return self._object(".chunk", [], usage=usage(outputs))
