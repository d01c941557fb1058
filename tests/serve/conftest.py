"""Shared fixtures of the serve tests: a live OpenAI-style server on a loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import uvicorn

from serve_jax.server import EngineLoop, build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _running_server(engine, cfg):
    """Serves ``engine`` with uvicorn in a thread; yields its base URL, stops it on exit."""
    loop = EngineLoop(engine)
    loop.start()
    port = _free_port()
    uv = uvicorn.Server(
        uvicorn.Config(build_app(loop, cfg), host="127.0.0.1", port=port, log_level="error")
    )
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not uv.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)
        loop.stop()


@pytest.fixture(scope="session")
def running_server():
    """``with running_server(engine, cfg) as url:`` serves the engine for the block's length."""
    return _running_server
