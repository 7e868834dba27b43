"""Load test of POST /classify against a real snca-serve process, next to the bare limit.

    python benchmarks/service_load.py --prepare            # tiny conv4 and resnet18 runs + indexes
    python benchmarks/service_load.py                      # both models, batching on and off
    python benchmarks/service_load.py --models conv4 --max-batches 1,2,4,64 --rates 700
    python benchmarks/service_load.py --prepare --models resnet50-224 --query photo \
        --levels 1,2,4,8,16 --max-batches 16 --seconds 20      # photos at 224 px (ResNet-50)

For each model and batching setting: a fresh `python -m service` process on loopback; a load
generator in a separate process (asyncio, keep-alive connections, pre-built multipart requests
of a 28x28 Fashion-MNIST PNG) sends /classify at rising concurrency for a fixed time per level;
throughput (classified images/s), p50 and p99 latency per level. In the same run, the bare
in-process limit: the same model's batched forward + the same gallery's classification (the
service's own code, no HTTP, no decoding) at batch 64. Reports service/bare at saturation and
p99 at half the saturating rate against the single-request latency.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {"conv4": ROOT / "runs" / "bench-conv4", "resnet18": ROOT / "runs" / "bench-resnet18"}
# Colour photographs at 224 px (issue 30): a ResNet-50 trained one epoch on crops of
# scikit-image's photographs; its query (--query photo) is a 640x480 JPEG photo.
PHOTO_RUNS = {"resnet50-224": ROOT / "runs" / "bench-resnet50-224"}


def photo_folder(root: Path, per_class: int = 16) -> Path:
    """root/<photo>/<i>.jpg: square crops of five of scikit-image's photographs, 256-480 px."""
    import skimage.data
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("chelsea", "coffee", "rocket", "astronaut", "hubble_deep_field"):
        im = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        (root / name).mkdir(parents=True, exist_ok=True)
        w, h = im.size
        for i in range(per_class):
            s = int(min(w, h) * rng.uniform(0.5, 1.0))
            x, y = int(rng.integers(0, w - s + 1)), int(rng.integers(0, h - s + 1))
            side = int(rng.integers(256, 480))
            crop = im.crop((x, y, x + s, y + s)).resize((side, side))
            crop.save(root / name / f"{i}.jpg", quality=90)
    return root


def query_photo(size: tuple[int, int] = (640, 480)) -> bytes:
    """A JPEG photograph (scikit-image's astronaut) at `size`, the photo models' query."""
    import skimage.data
    from PIL import Image

    b = io.BytesIO()
    Image.fromarray(skimage.data.astronaut()).resize(size).save(b, "JPEG", quality=90)
    return b.getvalue()


def prepare(names: list[str]) -> None:
    """Tiny training runs (1 epoch) of the bench models `names` with their exact indexes:
    throughput does not need accuracy."""
    photos = ROOT / "runs" / "bench-photos"
    extra = {
        "resnet50-224": ["--dataset", "imagefolder", "--data-dir", str(photos), "--image-size",
                         "224", "--batch-size", "16"],
    }  # fmt: skip
    for arch, out in {**RUNS, **PHOTO_RUNS}.items():
        if arch not in names:
            continue
        if arch in extra and not photos.is_dir():
            photo_folder(photos)
        args = extra.get(arch, ["--subset", "6000"])
        if not (out / "index" / "manifest.json").is_file():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "training",
                    "--arch",
                    arch.split("-")[0],
                    *args,
                    "--val-size",
                    "0",
                    "--epochs",
                    "1",
                    "--out",
                    str(out),
                    "--overwrite",
                    "--no-progress",
                ],
                check=True,
            )
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "index_builder",
                    str(out),
                    "--out",
                    str(out / "index"),
                    "--overwrite",
                    "--no-progress",
                ],
                check=True,
            )


def request_bytes(host: str, port: int, png: bytes, path: str = "/classify") -> bytes:
    boundary = "snca-bench-boundary"
    body = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="image"; filename="q.png"\r\n'
            f"Content-Type: image/png\r\n\r\n"
        ).encode()
        + png
        + f"\r\n--{boundary}--\r\n".encode()
    )
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: multipart/form-data; "
        f"boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    return head + body


