"""Load test of POST /classify against a real snca-serve process, next to the bare limit.

    python benchmarks/service_load.py --prepare            # tiny conv4 and resnet18 runs + indexes
    python benchmarks/service_load.py                      # both models, batching on and off

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
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUNS = {"conv4": ROOT / "runs" / "bench-conv4", "resnet18": ROOT / "runs" / "bench-resnet18"}


def prepare() -> None:
    """Tiny training runs (1 epoch) with their exact indexes: throughput does not need accuracy."""
    for arch, out in RUNS.items():
        if not (out / "index" / "manifest.json").is_file():
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "training",
                    "--arch",
                    arch,
                    "--subset",
                    "6000",
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


def open_loop(args) -> dict:
    """Runs in a separate process: requests at a fixed rate (not paced by the answers, so a
    slow server cannot slow the arrivals), each on a free keep-alive connection (a new one
    when all are busy). Latency counts from the scheduled send time. A pacing thread sleeps to
    each send time and hands the request to the event loop: the loop's own timers round up
    to whole milliseconds, which put up to 1.5 ms of the client's lateness into the p99. The
    first second (connections being opened) is a warm-up and not counted; the client's
    garbage collector is off meanwhile (its pauses are not the server's latency)."""
    import gc
    import threading

    host, port, req, rate, secs = args
    warm = int(rate)  # requests in the first second

    async def main():
        loop = asyncio.get_running_loop()
        idle, lat, errors, tasks, late = [], [], [], [], []
        done = loop.create_future()
        n = warm + int(rate * secs)

        async def one(t_sched, counted):
            conn = idle.pop() if idle else None
            try:
                if conn is None or conn[0].at_eof():
                    raise ConnectionError
                status = await _exchange(*conn, req)
            except ConnectionError:  # none idle, or closed by the server's keep-alive timeout
                conn = await asyncio.open_connection(host, port)
                status = await _exchange(*conn, req)
            if counted:
                lat.append(time.perf_counter() - t_sched)
                if b" 200 " not in status:
                    errors.append(status)
            idle.append(conn)

        def start(t_i):
            counted = len(tasks) >= warm
            if counted:
                late.append(time.perf_counter() - t_i)
            tasks.append(asyncio.ensure_future(one(t_i, counted)))
            if len(tasks) == n:
                done.set_result(None)

        def pace(t0):
            for i in range(n):
                t_i = t0 + i / rate
                delay = t_i - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                loop.call_soon_threadsafe(start, t_i)

        t0 = time.perf_counter() + 0.05
        pacer = threading.Thread(target=pace, args=(t0,), daemon=True)
        pacer.start()
        await done
        await asyncio.gather(*tasks)
        pacer.join()
        for _, w in idle:
            w.close()
        wall = time.perf_counter() - t0 - warm / rate
        return (lat, errors, wall), float(np.percentile(np.array(late) * 1000, 99))

    _use_uvloop()
    gc.collect()
    gc.disable()
    try:
        stats, late_p99 = asyncio.run(main())
    finally:
        gc.enable()
    # how late the client itself started requests (counted in the latencies)
    return {"offered_rps": rate, **_stats(*stats), "client_late_p99_ms": late_p99}


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
    return {"concurrency": conc, **_stats(*asyncio.run(main()))}


def bare_limit(run: Path, png: bytes, batch: int = 64, seconds: float = 5.0) -> dict:
    """The service's model + gallery in this process: embed + classify a batch of 64, no HTTP
    and no decoding, at the best thread count (every count from 1 to the cores is tried).
    Also a per-request CPU breakdown of the HTTP path: the ASGI app (FastAPI, multipart, the
    route, JSON) with the model stubbed out, and decoding + preprocessing one upload."""
    import torch

    from embedding.datasets import load_raw
    from service.config import Settings
    from service.state import ServiceState

    st = ServiceState(Settings(model=run, data_dir=run / "bench-bare"))
    st.start()
    raw = load_raw("fashion-mnist", "test")
    # uint8 (B, C, H, W) as the service's preprocess leaves them; embed() normalises the batch
    x = torch.stack([st.embedder.preprocess(raw.source.get(i)) for i in range(batch)])

    def rate(threads: int) -> float:
        torch.set_num_threads(threads)
        st.gallery.classify(st.embedder.embed(x), "kde", 30)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            st.gallery.classify(st.embedder.embed(x), "kde", 30)
            n += batch
        return n / (time.perf_counter() - t0)

    rates = {t: rate(t) for t in range(1, (os.cpu_count() or 1) + 1)}
    best = max(rates, key=rates.get)
    torch.set_num_threads(best)
    t0 = time.perf_counter()
    for _ in range(20):
        st.gallery.classify(st.embedder.embed(x[:1]), "kde", 30)
    single = (time.perf_counter() - t0) / 20 * 1000
    emb = st.embedder.embed(x)
    t0 = time.perf_counter()
    for _ in range(10):
        st.embedder.embed(x)
    model_us = (time.perf_counter() - t0) / 10 / batch * 1e6
    t0 = time.perf_counter()
    for _ in range(10):
        st.gallery.classify(emb, "kde", 30)
    vote_us = (time.perf_counter() - t0) / 10 / batch * 1e6
    breakdown = asyncio.run(_http_breakdown(st, png))
    st.stop()
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


async def _http_breakdown(st, png: bytes, n: int = 2000) -> dict:
    """CPU per request on the event loop: decode + preprocess, and the whole ASGI app with
    the batcher replaced by a precomputed answer (so: FastAPI, multipart, route, JSON)."""
    from service.app import create_app
    from service.state import Job

    app = create_app(state=st)
    (p,) = await st.prepare_async([png], ["image"])
    answer = st._run_batch([Job("classify", p.tensor, ("kde", 30, None, False))])[0]

    async def classify(*_a, **_k):
        return answer

    st.classify = classify
    st.batcher.start()
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
        await st.prepare_async([png], ["image"])
    decode_us = (time.perf_counter() - t0) / n * 1e6
    return {"asgi_app_with_decode": app_us, "decode_and_preprocess": decode_us}


def serve(run: Path, port: int, max_batch: int, data_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service",
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
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    import httpx

    for _ in range(300):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                return p
        except httpx.HTTPError:
            time.sleep(0.2)
    p.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--prepare", action="store_true", help="train the tiny bench runs first")
    ap.add_argument(
        "--models",
        default="conv4,resnet18",
        help="bench models (conv4, resnet18) and/or run dirs, e.g. runs/demo (55,000-item gallery)",
    )
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--seconds", type=float, default=6.0, help="per concurrency level")
    ap.add_argument("--port", type=int, default=8911)
    ap.add_argument("--json", help="also write the results here")
    a = ap.parse_args()
    if a.prepare:
        prepare()
    from PIL import Image

    from embedding.datasets import load_raw

    raw = load_raw("fashion-mnist", "test")
    b = io.BytesIO()
    Image.fromarray(raw.source.get(0)[0].numpy()).save(b, "PNG")
    levels = [int(x) for x in a.levels.split(",")]
    results = {"cpu_count": os.cpu_count(), "levels": levels, "seconds_per_level": a.seconds}
    ctx = mp.get_context("spawn")
    for arch in a.models.split(","):
        run = RUNS.get(arch, Path(arch))  # a bench model's name, or any run dir with an index
        bare = bare_limit(run, b.getvalue())
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
        for max_batch in (64, 1):
            data_dir = run / f"bench-serve-{max_batch}"
            proc = serve(run, a.port, max_batch, data_dir)
            req = request_bytes("127.0.0.1", a.port, b.getvalue())
            rows = []
            try:
                with ctx.Pool(1) as pool:
                    for conc in levels:
                        r = pool.apply(load_level, (("127.0.0.1", a.port, req, conc, a.seconds),))
                        rows.append(r)
                        print(
                            f"  batching {'on ' if max_batch > 1 else 'off'} c={conc:3d}: {r['rps']:7.0f} img/s "
                            f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}",
                            flush=True,
                        )
                    sat = max(rows, key=lambda r: r["rps"])
                    # Half of saturation as an offered rate (open loop), which is what "at
                    # half load" means for users; closed-loop levels tie latency to concurrency.
                    half = pool.apply(
                        open_loop, (("127.0.0.1", a.port, req, sat["rps"] / 2, a.seconds),)
                    )
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            single = rows[0]["p50_ms"]
            summary = {
                "levels": rows,
                "saturation_rps": sat["rps"],
                "saturation_concurrency": sat["concurrency"],
                "service_over_bare": sat["rps"] / bare["images_per_s"],
                "single_request_ms": single,
                "half_saturation": {
                    "offered_rps": half["offered_rps"],
                    "rps": half["rps"],
                    "errors": half["errors"],
                    "p50_ms": half["p50_ms"],
                    "p99_ms": half["p99_ms"],
                    "p99_over_single": half["p99_ms"] / single,
                    "client_late_p99_ms": half["client_late_p99_ms"],
                },
            }
            results[arch]["batching" if max_batch > 1 else "no_batching"] = summary
            print(
                f"  -> saturation {sat['rps']:.0f} img/s at c={sat['concurrency']} "
                f"({100 * summary['service_over_bare']:.0f}% of bare); p99 at half saturation "
                f"({half['offered_rps']:.0f}/s offered, open loop) {half['p99_ms']:.1f} ms = {summary['half_saturation']['p99_over_single']:.1f}x "
                f"the single-request latency {single:.1f} ms",
                flush=True,
            )
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
