"""OpenAI-compatible HTTP server (FastAPI + uvicorn) over the `Engine`, as vLLM's server.

Endpoints: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (``stream: true`` sends
server-sent events, then ``data: [DONE]``), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text under vLLM's metric names: `serve_jax.prom_metrics`). Request
and response shapes, the fields accepted and ignored, and the error object are in
`serve_jax.openai_protocol`.

Every error, from a route, from body parsing, or from an unknown path or method, is the OpenAI
error object with the offending field in ``param``. A body over ``server.max_body_bytes`` is
answered 413 before it is read (`BodyLimit`: from Content-Length, or while a chunked body is
read); only then is it parsed (UTF-8, JSON, the strict request model).

Threading: the engine is single-threaded and runs in one background thread (`EngineLoop`).
HTTP handlers never touch it directly: they submit commands (add, abort) that the loop thread
runs between steps, and receive outputs through per-request asyncio queues. A request is either
rejected before it is accepted (HTTP 400/404/413/503) or, once accepted, always ends with a
finish reason or an error event: an exception in a step fails the requests it touched instead of
losing them. A client that disconnects has its request aborted, which frees its pages.
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
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from serve_jax.config import EngineConfig
from serve_jax.engine import Engine
from serve_jax.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    RequestError,
    Responder,
    error_body,
    parse_body,
    sampling_params,
)
from serve_jax.prom_metrics import CONTENT_TYPE_LATEST, ServeMetrics
from serve_jax.request_output import RequestOutput
from serve_jax.sampling import SamplingParams

__all__ = ["BodyLimit", "EngineLoop", "build_app", "run_server"]

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
                if out.request_finished:
                    self._streams.pop(out.request_id, None)
            self.metrics.observe_outputs(outputs)


class BodyLimit:
    """ASGI middleware: 413 for a body over ``max_bytes``, decided before it is parsed.

    A Content-Length over the limit is refused without reading a byte; otherwise the body is
    read here, counting bytes (a chunked body has no Content-Length), and refused as soon as it
    passes the limit. The app then gets the body as one message.
    """

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_bytes
            except ValueError:
                return await _send_json(send, 400, error_body(400, "bad Content-Length"))
            if too_big:
                return await self._refuse(send)
        chunks, total, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body = message.get("body", b"")
            total += len(body)
            if total > self.max_bytes:
                return await self._refuse(send)
            chunks.append(body)
            more = message.get("more_body", False)
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()  # later messages: the disconnect
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, send):
        message = f"request body is larger than the server's limit of {self.max_bytes} bytes"
        await _send_json(send, 413, error_body(413, message), close=True)


async def _send_json(send, status: int, body: dict, close: bool = False) -> None:
    data = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


def _error(status: int, message: str, param=None, kind=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, kind), status, headers=headers)


def build_app(loop: EngineLoop, config: EngineConfig) -> FastAPI:
    """The FastAPI app serving ``loop``'s engine (wrapped in `BodyLimit`)."""
    app = FastAPI(title="serve_jax", version="0.1.0")
    app.add_middleware(BodyLimit, max_bytes=config.server.max_body_bytes)
    model_name = config.model.name
    engine = loop.engine

    @app.exception_handler(RequestError)
    async def _refused(request: Request, exc: RequestError):
        return _error(exc.status, exc.message, exc.param, exc.kind)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        if exc.status_code == 404:
            return _error(404, f"no route {request.url.path}", None, "not_found_error")
        if exc.status_code == 405:
            allowed = exc.headers.get("Allow", "") if exc.headers else ""
            message = f"method {request.method} not allowed on {request.url.path}"
            return _error(405, message, None, headers={"Allow": allowed} if allowed else None)
        return _error(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}", None)

    @app.get("/health")
    async def health():
        if not loop.is_alive:
            return _error(503, "engine loop is not running", None, "server_error")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "serve_jax",
            "max_model_len": engine.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics():
        return Response(loop.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def submit(body, prompt, prompt_field: str, chat: bool, request: Request):
        if body.model is not None and body.model != model_name:
            message = f"model {body.model!r} does not exist; serving {model_name!r}"
            raise RequestError(404, message, "model")
        # Without max_tokens a completion gets 16 (OpenAI's legacy default, as vLLM); a chat
        # reply may run to the end of the context, as OpenAI and vLLM do.
        default = max(1, engine.max_model_len - len(prompt)) if chat else 16
        params = sampling_params(body, config.server, default)
        if loop.num_pending >= config.server.max_queue:
            retry = {"Retry-After": str(config.server.retry_after_s)}
            return _error(503, "server is at capacity; retry later", None, "server_busy", retry)
        try:
            rid, queue = await loop.add(prompt, params)
        except ValueError as e:
            raise RequestError(400, str(e), _engine_param(str(e), prompt_field)) from None
        responder = Responder(rid, model_name, int(time.time()), chat, engine.tokenizer)
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            gen = _stream(loop, rid, queue, responder, params, usage)
            return StreamingResponse(gen, media_type="text/event-stream")
        return await _complete(loop, rid, queue, responder, params, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_body(await request.body(), CompletionRequest)
        if isinstance(body.prompt, str) and not body.prompt:
            raise RequestError(400, "prompt is empty", "prompt")
        return await submit(body, body.prompt, "prompt", False, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_body(await request.body(), ChatRequest)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:  # the model's own chat template (serve_jax.tokenizer)
            prompt = engine.tokenizer.chat_ids(messages)
        except ValueError as e:
            raise RequestError(400, str(e), "messages") from None
        return await submit(body, prompt, "messages", True, request)

    return app


_ENGINE_FIELDS = ("max_tokens", "stop_token_ids", "min_tokens")


def _engine_param(message: str, prompt_field: str) -> str:
    """The field an engine refusal is about: a field it names first, else the prompt."""
    first = message.split(" ", 1)[0]
    return first if first in _ENGINE_FIELDS else prompt_field


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _stream(loop: EngineLoop, rid, queue, responder: Responder, params, include_usage):
    finished = False
    final: dict[int, RequestOutput] = {}
    try:
        for chunk in responder.first_chunks(params.n):
            yield _sse(chunk)
        while True:
            item = await queue.get()
            if isinstance(item, Exception):
                yield _sse(error_body(500, f"engine error: {item}"))
                finished = True
                break
            out: RequestOutput = item
            yield _sse(responder.chunk(out))
            if out.finished:
                final[out.index] = out
            if out.request_finished:
                finished = True
                break
        if include_usage:
            yield _sse(responder.usage_chunk(list(final.values())))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # client went away (or the server is shutting down)
            loop.abort(rid)


async def _complete(loop: EngineLoop, rid, queue, responder, params, request: Request):
    final: dict[int, RequestOutput] = {}
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
            if item.finished:
                final[item.index] = item
            if item.request_finished:
                break
    except asyncio.CancelledError:
        loop.abort(rid)
        raise
    return responder.complete(list(final.values()))


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
