"""Serving processes sharing one gallery: throughput of --workers 1 vs 2, p99 at a fixed
offered rate, replication lag and write throughput on SQLite and PostgreSQL.

    python benchmarks/replicas.py --model runs/demo --json docs/replicas.json

All in one run, on this machine, against real `python -m service` processes on loopback:
1. /classify saturation (closed loop, keep-alive clients at each concurrency level, the best
   level counts) for --workers 1 and --workers 2: their ratio.
2. p99 latency at fixed offered rates (--rates, 250/500/1,000 req/s; open loop, not paced by
   the answers) for each, against the single-request latency (one client, p50).
3. Replication lag, commit on A -> applied on B: an add on A, then on B a read with
   X-Min-Gallery-Version of A's answer; the time from A's answer to B's (an upper bound: one
   extra loopback round trip) for SQLite (two processes on one store: what workers are) and
   PostgreSQL (a server started here, tests/service/pg.py).
4. Write throughput: adds of one image per request, 1 and 4 clients, one server, per backend.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.service_load import load_level, open_loop, request_bytes, wait_ready  # noqa: E402


def png28() -> bytes:
    from PIL import Image

    from embedding.datasets import load_raw

    raw = load_raw("fashion-mnist", "test")
    b = io.BytesIO()
    Image.fromarray(raw.source.get(0)[0].numpy()).save(b, "PNG")
    return b.getvalue()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(model: Path, data: Path, port: int, *extra: str, env: dict | None = None):
    data.parent.mkdir(parents=True, exist_ok=True)
    log = open(data.parent / f"server-{port}.log", "w")  # noqa: SIM115
    p = subprocess.Popen(
        [sys.executable, "-m", "service", "--model", str(model), "--data-dir", str(data),
         "--port", str(port), "--log-level", "warning", *extra],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
    )  # fmt: skip
    return wait_ready(p, port, 180, Path(log.name))


def stop(p) -> None:
    p.terminate()
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()


def rss_mb(pid: int) -> dict[int, float]:
    """Resident memory (MB) of a process and its children, by pid (Linux /proc)."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            out[p] = int(status.split("VmRSS:")[1].split()[0]) / 1024
            for t in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (t / "children").read_text().split()]
        except (OSError, IndexError):
            pass
    return out


def saturation(port: int, req: bytes, levels: list[int], secs: float) -> dict:
    out = {}
    with mp.get_context("spawn").Pool(1) as pool:
        for conc in levels:
            out[conc] = pool.apply(load_level, (("127.0.0.1", port, req, conc, secs),))
    best = max(out, key=lambda c: out[c]["rps"])
    return {"best_level": best, "images_per_s": out[best]["rps"], "levels": out}


def fixed_rate(port: int, req: bytes, rate: float, secs: float) -> dict:
    """open_loop's figures, or {"error": ...} when the server cannot keep up with `rate`."""
    with mp.get_context("spawn").Pool(1) as pool:
        try:
            return pool.apply(open_loop, (("127.0.0.1", port, req, rate, secs),))
        except RuntimeError as e:
            return {"error": str(e), "p99_ms": float("inf")}


def serving(model: Path, tmp: Path, req: bytes, args) -> dict:
    res = {}
    for workers in (1, 2):
        port = free_port()
        p = start(model, tmp / f"w{workers}" / "data", port, "--workers", str(workers))
        try:
            time.sleep(2)  # let every worker finish warming up
            mem = rss_mb(p.pid)
            single = saturation(port, req, [1], args.seconds)["levels"][1]
            sat = saturation(port, req, args.levels, args.seconds)
            print(f"workers {workers}: single p50 {single['p50_ms']:.2f} ms, saturation "
                  f"{sat['images_per_s']:.0f}/s at {sat['best_level']} clients", flush=True)  # fmt: skip
            rates = {r: fixed_rate(port, req, r, args.seconds) for r in args.rates}
            res[f"workers_{workers}"] = {
                "single_p50_ms": single["p50_ms"],
                "saturation_images_per_s": sat["images_per_s"],
                "saturation_level": sat["best_level"],
                "at_rates": rates,
                "p99_over_single": {r: v["p99_ms"] / single["p50_ms"] for r, v in rates.items()},
                "rss_mb_by_process": mem,  # workers 2: the supervisor + 2 workers
            }
            print(
                json.dumps({f"workers_{workers}": res[f"workers_{workers}"]}, default=str),
                flush=True,
            )
        finally:
            stop(p)
    res["ratio_2_over_1"] = (
        res["workers_2"]["saturation_images_per_s"] / res["workers_1"]["saturation_images_per_s"]
    )
    return res


