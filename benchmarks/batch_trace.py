"""Where a /classify request's time goes at a given offered rate, on the real server.

    python benchmarks/batch_trace.py                       # conv4 bench run, 1,000/s
    python benchmarks/batch_trace.py --rate 700 --model resnet18

Runs `python -m service` with light instrumentation (a list append per batch) and drives it
with service_load's clients: a closed loop at concurrency 1, then the open loop at `--rate`.
For each phase it prints

- the client's latency against the server's own time (the `x-process-time-ms` header, from
  the middleware's start to the response's start); the difference is time spent waiting to be
  read by a busy event loop, plus the client's own lateness;
- the model thread's batches: sizes, wall time and CPU time, and the fraction of the wall
  clock it spent inside a batch;
- the forward pass and the vote, wall against CPU time. Both run without the GIL, so the
  difference is mostly waiting to take the GIL back from the event loop's thread;
- each server thread's CPU and its wait in the scheduler's run queue (/proc schedstat), which
  tells waiting for a core apart from waiting for the GIL.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
from service_load import (  # noqa: E402
    RUNS,
    load_level,
    open_loop,
    query_png,
    request_bytes,
    serve,
)

from benchmarks.command_line import parser, write_report  # noqa: E402

# The server with timers around the model thread's batch, forward and vote; GET /_trace hands
# the records over (and clears them). Each record is a few floats appended under the GIL.
STUB = """
import sys, time
from service.gallery import gallery
from service.http import app as app_mod
from service.model import embedder, runtime
rec = {"batch": [], "forward": [], "vote": []}
def timed(fn, key):
    def wrapper(self, arg, *a, **k):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = fn(self, arg, *a, **k)
        rec[key].append((time.perf_counter() - t0, time.thread_time() - c0, len(arg)))
        return out
    return wrapper
runtime.ModelRuntime.run_batch = timed(runtime.ModelRuntime.run_batch, "batch")
embedder.Embedder.forward = timed(embedder.Embedder.forward, "forward")
gallery.Gallery.answer = timed(gallery.Gallery.answer, "vote")
real_create = app_mod.create_app
def create_app(*a, **k):
    app = real_create(*a, **k)
    async def trace():
        out = {key: list(v) for key, v in rec.items()}
        for v in rec.values():
            v.clear()
        return out
    app.add_api_route("/_trace", trace, methods=["GET"])
    return app
app_mod.create_app = create_app
from service.cli import main
sys.argv = ["snca-serve"] + sys.argv[1:]
sys.exit(main())
"""


def schedstat(pid: int) -> dict[int, tuple[float, float]]:
    """{thread id: (CPU s, run-queue wait s)} of every thread of `pid` (Linux)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            cpu, wait, _ = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(tid)] = (int(cpu) / 1e9, int(wait) / 1e9)
    return out


def _pct(a, q) -> float:
    return float(np.percentile(a, q)) if len(a) else float("nan")


def report(name: str, trace: dict, seconds: float) -> dict:
    b = np.array(trace["batch"]).reshape(-1, 3)  # (wall s, CPU s, size)
    summary = {
        "batches": len(b),
        "mean_batch": float(b[:, 2].mean()) if len(b) else 0.0,
        "model_thread_busy": float(b[:, 0].sum() / seconds) if len(b) else 0.0,
    }
    print(
        f"  {name}: {len(b)} batches, mean size {summary['mean_batch']:.2f}; the model thread "
        f"was inside a batch {100 * summary['model_thread_busy']:.0f}% of the time"
    )
    for size in (1, 2, 3, 4):
        m = b[:, 2] == size
        if m.sum() >= 20:
            print(
                f"    batch of {size}: wall p50 {1e3 * _pct(b[m, 0], 50):.3f} ms "
                f"p99 {1e3 * _pct(b[m, 0], 99):.3f} ms, CPU p50 {1e3 * _pct(b[m, 1], 50):.3f} ms "
                f"({m.sum()} batches)"
            )
    for key in ("forward", "vote"):
        a = np.array(trace[key]).reshape(-1, 3)
        if len(a):
            wall, cpu = 1e3 * a[:, 0].mean(), 1e3 * a[:, 1].mean()
            summary[key] = {"wall_ms": wall, "cpu_ms": cpu}
            print(
                f"    {key}: wall {wall:.3f} ms, CPU {cpu:.3f} ms per call (mean): "
                f"{wall - cpu:.3f} ms waiting"
            )
    return summary


def main() -> None:
    ap = parser(__doc__, seconds=6.0, port=8913)
    ap.add_argument("--model", default="conv4", help="bench model name or run dir")
    ap.add_argument("--rate", type=float, default=1000.0, help="open-loop requests/s")
    ap.add_argument("--max-batch", type=int, default=64)
    a = ap.parse_args()
    if a.rate <= 0 or a.seconds <= 0 or a.max_batch < 1:
        ap.error("--rate and --seconds must be positive, --max-batch at least 1")
    run = RUNS.get(a.model, Path(a.model))
    proc = serve(
        run,
        a.port,
        a.max_batch,
        run / "bench-trace",
        python_args=("-c", STUB),
        extra=("--no-model-process",),
    )
    url = f"http://127.0.0.1:{a.port}/_trace"
    out = {"model": str(a.model), "rate": a.rate, "max_batch": a.max_batch}
    try:
        req = request_bytes("127.0.0.1", a.port, query_png())
        with mp.get_context("spawn").Pool(1) as pool:
            httpx.get(url)  # drop the warm-up's records
            single = pool.apply(load_level, (("127.0.0.1", a.port, req, 1, a.seconds),))
            print(f"{a.model}: concurrency 1, {single['rps']:.0f}/s, p50 {single['p50_ms']:.2f} ms")
            out["single"] = report("c = 1", httpx.get(url).json(), a.seconds)
            before = schedstat(proc.pid)
            r = pool.apply(open_loop, (("127.0.0.1", a.port, req, a.rate, a.seconds),))
            after = schedstat(proc.pid)
        trace = httpx.get(url).json()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    wall = a.seconds + 1.0  # the open loop's warm-up second is in the trace too
    print(
        f"open loop at {a.rate:.0f}/s: client p50 {r['p50_ms']:.2f} ms p99 {r['p99_ms']:.2f} ms "
        f"({r['p99_ms'] / single['p50_ms']:.1f}x the single request); the server's own time "
        f"p50 {r['server_p50_ms']:.2f} ms p99 {r['server_p99_ms']:.2f} ms; client late p99 "
        f"{r['client_late_p99_ms']:.2f} ms"
    )
    out["open_loop"] = {k: v for k, v in r.items() if not isinstance(v, list)}
    out["open_loop"]["trace"] = report(f"{a.rate:.0f}/s", trace, wall)
    out["threads"] = {}
    for tid, (cpu, wait) in after.items():
        if tid in before and cpu - before[tid][0] > 0.05 * wall:
            name = "event loop" if tid == proc.pid else f"thread {tid}"
            cpu_s, wait_s = cpu - before[tid][0], wait - before[tid][1]
            out["threads"][name] = {"cpu_s": cpu_s, "run_queue_wait_s": wait_s}
            print(f"    {name}: CPU {cpu_s:.2f} s, waiting for a core {wait_s:.2f} s")
    write_report(a.json, out)


if __name__ == "__main__":
    main()
