"""Issue 18's and issue 27's attacks against a real `snca-serve`, each with the status and time
it now gets (docs/RELIABILITY.md, "Attacks"). Prints a markdown table.

    python benchmarks/attacks.py runs/demo          # make run's model; ~2 minutes

The server runs as the Docker image runs it, bound to 0.0.0.0 (the allowed Host names are then
loopback's and this host's own), with SNCA_MAX_CONNECTIONS=100 (to show the cap without opening
1,000 sockets) and SNCA_HEADER_TIMEOUT_S=10 / SNCA_BODY_TIMEOUT_S=60 (the defaults); a temporary
data dir. The attacks of issue 27 that need several processes, a PostgreSQL store or a rolling
upgrade are regression tests (tests/service/store/test_migration.py, test_replicas.py,
test_exposure.py, test_gallery_tool.py), whose figures RELIABILITY.md quotes.
"""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.service.helpers import free_port, run_beside


def wait_ready(url: str, proc, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


ROWS: list[tuple[str, str, str]] = []


def row(attack: str, got: str, seconds: float) -> None:
    ROWS.append((attack, got, f"{seconds:.2f}"))
    print(f"{attack}: {got} ({seconds:.2f} s)", file=sys.stderr, flush=True)


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) / 1024 for x in f if x.startswith("VmRSS"))


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def code(r: httpx.Response) -> str:
    try:
        return f"{r.status_code} {r.json().get('code', '')}".strip()
    except ValueError:
        return str(r.status_code)


def raw(port: int, data: bytes) -> tuple[bytes, float]:
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out, time.perf_counter() - t0


FUTURE = "999999999999999998"  # a version no store has reached


def _classify_for(c: httpx.Client, tee: bytes, seconds: float) -> int:
    """Classifications completed back to back in `seconds`."""
    n, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        assert c.post("/classify", files={"image": ("q.png", tee)}).status_code == 200
        n += 1
    return n


