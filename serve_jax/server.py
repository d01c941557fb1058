"""OpenAI-style HTTP server (FastAPI + uvicorn) over the `Engine`.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, one per token, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health``
and ``GET /metrics`` (Prometheus text under vLLM's metric names: `serve_jax.prom_metrics`).

Threading: the engine is single-threaded and runs in one background thread (`EngineLoop`).
HTTP handlers never touch it directly: they submit commands (add, abort) that the loop thread
runs between steps, and receive outputs through per-request asyncio queues. A request is either
rejected before it is accepted (HTTP 400/404/503 with a JSON error naming the field) or, once
accepted, always ends with a finish reason or an error event: an exception in a step fails the
requests it touched instead of losing them. A client that disconnects has its request aborted,
which frees its pages.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
import uuid
from collections import deque
from typing import Any, Literal

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from serve_jax.config import EngineConfig
from serve_jax.engine import Engine, RequestOutput
from serve_jax.prom_metrics import CONTENT_TYPE_LATEST, ServeMetrics
from serve_jax.sampling import SamplingParams

__all__ = ["EngineLoop", "build_app", "run_server"]

log = logging.getLogger("serve_jax.server")


class EngineLoop:
    """Runs `Engine.step` in a background thread; handlers talk to it through commands."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._cmds: deque[tuple[Any, concurrent.futures.Future]] = deque()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.metrics = ServeMetrics(engine, engine.config.model.name)

    def start(self) -> None:
        """Starts the engine thread."""
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        """Whether the engine thread is running."""
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stops the engine thread (requests still running get no more tokens)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    @property
    def num_pending(self) -> int:
        """Accepted requests not finished yet (queued commands included)."""
        return len(self._streams)

    def _call(self, fn) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.append((fn, fut))
        self._wake.set()
        return fut

    async def add(self, prompt, params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Adds a request; returns its id and the queue its outputs arrive on.

        Raises:
          ValueError: the engine rejected the request (too long, bad token ids, ...).
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        self._streams[rid] = (loop, queue)

        def add():
            return self.engine.add_request(prompt, params, request_id=rid)

        try:
            await asyncio.wrap_future(self._call(add))
        except ValueError:
            self._streams.pop(rid, None)
            raise
        except BaseException:  # cancelled (client gone): the add may still run, so abort it
            self.abort(rid)
            raise
        return rid, queue

    def abort(self, rid: str) -> None:
        """Aborts ``rid`` (if still running) and frees its pages; returns at once."""
        self._streams.pop(rid, None)
        self._call(lambda: self.engine.abort(rid) and self.metrics.record_abort())

    def _emit(self, rid: str, item) -> None:
        target = self._streams.get(rid)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the handler's event loop is gone
            self._streams.pop(rid, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            while self._cmds:
                fn, fut = self._cmds.popleft()
                try:
                    fut.set_result(fn())
                except Exception as e:  # reported to the caller
                    fut.set_exception(e)
            if not self.engine.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                self.metrics.observe_outputs(())
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # never lose an accepted request: fail it loudly
                log.exception("engine step failed")
                self.metrics.step_errors.inc()
                for rid in list(self._streams):
                    self._emit(rid, e)
                    try:
                        self.engine.abort(rid)
                    except Exception:
                        log.exception("abort after a failed step")
                    self._streams.pop(rid, None)
                continue
            for out in outputs:
                self._emit(out.request_id, out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
            self.metrics.observe_outputs(outputs)


# ---- request bodies ---------------------------------------------------------------------


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=100.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**31)
    n: int = Field(default=1, ge=1, le=1)
    ignore_eos: bool = False
    user: str | None = None


class CompletionRequest(_Base):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def _error(
    status: int,
    message: str,
    param: str | None,
    kind: str = "invalid_request_error",
    headers: dict | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _usage(out: RequestOutput) -> dict:
    return {
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(out.token_ids),
        "total_tokens": len(out.prompt_token_ids) + len(out.token_ids),
        "num_preemptions": out.metrics.num_preemptions,
    }


# ---- app ----------------------------------------------------------------------------------


def build_app(loop: EngineLoop, config: EngineConfig) -> FastAPI:
    """The FastAPI app serving ``loop``'s engine."""
    app = FastAPI(title="serve_jax", version="0.1.0")
    model_name = config.model.name
    engine = loop.engine

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", None)
        if first.get("type") == "extra_forbidden":
            return _error(400, f"unknown field {param!r}", param)
        msg = first.get("msg", "invalid request")
        return _error(400, f"{param or 'body'}: {msg}", param)

    @app.get("/health")
    async def health():
        if not loop.is_alive:
            return _error(503, "engine loop is not running", None, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "serve_jax",
                    "max_model_len": engine.max_model_len,
                }
            ],
        }

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def _submit(body: _Base, prompt, prompt_field: str, chat: bool, request: Request):
        if body.model is not None and body.model != model_name:
            return _error(
                404,
                f"model {body.model!r} does not exist; serving {model_name!r}",
                "model",
                "not_found_error",
            )
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens or 16
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                stop=tuple([body.stop] if isinstance(body.stop, str) else body.stop or ()),
                seed=body.seed or 0,
                ignore_eos=body.ignore_eos,
            )
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            return _error(400, str(e), field)
        if loop.num_pending >= config.server.max_queue:
            return _error(
                503,
                "server is at capacity; retry later",
                None,
                "server_busy",
                headers={"Retry-After": str(config.server.retry_after_s)},
            )
        try:
            rid, queue = await loop.add(prompt, params)
        except ValueError as e:
            text = str(e)
            param = "max_tokens" if "max_tokens" in text and "prompt" not in text else prompt_field
            return _error(400, text, param)
        created = int(time.time())
        if body.stream:
            include_usage = bool((body.stream_options or {}).get("include_usage"))
            gen = _stream(loop, rid, queue, created, chat, include_usage, model_name)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _complete(loop, rid, queue, created, chat, model_name, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        prompt = body.prompt
        if isinstance(prompt, str) and not prompt:
            return _error(400, "prompt is empty", "prompt")
        return await _submit(body, prompt, "prompt", False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:  # the model's own chat template (serve_jax.tokenizer)
            prompt = engine.tokenizer.chat_ids(messages)
        except ValueError as e:
            return _error(400, str(e), "messages")
        return await _submit(body, prompt, "messages", True, request)

    return app


def _chunk(rid, created, model, chat, text, token_ids, finish_reason) -> dict:
    if chat:
        delta = {"content": text} if text or finish_reason is None else {}
        choice = {
            "index": 0,
            "delta": delta,
            "finish_reason": finish_reason,
            "token_ids": list(token_ids),
        }
        obj = "chat.completion.chunk"
    else:
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": finish_reason,
            "logprobs": None,
            "token_ids": list(token_ids),
        }
        obj = "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


async def _stream(loop: EngineLoop, rid, queue, created, chat, include_usage, model):
    finished = False
    try:
        if chat:
            first = _chunk(rid, created, model, True, "", (), None)
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            yield f"data: {json.dumps(first)}\n\n"
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                err = {"error": {"message": f"engine error: {item}", "type": "server_error"}}
                yield f"data: {json.dumps(err)}\n\n"
                finished = True
                break
            out: RequestOutput = item
            payload = _chunk(
                rid,
                created,
                model,
                chat,
                out.new_text,
                out.new_token_ids,
                out.finish_reason if out.finished else None,
            )
            if out.finished and include_usage:
                payload["usage"] = _usage(out)
            elif out.finished:
                payload["usage"] = _usage(out)
            yield f"data: {json.dumps(payload)}\n\n"
            if out.finished:
                finished = True
                break
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client went away (or the server is shutting down)
            loop.abort(rid)


async def _complete(loop: EngineLoop, rid, queue, created, chat, model, request: Request):
    out: RequestOutput | None = None
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), timeout=0.5)
            except TimeoutError:
                if await request.is_disconnected():
                    loop.abort(rid)
                    return _error(499, "client disconnected", None)
                continue
            if isinstance(item, Exception):
                return _error(500, f"engine error: {item}", None, "server_error")
            out = item
            if out.finished:
                break
    except asyncio.CancelledError:
        loop.abort(rid)
        raise
    if chat:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "finish_reason": out.finish_reason,
            "token_ids": list(out.token_ids),
        }
        obj = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "logprobs": None,
            "token_ids": list(out.token_ids),
        }
        obj = "text_completion"
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": _usage(out),
    }


def run_server(config: EngineConfig, host: str | None = None, port: int | None = None) -> None:
    """Builds the engine, starts its loop and serves HTTP until interrupted."""
    engine = Engine(config)
    loop = EngineLoop(engine)
    loop.start()
    app = build_app(loop, config)
    host = host or config.server.host
    port = port or config.server.port
    print(
        f"serve_jax: {config.model.name} ({config.model.preset}) on http://{host}:{port}",
        flush=True,
    )
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        loop.stop()