def add_once(c, label: str, img: bytes):
    return c.post(
        "/gallery/add", data={"label": label}, files={"images": ("a.png", img, "image/png")}
    )


def lag_and_writes(model: Path, tmp: Path, img: bytes, kind: str, store: list[str], n: int) -> dict:
    import httpx

    pa, pb = free_port(), free_port()
    da, db = (tmp / kind / "a" / "data", tmp / kind / "b" / "data")
    if kind == "sqlite":
        db = da  # one store, one data dir: what --workers runs
    da.parent.mkdir(parents=True, exist_ok=True)
    db.parent.mkdir(parents=True, exist_ok=True)
    a = start(model, da, pa, *store)
    b = start(model, db, pb, *store)
    try:
        ca = httpx.Client(base_url=f"http://127.0.0.1:{pa}", timeout=30)
        cb = httpx.Client(base_url=f"http://127.0.0.1:{pb}", timeout=30)
        lags, applied_first = [], 0
        for i in range(n):
            r = add_once(ca, f"lag-{i % 10}", img)
            t_ack = time.perf_counter()
            v = r.json()["gallery_version"]
            got = cb.get(
                "/gallery/labels", params={"limit": 1}, headers={"X-Min-Gallery-Version": str(v)}
            )
            lags.append((time.perf_counter() - t_ack) * 1e3)
            assert got.status_code == 200, got.text
            applied_first += got.json()["gallery_version"] >= v
            time.sleep(0.02)
        lags.sort()
        writes = {}
        for clients in (1, 4):
            done, stop_at = [0] * clients, time.perf_counter() + 5

            def w(k, done=done, stop_at=stop_at):
                c = httpx.Client(base_url=f"http://127.0.0.1:{pa}", timeout=30)
                while time.perf_counter() < stop_at:
                    assert add_once(c, f"bulk-{k}", img).status_code == 201
                    done[k] += 1

            t0 = time.perf_counter()
            ts = [threading.Thread(target=w, args=(k,)) for k in range(clients)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            writes[f"{clients}_clients_adds_per_s"] = sum(done) / (time.perf_counter() - t0)
        return {
            "lag_ms_p50": statistics.median(lags),
            "lag_ms_p99": float(np.percentile(lags, 99)),
            "lag_ms_max": lags[-1],
            "samples": n,
            **writes,
        }
    finally:
        stop(a)
        stop(b)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", type=Path, default=ROOT / "runs" / "demo")
    ap.add_argument("--levels", default="8,32,64")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--rates", default="250,500,1000", help="fixed offered rates, req/s")
    ap.add_argument("--lag-samples", type=int, default=200)
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    args.levels = [int(x) for x in args.levels.split(",")]
    args.rates = [float(x) for x in args.rates.split(",")]
    img = png28()
    req = request_bytes("127.0.0.1", 0, img)
    out = {"model": str(args.model), "cores": os.cpu_count(), "rates": args.rates}
    with tempfile.TemporaryDirectory(prefix="snca-replicas-") as d:
        tmp = Path(d)
        if not args.skip_serving:
            out["serving"] = serving(args.model, tmp, req, args)
        out["sqlite"] = lag_and_writes(args.model, tmp, img, "sqlite", [], args.lag_samples)
        print(json.dumps({"sqlite": out["sqlite"]}), flush=True)
        from tests.service.pg import PostgresServer

        pg = PostgresServer()
        try:
            url = pg.new_database()
            out["postgresql"] = lag_and_writes(
                args.model, tmp, img, "postgresql", ["--store", url], args.lag_samples
            )
            print(json.dumps({"postgresql": out["postgresql"]}), flush=True)
        finally:
            pg.close()
    print(json.dumps(out, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
