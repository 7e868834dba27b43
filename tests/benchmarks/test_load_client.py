"""The benchmark's open-loop load generator, against a real uvicorn process with a tiny ASGI
app: it must send at the offered rate, count latency from the scheduled send time, count
non-200 answers as errors, read the server's own time from its header, survive connections
the server closes, and stop with a clear error when the server falls so far behind that
select() would run out of descriptors."""

import subprocess
import sys
import time

import httpx
import pytest

from benchmarks.service_load import open_loop, request_bytes
from tests.service.helpers import free_port

APP = """
import asyncio

async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]
    if path == "/slow":
        await asyncio.sleep(0.02)
    if path == "/stall":
        await asyncio.sleep(5)
    status = 503 if path == "/fail" else 200
    headers = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    if path == "/close":
        headers.append((b"connection", b"close"))
    if path == "/timed":
        headers.append((b"x-process-time-ms", b"7.25"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"{}"})
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("app")
    (d / "tinyapp.py").write_text(APP)
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "--app-dir", str(d), "tinyapp:app", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.1)
    yield port
    p.terminate()
    p.wait(timeout=30)


def run(port: int, path: str, rate: float = 200.0, secs: float = 0.5) -> dict:
    return open_loop(("127.0.0.1", port, request_bytes("127.0.0.1", port, b"x", path), rate, secs))


def test_sends_at_the_offered_rate(server):
    r = run(server, "/ok")
    assert r["requests"] == 100 and r["errors"] == 0
    assert 150 < r["rps"] < 250, r
    assert r["p50_ms"] < 20, r


def test_latency_counts_from_the_scheduled_send(server):
    r = run(server, "/slow")
    assert r["errors"] == 0
    assert r["p50_ms"] >= 20, r


def test_the_servers_own_time_is_read_from_its_header(server):
    assert run(server, "/ok")["server_p50_ms"] is None  # no header: nothing to report
    r = run(server, "/timed")
    assert r["server_p50_ms"] == r["server_p99_ms"] == 7.25, r


def test_non_200_answers_are_errors(server):
    r = run(server, "/fail")
    assert r["requests"] == 100 and r["errors"] == 100


def test_connections_the_server_closes_are_replaced(server):
    r = run(server, "/close")
    assert r["requests"] == 100 and r["errors"] == 0, r


def test_a_server_far_behind_stops_the_client_with_a_clear_error(server):
    # 50,000/s against answers that take 5 s: dozens of sends per loop turn. When the check
    # came once per turn, the client passed 1,024 sockets first and died of "too many open
    # files" or select()'s "filedescriptor out of range".
    with pytest.raises(RuntimeError, match="not keeping up"):
        run(server, "/stall", rate=50000.0, secs=0.1)
