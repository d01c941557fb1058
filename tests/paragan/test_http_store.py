"""The loopback object server: HTTP ranges, one bandwidth shared by all connections, congestion."""

import http.client
import threading
import time

import numpy as np
import pytest

from paragan_jax.http_store import CongestionModel, ObjectServer, ServerProcess, TokenBucket
from paragan_jax.storage import CongestionEpisodes


def _get(srv, path, headers=None, method="GET"):
    host, port = srv.url.split("//")[1].rstrip("/").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request(method, path, headers=headers or {})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), body


def test_ranges_and_errors(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "blob").write_bytes(data)
    (tmp_path / "secret").write_bytes(b"outside")
    fast = CongestionModel(base_latency_s=0.0, bandwidth_bytes_per_s=1e9)
    with ObjectServer(tmp_path / "d", fast, congested=False) as srv:
        assert _get(srv, "/blob")[2] == data
        status, headers, body = _get(srv, "/blob", {"Range": "bytes=10-19"})
        assert (status, body, headers["Content-Range"]) == (206, data[10:20], "bytes 10-19/1024")
        assert _get(srv, "/blob", {"Range": "bytes=-4"})[2] == data[-4:]
        assert _get(srv, "/blob", {"Range": "bytes=1000-"})[2] == data[1000:]
        assert _get(srv, "/blob", {"Range": "bytes=2000-"})[0] == 416
        assert _get(srv, "/blob", method="HEAD")[1]["Content-Length"] == "1024"
        assert _get(srv, "/nothing")[0] == 404
        assert _get(srv, "/../secret")[0] == 404  # nothing outside the root is served
        assert srv.counters["requests"] == 8 and srv.top_dirs_requested >= {"blob", "nothing"}
    with pytest.raises(FileNotFoundError):
        ObjectServer(tmp_path / "absent")


def _download(srv, threads, repeats):
    def work():
        for _ in range(repeats):
            _get(srv, "/blob")

    pool = [threading.Thread(target=work) for _ in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - t0


def test_connections_share_one_bandwidth_and_congestion_takes_a_share(tmp_path):
    (tmp_path / "blob").write_bytes(b"x" * 50_000)
    model = CongestionModel(base_latency_s=0.0, bandwidth_bytes_per_s=5e6, bandwidth_share=0.5)
    with ObjectServer(tmp_path, model, congested=False) as srv:
        one = _download(srv, 1, 16)  # 0.8 MB at 5 MB/s: >= 0.16 s
        eight = _download(srv, 8, 2)  # the same bytes over 8 connections: no faster in total
        srv.congestion.set_congestion(True)
        congested = _download(srv, 8, 2)  # half the bandwidth left: >= 0.32 s
    assert one >= 0.14 and eight >= 0.14 and congested >= 0.28, (one, eight, congested)


def test_latency_jitter_and_episodes_are_seeded():
    model = CongestionModel(base_latency_s=0.01, jitter_sigma=0.5, latency_factor=4.0, seed=3)
    srv = ObjectServer(".", model)
    draws = [srv.first_byte_delay(n, False) for n in range(200)]
    assert draws == [ObjectServer(".", model).first_byte_delay(n, False) for n in range(200)]
    assert np.median(draws) == pytest.approx(0.01, rel=0.2) and np.std(np.log(draws)) > 0.3
    assert srv.first_byte_delay(7, True) == pytest.approx(4 * srv.first_byte_delay(7, False))
    srv.congestion.restart(CongestionEpisodes(((0.0, 3600.0),)))
    assert srv.congestion.congested_now()
    srv.congestion.set_congestion(False)
    assert not srv.congestion.congested_now()
    with pytest.raises(ValueError, match="bandwidth_share"):
        CongestionModel(bandwidth_share=0.0)


def test_token_bucket_reserves_in_arrival_order():
    bucket = TokenBucket(rate=1e6, burst_bytes=1000)
    waits = [bucket.take(10_000) for _ in range(3)]  # 10 ms of link time each
    assert waits[0] == pytest.approx(0.009, abs=0.003)
    assert sum(waits) >= 0.027 - 1e-12  # 9 ms each at least (the float sum may round below)


def test_a_server_in_its_own_process_serves_and_is_driven_from_here(tmp_path):
    data = bytes(range(256)) * 4
    (tmp_path / "blob").write_bytes(data)
    fast = CongestionModel(base_latency_s=0.0, bandwidth_bytes_per_s=1e9)
    with ServerProcess(tmp_path, fast, congested=False) as srv:
        assert srv.url.startswith("http://127.0.0.1:")
        assert _get(srv, "/blob")[2] == data and _get(srv, "/absent")[0] == 404
        deadline = time.monotonic() + 5  # the server counts a body's bytes after sending it
        while srv.counters["bytes"] < 1024 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert srv.counters["requests"] == 2 and srv.counters["bytes"] == 1024
        assert not srv.congestion.congested_now()
        srv.congestion.set_congestion(True)  # reaches the server in the other process
        assert srv.congestion.congested_now()
        srv.congestion.set_congestion(None)
        srv.congestion.restart(CongestionEpisodes(((0.0, 3600.0),)))
        assert srv.congestion.congested_now()
        srv.congestion.restart(((0.0, 1.0),))  # not CongestionEpisodes: fails when read there
        with pytest.raises(RuntimeError, match="congested_now: AttributeError"):
            srv.congestion.congested_now()
    srv.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        srv.congestion.congested_now()
    with pytest.raises(FileNotFoundError):
        ServerProcess(tmp_path / "absent")


def _started(monkeypatch):
    """Records the processes `ServerProcess` starts."""
    import subprocess

    started = []
    real = subprocess.Popen

    def popen(*args, **kwargs):
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(subprocess, "Popen", popen)
    return started


def test_a_server_process_that_dies_while_starting_is_waited(tmp_path, monkeypatch):
    started = _started(monkeypatch)
    monkeypatch.setattr("sys.executable", "/bin/false")  # exits at once, never answers
    with pytest.raises(RuntimeError, match="gone"):
        ServerProcess(tmp_path)
    assert len(started) == 1 and started[0].returncode == 1  # waited (reaped)


def test_a_server_process_that_does_not_answer_is_killed(tmp_path, monkeypatch):
    started = _started(monkeypatch)
    stuck = tmp_path / "stuck"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    monkeypatch.setattr("sys.executable", str(stuck))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer 'url' within 0.5 s"):
        ServerProcess(tmp_path, timeout_s=0.5)
    assert time.monotonic() - t0 < 10
    assert len(started) == 1 and started[0].returncode is not None  # killed and waited