def _flood(port: int, head: bytes, rate: float, stop: threading.Event) -> list[int]:
    """Send-and-close requests at about `rate` per second until `stop`; how many were sent."""
    sent = [0]

    def run():
        gap = 1 / rate
        nxt = time.monotonic()
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                    s.sendall(head)
                sent[0] += 1
            except OSError:
                pass
            nxt += gap
            time.sleep(max(0.0, nxt - time.monotonic()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return sent


def round_three(c: httpx.Client, port: int, tee: bytes) -> None:
    """Issue 27's attacks on one server (numbers in the R3 rows)."""
    base = _classify_for(c, tee, 6.0)
    for route in ("/healthz", "/gallery/labels"):
        stop = threading.Event()
        head = f"GET {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Min-Gallery-Version: {FUTURE}\r\n\r\n"
        sent = _flood(port, head.encode(), 450, stop)
        got = _classify_for(c, tee, 6.0)
        stop.set()
        row(
            f"R3 2. send-and-close {route} with X-Min-Gallery-Version {FUTURE}, ~450/s for 6 s",
            f"{got} classifications completed meanwhile (without the flood: {base}); "
            f"{sent[0]} sent",
            6.0,
        )
    for route in ("/healthz", "/readyz", "/metrics", "/gallery/labels"):
        r, dt = timed(lambda route=route: c.get(route, headers={"X-Min-Gallery-Version": FUTURE}))
        row(
            f"R3 2/12. {route} with X-Min-Gallery-Version {FUTURE}",
            f"{code(r)} ({r.headers.get('content-type', '').split(';')[0]})",
            dt,
        )
    # 3. 48 parallel label diagnostics + one add a second; the loop's liveness meanwhile
    statuses: list[int] = []
    slow = {"/healthz": 0.0, "/search": 0.0}
    stop = threading.Event()

    def diag():
        with httpx.Client(base_url=c.base_url, timeout=300) as cc:
            statuses.append(cc.get("/gallery/diagnostics", params={"label": "Trouser"}).status_code)

    def probe(route):
        with httpx.Client(base_url=c.base_url, timeout=300) as cc:
            while not stop.is_set():
                t0 = time.monotonic()
                if route == "/search":
                    cc.post(route, files={"image": ("q.png", tee)})
                else:
                    cc.get(route)
                slow[route] = max(slow[route], time.monotonic() - t0)
                time.sleep(0.05)

    def adds():
        with httpx.Client(base_url=c.base_url, timeout=300) as cc:
            while not stop.is_set():
                cc.post("/gallery/add", data={"label": "Trouser"}, files={"images": ("a.png", tee)})
                time.sleep(1.0)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=diag) for _ in range(48)]
    side = [threading.Thread(target=probe, args=(r,)) for r in slow] + [
        threading.Thread(target=adds)
    ]
    run_beside(ts, side, stop)
    row(
        "R3 3. 48 parallel GET /gallery/diagnostics + 1 add/s",
        f"{statuses.count(200)} × 200, {statuses.count(429)} × 429 too_busy; slowest "
        f"/healthz {slow['/healthz']:.2f} s, /search {slow['/search']:.2f} s",
        time.perf_counter() - t0,
    )
    r, dt = timed(
        lambda: c.post(
            "/gallery/add",
            data={"label": "x"},
            files={"images": ("a.png", tee)},
            headers={"Host": "evil.example", "Origin": "http://evil.example"},
        )
    )
    row("R3 4. DNS rebinding add, server bound to 0.0.0.0 (the Docker image)", code(r), dt)


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("run", nargs="?", type=Path, default=Path("runs/demo"), help="a run dir")
    run = ap.parse_args().run
    tmp = Path(tempfile.mkdtemp(prefix="snca-attacks-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, SNCA_MAX_CONNECTIONS="100", SNCA_THUMBNAILS="true", SNCA_HOST="0.0.0.0")
    log = open(tmp / "server.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
            "--model",
            str(run),
            "--data-dir",
            str(tmp / "data"),
            "--port",
            str(port),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        wait_ready(url, proc, 300)
        c = httpx.Client(base_url=url, timeout=120)
        tee = (
            (run / "examples" / "t-shirt-top.png").read_bytes()
            if (run / "examples" / "t-shirt-top.png").exists()
            else None
        )
        if tee is None:
            b = io.BytesIO()
            Image.new("L", (28, 28), 128).save(b, "PNG")
            tee = b.getvalue()

        # 1. memory: 32 x 6000x6000 PNG in one request; then two (within the budget)
        b = io.BytesIO()
        Image.new("RGB", (6000, 6000)).save(b, "PNG")
        big = [("images", (f"{i}.png", b.getvalue(), "image/png")) for i in range(32)]
        before = rss_mb(proc.pid)
        r, dt = timed(lambda: c.post("/classify/batch", files=big))
        row(
            "1. 32 × 6000×6000 PNG, one /classify/batch",
            f"{code(r)}, RSS {rss_mb(proc.pid) - before:+.0f} MB",
            dt,
        )
        r, dt = timed(lambda: c.post("/classify/batch", files=big[:2]))
        row(
            "1. 2 × 6000×6000 PNG (72 M pixels, within budget)",
            f"{code(r)}, RSS after {rss_mb(proc.pid) - before:+.0f} MB",
            dt,
        )

        # 2, 3. metadata
        for name, md in (
            ("2. metadata nested 256 deep", '{"a": ' + "[" * 255 + "]" * 255 + "}"),
            ("3. metadata of 10,000 `[`", "[" * 10000),
            ("3. metadata with a 5,000-digit integer", '{"n": ' + "9" * 5000 + "}"),
            ("3. metadata with NaN", '{"x": NaN}'),
            ("3. metadata with 1e999", '{"x": 1e999}'),
        ):
            files = {"images": ("a.png", tee, "image/png")}
            r, dt = timed(
                lambda md=md, files=files: c.post(
                    "/gallery/add", data={"label": "md", "metadata": md}, files=files
                )
            )
            row(name, code(r), dt)

        # 4. snapshots in parallel
        out: list = []

        def snap():
            out.append(c.post("/admin/snapshot").status_code)

        t0 = time.perf_counter()
        ts = [threading.Thread(target=snap) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        left = [n for n in os.listdir(tmp / "data") if ".tmp-" in n or ".old-" in n]
        row(
            "4. 8 parallel POST /admin/snapshot",
            f"{sorted(out)} , {len(left)} leftovers",
            time.perf_counter() - t0,
        )

        # 6. slow clients
        got, dt = raw(port, b"POST /classify HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        row("6. half-sent headers", got.split(b"\r\n")[0].decode() + ", closed", dt)
        got, dt = raw(
            port,
            b"POST /classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n"
            b"Content-Type: multipart/form-data; boundary=x\r\n\r\n--x\r\n",
        )
        row("6. half-sent body", got.split(b"\r\n")[0].decode() + ", closed", dt)
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        got, dt = raw(port, b"")
        for s in socks:
            s.close()
        row("6. connection 101 (SNCA_MAX_CONNECTIONS=100)", got.split(b"\r\n")[0].decode(), dt)

        # 7. status codes
        for path in ("/gallery/add", "/search"):
            r, dt = timed(
                lambda path=path: c.post(
                    path,
                    content=(b"a" * 65536 for _ in range(176)),
                    headers={"Content-Type": "multipart/form-data; boundary=x"},
                )
            )
            row(f"7. 11 MiB chunked body to {path}", code(r), dt)
        files = [("images", ("a.png", b"x", "image/png"))] * 1001
        r, dt = timed(lambda: c.post("/gallery/add", data={"label": "x"}, files=files))
        row("7. 1,001 files to /gallery/add", code(r), dt)

        # 8. thumbnails
        item = c.post("/gallery/add", data={"label": "t"}, files={"images": ("a.png", tee)}).json()[
            "ids"
        ][0]
        r, dt = timed(lambda: c.get(f"/gallery/items/{item}/thumbnail"))
        row(
            "8. thumbnail Cache-Control",
            r.headers.get("cache-control", "?") + ", Vary: " + r.headers.get("vary", "-"),
            dt,
        )

        # 10. browser side
        r, dt = timed(
            lambda: c.post(
                "/gallery/add",
                data={"label": "csrf"},
                files={"images": ("a.png", tee)},
                headers={"Origin": "http://evil.example"},
            )
        )
        row("10. cross-origin form POST to /gallery/add (no key)", code(r), dt)
        r, dt = timed(lambda: c.get("/gallery/labels", headers={"Host": "evil.example"}))
        row("10. DNS rebinding (Host: evil.example)", code(r), dt)
        r, dt = timed(lambda: c.get("/"))
        row(
            "10. page headers",
            "CSP, X-Frame-Options "
            + r.headers.get("x-frame-options", "-")
            + ", nosniff" * ("nosniff" in r.headers.get("x-content-type-options", "")),
            dt,
        )

        # 11. Unicode
        r1 = c.post("/gallery/add", data={"label": "cafe\u0301"}, files={"images": ("a.png", tee)})
        r2, dt = timed(
            lambda: c.post(
                "/gallery/add", data={"label": "caf\u00e9"}, files={"images": ("a.png", tee)}
            )
        )
        row(
            '11. NFD then NFC "é"',
            f"{r1.status_code}, {r2.status_code}: one label of {r2.json()['count']}",
            dt,
        )
        body = (
            b'--x\r\nContent-Disposition: form-data; name="label"\r\n\r\ncaf\xe9\r\n--x\r\n'
            b'Content-Disposition: form-data; name="images"; filename="a.png"\r\n\r\n'
            + tee
            + b"\r\n--x--\r\n"
        )
        r, dt = timed(
            lambda: c.post(
                "/gallery/add",
                content=body,
                headers={"Content-Type": "multipart/form-data; boundary=x"},
            )
        )
        row("11. label in invalid UTF-8", code(r), dt)

        # 12. offline page
        r, dt = timed(lambda: c.get("/docs-assets/swagger-ui-bundle.js"))
        row("12. /docs assets served locally", str(r.status_code), dt)
        r, dt = timed(lambda: c.get("/favicon.ico"))
        row("12. /favicon.ico", str(r.status_code), dt)
        r, dt = timed(lambda: c.post("/classify", params={"kk": 5}, files={"image": ("q", tee)}))
        row("contract: unknown query parameter kk=5", code(r), dt)
        round_three(c, port, tee)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()
    print("| attack | now | seconds |\n| --- | --- | --- |")
    for a, g, s in ROWS:
        print(f"| {a} | {g} | {s} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
