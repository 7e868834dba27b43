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
            subprocess.run([sys.executable, "-m", "training", "--arch", arch, "--subset", "6000",
                            "--val-size", "0", "--epochs", "1", "--out", str(out), "--overwrite",
                            "--no-progress"], check=True)
            subprocess.run([sys.executable, "-m", "index_builder", str(out), "--out",
                            str(out / "index"), "--overwrite", "--no-progress"], check=True)


def request_bytes(host: str, port: int, png: bytes, path: str = "/classify") -> bytes:
    boundary = "snca-bench-boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"q.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{boundary}--\r\n".encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: multipart/form-data; "
            f"boundary={boundary}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    return head + body


async def _worker(host, port, req, stop_at, lat, errors):
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
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
            if b" 200 " not in status:
                errors.append(status)
            lat.append(time.perf_counter() - t0)
    finally:
        writer.close()


def load_level(args) -> dict:
    """Runs in a separate process: `conc` keep-alive clients for `secs` seconds."""
    host, port, req, conc, secs = args

    async def main():
        lat, errors = [], []
        stop_at = time.perf_counter() + secs
        t0 = time.perf_counter()
        await asyncio.gather(*[_worker(host, port, req, stop_at, lat, errors) for _ in range(conc)])
        return lat, errors, time.perf_counter() - t0

    lat, errors, wall = asyncio.run(main())
    lat_ms = np.array(lat) * 1000
    return {"concurrency": conc, "requests": len(lat), "errors": len(errors), "rps": len(lat) / wall,
            "p50_ms": float(np.percentile(lat_ms, 50)), "p99_ms": float(np.percentile(lat_ms, 99))}


def bare_limit(run: Path, batch: int = 64, seconds: float = 5.0) -> dict:
    """The service's model + gallery in this process: embed + classify a batch, no HTTP."""
    import torch

    from service.config import Settings
    from service.state import ServiceState

    torch.set_num_threads(os.cpu_count() or 1)
    st = ServiceState(Settings(model=run, data_dir=run / "bench-bare"))
    st.start()
    x = torch.randn(batch, st.embedder.model.config.in_channels, st.embedder.model.config.image_size,
                    st.embedder.model.config.image_size)
    st.gallery.classify(st.embedder.embed(x), "kde", 30)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        st.gallery.classify(st.embedder.embed(x), "kde", 30)
        n += batch
    rate = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    for _ in range(20):
        st.gallery.classify(st.embedder.embed(x[:1]), "kde", 30)
    single = (time.perf_counter() - t0) / 20 * 1000
    st.stop()
    return {"images_per_s": rate, "batch": batch, "single_image_ms": single}


def serve(run: Path, port: int, max_batch: int, data_dir: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "service", "--model", str(run), "--data-dir", str(data_dir),
                          "--port", str(port), "--max-batch", str(max_batch), "--log-level", "warning"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prepare", action="store_true", help="train the tiny bench runs first")
    ap.add_argument("--models", default="conv4,resnet18")
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
        run = RUNS[arch]
        bare = bare_limit(run)
        results[arch] = {"bare": bare}
        print(f"{arch}: bare limit {bare['images_per_s']:.0f} img/s (batch {bare['batch']}), "
              f"single image {bare['single_image_ms']:.2f} ms", flush=True)
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
                        print(f"  batching {'on ' if max_batch > 1 else 'off'} c={conc:3d}: {r['rps']:7.0f} img/s "
                              f"p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms  errors {r['errors']}", flush=True)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            sat = max(rows, key=lambda r: r["rps"])
            single = rows[0]["p50_ms"]
            half = min(rows, key=lambda r: abs(r["rps"] - sat["rps"] / 2))
            summary = {"levels": rows, "saturation_rps": sat["rps"], "saturation_concurrency": sat["concurrency"],
                       "service_over_bare": sat["rps"] / bare["images_per_s"], "single_request_ms": single,
                       "half_saturation": {"concurrency": half["concurrency"], "rps": half["rps"],
                                           "p99_ms": half["p99_ms"], "p99_over_single": half["p99_ms"] / single}}
            results[arch]["batching" if max_batch > 1 else "no_batching"] = summary
            print(f"  -> saturation {sat['rps']:.0f} img/s at c={sat['concurrency']} "
                  f"({100 * summary['service_over_bare']:.0f}% of bare); p99 at ~half saturation "
                  f"(c={half['concurrency']}) {half['p99_ms']:.1f} ms = {summary['half_saturation']['p99_over_single']:.1f}x "
                  f"the single-request latency {single:.1f} ms", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
