"""A loopback HTTP object server with a congestion model: the remote store of the pipeline tests.

`ObjectServer` serves the files under a directory (the chunk files of a sharded data set,
`paragan_jax.shards`) over HTTP/1.1 on 127.0.0.1, from a thread of this process (stdlib
``http.server``; one handler thread per connection, keep-alive, ``Range`` requests as an object
store answers them). Clients read it through real sockets: tensorstore's ``http`` kvstore, the
same reader that reads local files or ``gs://`` (`paragan_jax.shards.ShardedStorage`).

What makes it a *congested* store, `CongestionModel`:

- aggregate bandwidth shared by every connection: each response body takes its bytes from one
  token bucket (`TokenBucket`, FIFO reservations), so opening more connections does not buy more
  bandwidth than the link has;
- per-request latency before the first byte, log-normal around ``base_latency_s`` (shape
  ``jitter_sigma``);
- congestion episodes (`paragan_jax.storage.CongestionEpisodes`, seeded; or forced), kept by
  the `paragan_jax.storage.CongestionSwitch` the emulated store uses too
  (``ObjectServer.congestion``): while congested the latency is ``latency_factor`` times longer
  and only ``bandwidth_share`` of the aggregate bandwidth is left to this client (other tenants
  take the rest).

Every draw comes from ``numpy.random.default_rng([seed, request number])``. The server counts
requests, bytes, and the most requests in flight at once (`ObjectServer.counters`), and the
top-level entries requested (``top_dirs_requested``: which shards a client read).

`ServerProcess` runs an `ObjectServer` in a process of its own (a fresh interpreter running
`serve_child`), driven from the caller's: ``congestion`` and ``counters`` go through a socket.
``bench-pipeline --store http`` serves that way: the server's Python request handling (about
0.5 ms of CPU a request here) then holds none of the training process's interpreter lock, as a
remote store takes none of its host. Served from the training process, it made every step's host
side slower the more requests were in flight (measured 2026-11-30: the step's dispatch took 5 ms
with 5 fetch workers, 13-19 ms with 40).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np

from .storage import CongestionEpisodes, CongestionSwitch

__all__ = ["CongestionModel", "ObjectServer", "ServerProcess", "TokenBucket", "serve_child"]

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


@dataclasses.dataclass(frozen=True)
class CongestionModel:
    """How the loopback store serves: bandwidth, latency, jitter and congestion episodes."""

    bandwidth_bytes_per_s: float = 40e6
    """Aggregate bandwidth shared by all connections (token bucket), clean."""
    base_latency_s: float = 0.003
    """Median time to first byte of a request, clean."""
    jitter_sigma: float = 0.25
    """Log-normal shape of the per-request latency."""
    latency_factor: float = 5.0
    """Latency multiplier while congested."""
    bandwidth_share: float = 0.3
    """Fraction of the aggregate bandwidth left to this client while congested."""
    mean_clean_s: float = 0.3
    """Mean clean episode (seeded exponential durations)."""
    mean_congested_s: float = 3.0
    """Mean congested episode."""
    seed: int = 0
    """Seed of the latency draws and of the episodes."""

    def __post_init__(self):
        checks = [
            ("bandwidth_bytes_per_s", self.bandwidth_bytes_per_s > 0),
            ("base_latency_s", self.base_latency_s >= 0),
            ("jitter_sigma", self.jitter_sigma >= 0),
            ("latency_factor", self.latency_factor >= 1),
            ("bandwidth_share", 0 < self.bandwidth_share <= 1),
            ("mean_clean_s", self.mean_clean_s > 0),
            ("mean_congested_s", self.mean_congested_s > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise ValueError(f"CongestionModel.{name}={getattr(self, name)!r} is out of range")

    def episodes(self, horizon_s: float, seed: int | None = None) -> CongestionEpisodes:
        """Seeded congested intervals over ``[0, horizon_s)``."""
        return CongestionEpisodes.seeded(
            self.seed if seed is None else seed, horizon_s, self.mean_clean_s, self.mean_congested_s
        )


class TokenBucket:
    """Bytes per second shared by all callers: `take` reserves its bytes in arrival order and
    sleeps until the link has carried them (a burst of ``burst_bytes`` passes at once)."""

    def __init__(self, rate: float, burst_bytes: float = 16384.0):
        self.rate = rate
        self.burst = burst_bytes
        self._tokens = burst_bytes
        self._t = time.perf_counter()
        self._lock = threading.Lock()

    def take(self, nbytes: int, rate: float | None = None) -> float:
        """Reserves `nbytes` at `rate` (default: the bucket's); returns the seconds slept."""
        with self._lock:
            now = time.perf_counter()
            r = self.rate if rate is None else rate
            self._tokens = min(self.burst, self._tokens + (now - self._t) * r)
            self._t = now
            self._tokens -= nbytes
            wait = -self._tokens / r if self._tokens < 0 else 0.0
        if wait > 0:
            time.sleep(wait)
        return wait


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body go out at once (no delayed-ACK stall)
    server: _Server

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass  # one line per request would flood the output

    def _resolve(self) -> Path | None:
        rel = self.path.split("?", 1)[0].lstrip("/")
        path = (self.server.root / rel).resolve()
        if self.server.root not in path.parents and path != self.server.root:
            return None
        return path if path.is_file() else None

    def _serve(self, body: bool) -> None:
        owner = self.server.owner
        n, congested = owner.begin_request(self.path)
        try:
            path = self._resolve()
            owner.wait_first_byte(n, congested)
            if path is None:
                self.send_response(HTTPStatus.NOT_FOUND)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            size = path.stat().st_size
            start, end = 0, size - 1
            status = HTTPStatus.OK
            header = self.headers.get("Range")
            if header:
                m = _RANGE.match(header.strip())
                if m is None or (not m.group(1) and not m.group(2)):
                    self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if m.group(1):
                    start = int(m.group(1))
                    end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
                else:  # suffix range: the last N bytes
                    start = max(0, size - int(m.group(2)))
                status = HTTPStatus.PARTIAL_CONTENT
            if start > end:
                self.send_response(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            length = end - start + 1
            self.send_response(status)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(length))
            self.send_header("Accept-Ranges", "bytes")
            if status == HTTPStatus.PARTIAL_CONTENT:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if not body:
                return
            with open(path, "rb") as f:
                f.seek(start)
                data = f.read(length)
            owner.transfer(len(data), congested)
            self.wfile.write(data)
            owner.count_bytes(len(data))
        finally:
            owner.end_request()

    def do_GET(self):  # noqa: N802 - the stdlib's name
        self._serve(body=True)

    def do_HEAD(self):  # noqa: N802
        self._serve(body=False)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # many workers may connect at once

    def __init__(self, root: Path, owner: ObjectServer):
        self.root = root
        self.owner = owner
        super().__init__(("127.0.0.1", 0), _Handler)


class ObjectServer:
    """Serves `root` on ``http://127.0.0.1:<port>/`` from a background thread.

    Use as a context manager (``with ObjectServer(dir, model) as srv: srv.url``), or `start` /
    `close`. Episodes count from `start` (or ``congestion.restart``).

    Args:
      root: directory whose files are served (paths below it only).
      model: the congestion model (default `CongestionModel()`).
      episodes: congested intervals; None: the model's seeded episodes over an hour, or never
        congested when ``congested=False``.
      congested: False serves a clean store whatever the episodes.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        model: CongestionModel | None = None,
        episodes: CongestionEpisodes | None = None,
        congested: bool = True,
    ):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise FileNotFoundError(f"cannot serve {str(root)!r}: not a directory")
        self.model = model or CongestionModel()
        self.congestion = CongestionSwitch(
            episodes if episodes is not None else self.model.episodes(3600.0),
            forced=None if congested else False,
        )
        self.bucket = TokenBucket(self.model.bandwidth_bytes_per_s)
        self._lock = threading.Lock()
        self._requests = 0
        self._in_flight = 0
        self.counters = {"requests": 0, "bytes": 0, "max_in_flight": 0}
        self.top_dirs_requested: set[str] = set()  # first path component of every request
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>/`` (once started)."""
        if self._httpd is None:
            raise RuntimeError("the server is not started")
        return f"http://127.0.0.1:{self._httpd.server_address[1]}/"

    def start(self) -> ObjectServer:
        self._httpd = _Server(self.root, self)
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        self.congestion.restart()
        return self

    def close(self) -> None:
        """Stops serving and closes the listening socket (idempotent)."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join(timeout=5)
            self._httpd = None

    def __enter__(self) -> ObjectServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- per request (called from handler threads) ------------------------------------------
    def begin_request(self, path: str = "/") -> tuple[int, bool]:
        with self._lock:
            self.top_dirs_requested.add(path.lstrip("/").split("/", 1)[0])
            n = self._requests
            self._requests += 1
            self._in_flight += 1
            self.counters["requests"] = self._requests
            self.counters["max_in_flight"] = max(self.counters["max_in_flight"], self._in_flight)
        return n, self.congestion.congested_now()

    def end_request(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def count_bytes(self, nbytes: int) -> None:
        with self._lock:
            self.counters["bytes"] += nbytes

    def first_byte_delay(self, n: int, congested: bool) -> float:
        """Seconds before request `n` answers (deterministic in its arguments)."""
        m = self.model
        z = np.random.default_rng([m.seed, n]).standard_normal()
        delay = m.base_latency_s * math.exp(m.jitter_sigma * z)
        return delay * (m.latency_factor if congested else 1.0)

    def wait_first_byte(self, n: int, congested: bool) -> None:
        delay = self.first_byte_delay(n, congested)
        if delay > 0:
            time.sleep(delay)

    def transfer(self, nbytes: int, congested: bool) -> None:
        """Spends the link time of `nbytes` from the shared bucket."""
        m = self.model
        rate = m.bandwidth_bytes_per_s * (m.bandwidth_share if congested else 1.0)
        self.bucket.take(nbytes, rate)


def serve_child(fd: int) -> None:
    """The body of a `ServerProcess`'s child: reads ``(root, model, congested)`` from the
    connection on socket `fd`, serves `root` and answers ``(operation, *args)`` messages with
    ``(ok, value)`` until ``close`` (or until the parent is gone)."""
    conn = Connection(fd)
    try:
        root, model, congested = conn.recv()
        _serve(root, model, congested, conn)
    except EOFError:
        pass  # the parent closed the connection or exited


def _serve(root: str, model: CongestionModel | None, congested: bool, conn: Connection) -> None:
    with ObjectServer(root, model, congested=congested) as srv:
        handlers: dict[str, Callable] = {
            "url": lambda: srv.url,
            "counters": lambda: dict(srv.counters),
            "restart": srv.congestion.restart,
            "set_congestion": srv.congestion.set_congestion,
            "congested_now": srv.congestion.congested_now,
        }
        while True:
            op, *args = conn.recv()
            if op == "close":
                conn.send((True, None))
                return
            try:
                conn.send((True, handlers[op](*args)))
            except Exception as e:  # answered, not fatal: the caller raises it
                conn.send((False, f"{type(e).__name__}: {e}"))


class _RemoteSwitch:
    """The `paragan_jax.storage.CongestionSwitch` of a `ServerProcess`'s server, driven from
    the caller's process (same methods)."""

    def __init__(self, call: Callable):
        self._call = call

    def restart(self, episodes: CongestionEpisodes | None = None) -> None:
        self._call("restart", episodes)

    def set_congestion(self, congested: bool | None) -> None:
        self._call("set_congestion", congested)

    def congested_now(self) -> bool:
        return self._call("congested_now")


class ServerProcess:
    """An `ObjectServer` of `root` in a process of its own (started here; `close` it, or use
    it as a context manager). ``url``, ``congestion`` (restart, set_congestion, congested_now)
    and ``counters`` reach the server in that process. Each exchange with that process waits
    at most `timeout_s` seconds for its answer; past that the process is killed and the call
    raises (so a stuck child cannot hang the caller).

    Raises:
      FileNotFoundError: `root` is not a directory.
      RuntimeError: the process died or did not answer within `timeout_s` while starting (it is
        killed and waited before this raises).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        model: CongestionModel | None = None,
        congested: bool = True,
        timeout_s: float = 60.0,
    ):
        if not Path(root).is_dir():
            raise FileNotFoundError(f"cannot serve {str(root)!r}: not a directory")
        self.timeout_s = timeout_s
        # A fresh interpreter (not a fork: the caller has threads; not multiprocessing's spawn,
        # which re-imports the caller's main script), talking over a socket pair.
        mine, theirs = socket.socketpair()
        code = "import sys, paragan_jax.http_store as h; h.serve_child(int(sys.argv[1]))"
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", code, str(theirs.fileno())], pass_fds=(theirs.fileno(),)
            )
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(mine.detach())
        self._lock = threading.Lock()
        self.congestion = _RemoteSwitch(self._call)
        try:
            try:
                self._conn.send((str(Path(root).resolve()), model, congested))
            except OSError as e:
                raise self._gone(e) from e
            self.url: str = self._call("url")
        except BaseException:
            self._kill()
            raise

    def _kill(self) -> None:
        """Closes the connection, kills the process and waits for it."""
        self._conn.close()
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()

    def _gone(self, e: BaseException) -> RuntimeError:
        code = self._process.poll()
        return RuntimeError(f"the object server process is gone (exit {code}): {e!r}")

    def _call(self, op: str, *args):
        with self._lock:
            if self._conn.closed:
                raise RuntimeError("the server process is closed")
            try:
                self._conn.send((op, *args))
                if not self._conn.poll(self.timeout_s):
                    self._kill()
                    raise RuntimeError(
                        f"the object server process did not answer {op!r} within "
                        f"{self.timeout_s} s; killed it"
                    )
                ok, value = self._conn.recv()
            except (EOFError, OSError) as e:
                raise self._gone(e) from e
        if not ok:
            raise RuntimeError(f"object server {op}: {value}")
        return value

    @property
    def counters(self) -> dict[str, int]:
        """The server's request, byte and in-flight counters (`ObjectServer.counters`)."""
        return self._call("counters")

    def close(self) -> None:
        """Stops the server and its process (idempotent)."""
        if not self._conn.closed:
            try:
                self._call("close")
            except RuntimeError:
                pass  # the process is gone already, or was killed for not answering
            self._conn.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