async def _worker(host, port, req, stop_at, lat, errors):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status = await _exchange(reader, writer, req)
            if b" 200 " not in status:
                errors.append(status)
            lat.append(time.perf_counter() - t0)
    finally:
        writer.close()


async def _exchange(reader, writer, req) -> bytes:
    writer.write(req)
    await writer.drain()
    status = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    await reader.readexactly(length)
    return status


MAX_CONNECTIONS = 900  # the open-loop client's sockets, under select()'s 1,024 descriptors


def open_loop(args) -> dict:
    """Runs in a separate process: requests at a fixed rate (not paced by the answers, so a
    slow server cannot slow the arrivals), each on a free keep-alive connection (a new one
    when all are busy). Latency counts from the scheduled send time, so the client's own
    lateness is in it; `client_late_p99_ms` records that lateness.

    One thread, non-blocking sockets and select() with a microsecond timeout to the next send:
    the asyncio version with a pacing thread (the loop's timers round up to whole
    milliseconds) was itself 1.5-2.6 ms late at the p99 at ~900/s and put a p99 of 1.9 ms on a
    server that answers in 0.1 ms, on the same 2 cores as the server. The first second
    (connections being opened) is a warm-up and not counted; the client's garbage collector
    is off meanwhile (its pauses are not the server's latency)."""
    import gc
    import select
    import socket

    host, port, req, rate, secs = args
    warm = int(rate)  # requests in the first second
    n = warm + int(rate * secs)
    idle: list[socket.socket] = []
    # socket -> [scheduled send time, counted (after the warm-up), bytes read, a retry]
    busy: dict[socket.socket, list] = {}
    lat, errors, late = [], [], []
    server: list[float] = []  # the server's own time (its x-process-time-ms header), ms

    def connect() -> socket.socket:
        # select() takes file descriptors below 1,024 only: stop with a clear error first
        if len(busy) + len(idle) >= MAX_CONNECTIONS:
            raise RuntimeError(
                f"{MAX_CONNECTIONS} connections open: the server is not keeping up "
                f"with {rate:.0f}/s"
            )
        s = socket.create_connection((host, port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        return s

    def alive(s: socket.socket) -> bool:
        """False when the server has closed this idle connection (its keep-alive timeout)."""
        try:
            return s.recv(1, socket.MSG_PEEK) != b""
        except BlockingIOError:
            return True  # nothing to read: still open
        except OSError:
            return False

    def send(t_sched: float, counted: bool, retried: bool = False) -> None:
        while True:
            s = idle.pop() if idle else connect()
            if not alive(s):
                s.close()
                continue
            try:
                s.setblocking(True)  # a ~1 KB request: one send on loopback
                s.sendall(req)
                s.setblocking(False)
                break
            except OSError:
                s.close()
        busy[s] = [t_sched, counted, b"", retried]

    def receive(s: socket.socket, now: float) -> None:
        st = busy[s]
        try:
            chunk = s.recv(65536)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # closed before a whole answer
            del busy[s]
            s.close()
            if not st[2] and not st[3]:  # closed as it was reused: once more on a fresh one
                send(st[0], st[1], retried=True)
            elif st[1]:
                errors.append(b"connection closed")
                lat.append(now - st[0])
            return
        st[2] += chunk
        head_end = st[2].find(b"\r\n\r\n")
        if head_end < 0:
            return
        m = re.search(rb"content-length:\s*(\d+)", st[2][:head_end].lower())
        length = int(m.group(1)) if m else 0
        if len(st[2]) < head_end + 4 + length:
            return
        del busy[s]
        idle.append(s)
        if st[1]:
            lat.append(now - st[0])
            t = re.search(rb"x-process-time-ms:\s*([0-9.]+)", st[2][:head_end].lower())
            if t:
                server.append(float(t.group(1)))
            if b" 200 " not in st[2][: st[2].find(b"\r\n")]:
                errors.append(st[2][:40])

    gc.collect()
    gc.disable()
    cpu0 = os.times()
    try:
        idle.extend(connect() for _ in range(8))
        t0 = time.perf_counter() + 0.05
        i = 0
        give_up = t0 + n / rate + 30.0  # answers still missing by then count as errors
        while (i < n or busy) and time.perf_counter() < give_up:
            now = time.perf_counter()
            while i < n and t0 + i / rate <= now:
                t_i = t0 + i / rate
                if i >= warm:
                    late.append(now - t_i)
                send(t_i, i >= warm)
                i += 1
                now = time.perf_counter()
            timeout = max(0.0, t0 + i / rate - now) if i < n else 1.0
            ready, _, _ = select.select(list(busy), [], [], timeout)
            now = time.perf_counter()
            for s in ready:
                receive(s, now)
        wall = time.perf_counter() - t0 - warm / rate
        for st in busy.values():
            if st[1]:
                errors.append(b"no answer within 30 s")
                lat.append(give_up - st[0])
    finally:
        gc.enable()
        for s in [*idle, *busy]:
            s.close()
    # how late the client itself started requests (counted in the latencies)
    late_p99 = float(np.percentile(np.array(late) * 1000, 99))
    stats = _stats(lat, errors, wall)
    return {
        "offered_rps": rate,
        **stats,
        "client_late_p99_ms": late_p99,
        # from the middleware's start to the response's start: the rest of a latency is
        # waiting to be read (a busy event loop) and the client's own lateness
        "server_p50_ms": float(np.percentile(server, 50)) if server else None,
        "server_p99_ms": float(np.percentile(server, 99)) if server else None,
        "client_cpu_us": _cpu_since(cpu0, stats["requests"]),
    }


def _cpu_since(t0: os.times_result, requests: int) -> float:
    """This process's CPU (user + system) since `t0`, in us per request."""
    t = os.times()
    return ((t.user - t0.user) + (t.system - t0.system)) / max(requests, 1) * 1e6


def children(pid: int) -> list[int]:
    """The processes `pid` started (a worker's model process), from /proc; [] elsewhere."""
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                out += [
                    int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
                ]
    except OSError:
        pass
    return out


def _thread_cpu(pid: int, out: dict, main_key: str, other_key: str) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
        key = main_key if int(tid) == pid else other_key
        out[key] = out.get(key, 0.0) + cpu


def server_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of the server's event-loop thread (the main thread), of all its
    other threads (the model thread, the decode thread pool) and of its model process (all
    its threads; absent with --no-model-process), from /proc; {} elsewhere."""
    out = {"event_loop": 0.0, "other_threads": 0.0}
    try:
        _thread_cpu(pid, out, "event_loop", "other_threads")
        for child in children(pid):
            _thread_cpu(child, out, "model_process", "model_process")
    except (OSError, ValueError):
        return {}
    return out


def _server_cpu_us(before: dict, after: dict, requests: int) -> dict[str, float]:
    """Per-request server CPU between two `server_cpu` readings, in us."""
    return {k: (after[k] - before[k]) / max(requests, 1) * 1e6 for k in before if k in after}


def server_memory(pid: int) -> dict[str, float]:
    """The server's resident memory now and at its peak (VmRSS, VmHWM), in MB: its process
    and its model process together, and each (front, model_process)."""
    out: dict[str, float] = {}
    for who, p in [("front", pid)] + [("model_process", c) for c in children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key = {"VmRSS:": "rss", "VmHWM:": "peak"}.get(line.split()[0] if line else "")
                if key:
                    mb = int(line.split()[1]) / 1024
                    out[key] = out.get(key, 0.0) + mb
                    if key == "rss":
                        out[f"rss_{who}"] = mb
        except OSError:
            pass
    return out


def _stats(lat: list, errors: list, wall: float) -> dict:
    lat_ms = np.array(lat) * 1000
    return {
        "requests": len(lat),
        "errors": len(errors),
        "rps": len(lat) / wall,
        "p50_ms": float(np.percentile(lat_ms, 50)),
        "p99_ms": float(np.percentile(lat_ms, 99)),
    }


def _use_uvloop() -> None:
    try:  # the client's own CPU cost competes with the server on a small machine
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def load_level(args) -> dict:
    """Runs in a separate process: `conc` keep-alive clients for `secs` seconds."""
    host, port, req, conc, secs = args

    async def main():
        lat, errors = [], []
        stop_at = time.perf_counter() + secs
        t0 = time.perf_counter()
        await asyncio.gather(*[_worker(host, port, req, stop_at, lat, errors) for _ in range(conc)])
        return lat, errors, time.perf_counter() - t0

    _use_uvloop()
    t0 = os.times()
    stats = _stats(*asyncio.run(main()))
    return {"concurrency": conc, **stats, "client_cpu_us": _cpu_since(t0, stats["requests"])}


def bare_limit(
    run: Path, png: bytes, batch: int = 64, seconds: float = 5.0, photo: bool = False
) -> dict:
    """The service's model + gallery in this process: embed + classify a batch of 64, no HTTP
    and no decoding, at the best thread count (every count from 1 to the cores is tried).
    Also a per-request CPU breakdown of the HTTP path: the ASGI app (FastAPI, multipart, the
    route, JSON) with the model stubbed out, and decoding + preprocessing one upload."""
    import torch

    from embedding.datasets import load_raw
    from service.config import Settings
    from service.startup import ServiceHost

    host = ServiceHost(Settings(model=run, data_dir=run / "bench-bare"))
    st = host.finish()
    embedder = st.runtime.embedder
    # uint8 (B, C, H, W) as the service's preprocess leaves them; embed() normalises the batch
    if photo:  # the query photograph, as the service decodes it
        from PIL import Image

        img = Image.open(io.BytesIO(png)).convert("RGB")
        x = torch.stack([embedder.preprocess(img)] * batch)
    else:
        raw = load_raw("fashion-mnist", "test")
        x = torch.stack([embedder.preprocess(raw.source.get(i)) for i in range(batch)])

    def rate(threads: int) -> float:
        torch.set_num_threads(threads)
        st.gallery.classify(embedder.embed(x), "kde", 30)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            st.gallery.classify(embedder.embed(x), "kde", 30)
            n += batch
        return n / (time.perf_counter() - t0)

    rates = {t: rate(t) for t in range(1, (os.cpu_count() or 1) + 1)}
    best = max(rates, key=rates.get)
    torch.set_num_threads(best)
    t0 = time.perf_counter()
    for _ in range(20):
        st.gallery.classify(embedder.embed(x[:1]), "kde", 30)
    single = (time.perf_counter() - t0) / 20 * 1000
    emb = embedder.embed(x)
    t0 = time.perf_counter()
    for _ in range(10):
        embedder.embed(x)
    model_us = (time.perf_counter() - t0) / 10 / batch * 1e6
    t0 = time.perf_counter()
    for _ in range(10):
        st.gallery.classify(emb, "kde", 30)
    vote_us = (time.perf_counter() - t0) / 10 / batch * 1e6
    breakdown = asyncio.run(_http_breakdown(host, png))
    host.stop()
    return {
        "images_per_s": rates[best],
        "threads": best,
        "images_per_s_by_threads": rates,
        "batch": batch,
        "single_image_ms": single,
        "cpu_us_per_image": {
            "forward_at_batch": model_us,
            "vote_at_batch": vote_us,
            **breakdown,
        },
    }


async def _http_breakdown(host, png: bytes, n: int = 2000) -> dict:
    """CPU per request on the event loop: decode + preprocess, and the whole ASGI app with
    the batcher replaced by a precomputed answer (so: FastAPI, multipart, route, JSON)."""
    from service.gallery.query import VoteQuery
    from service.http.app import create_app
    from service.model.runtime import Job

    app = create_app(host=host)
    rt = host.state.runtime
    (p,) = await rt.uploads.prepare_async([png], ["image"])
    answer = rt.run_batch([Job("classify", p.pixels, VoteQuery("kde", 30))])[0]

    async def classify(*_a, **_k):
        return answer

    rt.classify = classify
    rt.batcher.start()
    raw = request_bytes("127.0.0.1", 80, png)
    head, body = raw.split(b"\r\n\r\n", 1)
    headers = [
        tuple(x.strip().lower() if i == 0 else x.strip() for i, x in enumerate(h.split(b":", 1)))
        for h in head.split(b"\r\n")[1:]
    ]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/classify",
        "raw_path": b"/classify",
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def one():
        sent = False

        async def receive():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.sleep(3600)

        status = []

        async def send(m):
            if m["type"] == "http.response.start":
                status.append(m["status"])

        await app(dict(scope), receive, send)
        assert status == [200], status

    for _ in range(200):
        await one()
    t0 = time.perf_counter()
    for _ in range(n):
        await one()
    app_us = (time.perf_counter() - t0) / n * 1e6
    t0 = time.perf_counter()
    for _ in range(n):
        await rt.uploads.prepare_async([png], ["image"])
    decode_us = (time.perf_counter() - t0) / n * 1e6
    return {"asgi_app_with_decode": app_us, "decode_and_preprocess": decode_us}


def query_png() -> bytes:
    """The benchmark's query: the first Fashion-MNIST test image as a 28x28 PNG."""
    from PIL import Image

    from embedding.datasets import load_raw

    b = io.BytesIO()
    Image.fromarray(load_raw("fashion-mnist", "test").source.get(0)[0].numpy()).save(b, "PNG")
    return b.getvalue()


def serve(
    run: Path,
    port: int,
    max_batch: int,
    data_dir: Path,
    python_args=("-m", "service"),
    extra=(),
    cwd: Path = ROOT,
    env: dict | None = None,
) -> subprocess.Popen:
    """A server process (`python -m service` unless `python_args` says otherwise, with
    snca-serve's flags and `extra` ones) on loopback, once /readyz answers 200."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    p = subprocess.Popen(
        [
            sys.executable,
            *python_args,
            "--model",
            str(run),
            "--data-dir",
            str(data_dir),
            "--port",
            str(port),
            "--max-batch",
            str(max_batch),
            "--log-level",
            "warning",
            *extra,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=cwd,
    )
    return wait_ready(p, port, 600)  # a ResNet-50 at 224 px warms up for ~30 s on 2 cores


def wait_ready(p: subprocess.Popen, port: int, timeout: float, log: Path | None = None):
    """`p` once http://127.0.0.1:PORT/readyz answers 200; RuntimeError (with `log`'s tail) when
    it exits first, or when `timeout` s pass (it is killed then)."""
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline and p.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return p
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.kill()
    tail = log.read_text()[-2000:] if log is not None else ""
    raise RuntimeError(f"server did not start (exit {p.poll()}) {tail}")


def start_app(code: str, port: int, *args) -> subprocess.Popen:
    """A server from `python -c code port *args` (an ASGI app on uvicorn, say), once anything
    answers HTTP on `port`."""
    import httpx

    p = subprocess.Popen(
        [sys.executable, "-c", code, str(port), *map(str, args)], stderr=subprocess.DEVNULL
    )
    for _ in range(100):
        try:
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
            return p
        except httpx.HTTPError:
            time.sleep(0.1)
    p.kill()
    raise RuntimeError(f"no server answered on port {port}")


def latency_ratio(
    pool, pid: int, port: int, png: bytes, seconds: float, fractions=(0.5,), rates=()
) -> list[tuple[str, dict]]:
    """The p99 target's measurement against one server: the closed loop at c = 1 and c = 64,
    then the open loop at `fractions` of the c = 64 rate and at the fixed `rates`, each with
    the server's CPU per request. (label, result) rows; a rate the server could not keep up
    with gives {"overloaded": why}."""
    req = request_bytes("127.0.0.1", port, png)
    host = "127.0.0.1"
    single = _with_cpu(pool, pid, load_level, (host, port, req, 1, seconds))
    sat = _with_cpu(pool, pid, load_level, (host, port, req, 64, seconds))
    rows = [("c=1", single), ("c=64", sat)]
    opened = [(f"{f:.0%} of saturation", sat["rps"] * f) for f in fractions]
    for label, rate in [*opened, *((f"{r:.0f}/s", r) for r in rates)]:
        rows.append((label, _open_level(pool, pid, (host, port, req, rate, seconds))))
    return rows


def _open_level(pool, pid: int, args) -> dict:
    """One open-loop level with the server's CPU, or {"offered_rps", "overloaded": why} when
    the server could not keep up (the client's own error)."""
    try:
        return _with_cpu(pool, pid, open_loop, args)
    except RuntimeError as e:
        return {"offered_rps": args[3], "overloaded": str(e)}


def print_rows(prefix: str, rows: list[tuple[str, dict]]) -> None:
    """`latency_ratio`'s rows, one line each, p99 as a multiple of the c = 1 median."""
    single = rows[0][1]["p50_ms"]
    for label, r in rows:
        if "overloaded" in r:
            print(f"{prefix}{label}: overloaded ({r['overloaded']})", flush=True)
            continue
        late = r.get("client_late_p99_ms")
        print(
            f"{prefix}{label}: {r['rps']:.0f}/s p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms "
            f"= {r['p99_ms'] / single:.1f}x single, errors {r['errors']}; {_cpu_text(r)}"
            + ("" if late is None else f"; client late p99 {late:.2f} ms"),
            flush=True,
        )


def _with_cpu(pool, pid: int, fn, args) -> dict:
    """Run one load level in the client process; add the server's CPU per request, by thread."""
    before = server_cpu(pid)
    r = pool.apply(fn, (args,))
    r["server_cpu_us"] = _server_cpu_us(before, server_cpu(pid), r["requests"])
    return r


def _cpu_text(r: dict) -> str:
    cpu = r.get("server_cpu_us") or {}
    parts = [f"{k.replace('_', ' ')} {v:.0f}" for k, v in cpu.items()]
    return f"CPU us/request: {', '.join(parts)}, client {r['client_cpu_us']:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prepare", action="store_true", help="train the tiny bench runs first")
    ap.add_argument(
        "--models",
        default="conv4,resnet18",
        help="bench models (conv4, resnet18, resnet50-224) and/or run dirs, e.g. runs/demo "
        "(55,000-item gallery)",
    )
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--seconds", type=float, default=6.0, help="per concurrency level")
    ap.add_argument("--port", type=int, default=8911)
    ap.add_argument(
        "--fractions",
        default="0.25,0.5,0.75",
        help="open-loop rates as fractions of the saturated rate (0.5 is always run)",
    )
    ap.add_argument(
        "--max-batches",
        default="64,1",
        help="micro-batcher sizes to run, one fresh server each (1 = batching off)",
    )
    ap.add_argument(
        "--rates",
        default="",
        help="also open-loop at these fixed rates (requests/s), the same for every setting; "
        "a rate a setting cannot keep up with is recorded as overloaded",
    )
    ap.add_argument(
        "--query",
        choices=("fashion", "photo", "phone"),
        default="fashion",
        help="the request image: a 28x28 Fashion-MNIST PNG, a 640x480 JPEG photograph or a "
        "12-megapixel (4032x3024) one as phones take them (for the photo models, e.g. "
        "--models resnet50-224)",
    )
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    try:
        fractions = sorted({0.5, *(float(x) for x in a.fractions.split(",") if x.strip())})
    except ValueError:
        ap.error(f"--fractions: {a.fractions!r} is not a comma-separated list of numbers")
    if not all(0 < f <= 1 for f in fractions):
        ap.error("--fractions must lie in (0, 1]")
    try:
        max_batches = [int(x) for x in a.max_batches.split(",")]
        rates = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--max-batches {a.max_batches!r} / --rates {a.rates!r}: comma-separated numbers")
    if not max_batches or min(max_batches) < 1 or max(max_batches) > 1024:
        ap.error("--max-batches must be sizes from 1 to 1024")
    if any(r <= 0 for r in rates):
        ap.error("--rates must be positive")
    if a.prepare:
        prepare(a.models.split(","))
    png = {"photo": query_photo, "phone": lambda: query_photo((4032, 3024))}.get(
        a.query, query_png
    )()
    try:
        levels = [int(x) for x in a.levels.split(",")]
    except ValueError:
        ap.error(f"--levels: {a.levels!r} is not a comma-separated list of integers")
    if not levels or min(levels) < 1 or a.seconds <= 0:
        ap.error("--levels must be concurrencies >= 1 and --seconds positive")
    results = {"cpu_count": os.cpu_count(), "levels": levels, "seconds_per_level": a.seconds}
    ctx = mp.get_context("spawn")
    for arch in a.models.split(","):
        # a bench model's name, or any run dir with an index
        run = {**RUNS, **PHOTO_RUNS}.get(arch, Path(arch))
        bare = bare_limit(run, png, batch=max(max_batches), photo=a.query != "fashion")
        results[arch] = {"bare": bare}
        print(
            f"{arch}: bare limit {bare['images_per_s']:.0f} img/s (batch {bare['batch']}), "
            f"single image {bare['single_image_ms']:.2f} ms, {bare['threads']} thread(s)",
            flush=True,
        )
        cpu = bare["cpu_us_per_image"]
        print(
            "  CPU per image (us): "
            + ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in cpu.items()),
            flush=True,
        )
        for max_batch in max_batches:
            data_dir = run / f"bench-serve-{max_batch}"
            proc = serve(run, a.port, max_batch, data_dir)
            req = request_bytes("127.0.0.1", a.port, png)
            rows = []
            try:
                with ctx.Pool(1) as pool:
                    for conc in levels:
                        r = _with_cpu(
                            pool, proc.pid, load_level, ("127.0.0.1", a.port, req, conc, a.seconds)
                        )
                        rows.append(r)
                        print(
                            f"  max batch {max_batch:3d} c={conc:3d}: {r['rps']:7.0f} img/s "
                            f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}  "
                            f"{_cpu_text(r)}",
                            flush=True,
                        )
                    sat = max(rows, key=lambda r: r["rps"])
                    # Fractions of saturation as offered rates (open loop), which is what "at
                    # half load" means for users; closed-loop levels tie latency to concurrency.
                    opened = {}
                    for f in fractions:
                        r = _with_cpu(
                            pool,
                            proc.pid,
                            open_loop,
                            ("127.0.0.1", a.port, req, sat["rps"] * f, a.seconds),
                        )
                        opened[f] = r
                        print(
                            f"  open loop at {f:.0%} of saturation ({r['offered_rps']:.0f}/s): "
                            f"p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms = "
                            f"{r['p99_ms'] / rows[0]['p50_ms']:.1f}x single  errors {r['errors']}  "
                            f"{_cpu_text(r)}",
                            flush=True,
                        )
                    half = opened[0.5]
                    fixed = []
                    for rate in rates:
                        r = _open_level(pool, proc.pid, ("127.0.0.1", a.port, req, rate, a.seconds))
                        fixed.append(r)
                        if "overloaded" in r:
                            print(
                                f"  open loop at {rate:.0f}/s: overloaded ({r['overloaded']})",
                                flush=True,
                            )
                            continue
                        print(
                            f"  open loop at {rate:.0f}/s: p50 {r['p50_ms']:.2f} ms  "
                            f"p99 {r['p99_ms']:.2f} ms  errors {r['errors']}  {_cpu_text(r)}",
                            flush=True,
                        )
                mem = server_memory(proc.pid)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            single = rows[0]["p50_ms"]
            summary = {
                "levels": rows,
                "saturation_rps": sat["rps"],
                "saturation_concurrency": sat["concurrency"],
                "service_over_bare": sat["rps"] / bare["images_per_s"],
                "server_memory_mb": mem,
                "single_request_ms": single,
                "half_saturation": {
                    "offered_rps": half["offered_rps"],
                    "rps": half["rps"],
                    "errors": half["errors"],
                    "p50_ms": half["p50_ms"],
                    "p99_ms": half["p99_ms"],
                    "p99_over_single": half["p99_ms"] / single,
                    "client_late_p99_ms": half["client_late_p99_ms"],
                    "server_cpu_us": half["server_cpu_us"],
                    "client_cpu_us": half["client_cpu_us"],
                },
                "open_loop": [
                    {"fraction": f, **r, "p99_over_single": r["p99_ms"] / single}
                    for f, r in opened.items()
                ],
            }
            if rates:
                summary["fixed_rates"] = fixed
            key = {64: "batching", 1: "no_batching"}.get(max_batch, f"max_batch_{max_batch}")
            results[arch][key] = summary
            print(
                f"  -> saturation {sat['rps']:.0f} img/s at c={sat['concurrency']} "
                f"({100 * summary['service_over_bare']:.0f}% of bare); p99 at half saturation "
                f"({half['offered_rps']:.0f}/s offered, open loop) {half['p99_ms']:.1f} ms = {summary['half_saturation']['p99_over_single']:.1f}x "
                f"the single-request latency {single:.1f} ms; {_cpu_text(half)}; server RSS "
                f"{mem.get('rss', 0):.0f} MB (peak {mem.get('peak', 0):.0f} MB"
                + (
                    f"; front {mem['rss_front']:.0f} + model process "
                    f"{mem['rss_model_process']:.0f} MB)"
                    if "rss_model_process" in mem
                    else ")"
                ),
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
