"""Where a model process's core goes under /classify load, by phase, and what its vote costs
out of service (issue 55): the phases from the service's own /metrics
(`snca_model_seconds_total{phase}`: decode, forward, vote, other), the model process's CPU from
/proc, at closed-loop levels of keep-alive connections; then the same vote (the run's memory
bank as the gallery, the service's compiled kde_top, one thread, a batch of each level's mean
size) timed in this process alone, after 64 MB streamed through the caches before each call
(what a batch's other work does to them in service), and with a busy loop on every other CPU
(what the front and the client are to the model process under load).

    python benchmarks/model_phases.py --prepare                     # the conv4 bench run
    python benchmarks/model_phases.py --model runs/bench-conv4 --concurrency 4 16 64 --json out.json

The vote out of service needs a run whose memory bank is what it serves (the bench run's
6,000-item gallery is its memory bank); elsewhere its numbers compare a different gallery.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command_line import parser, write_report  # noqa: E402
from benchmarks.service_load import (  # noqa: E402
    RUNS,
    _with_cpu,
    load_level,
    prepare,
    query_png,
    request_bytes,
    serve,
)

PHASES = ("decode", "forward", "vote", "other")
FLUSH_MB = 64  # streamed through the caches between two calls of the vote timed alone


def scrape(port: int) -> dict[str, float]:
    """The /metrics counters this needs: seconds by phase, batches and their jobs."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    out = {
        p: float(v) for p, v in re.findall(r'snca_model_seconds_total\{phase="(\w+)"\} (\S+)', text)
    }
    for name in ("snca_batch_size_count", "snca_batch_size_sum"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def level(pool, p, port: int, req: bytes, conc: int, seconds: float) -> dict:
    """One closed-loop level: requests/s, mean batch, model-process CPU and phases per request."""
    before = scrape(port)
    r = _with_cpu(pool, p.pid, load_level, ("127.0.0.1", port, req, conc, seconds))
    after = scrape(port)
    n = max(r["requests"], 1)
    batches = after["snca_batch_size_count"] - before["snca_batch_size_count"]
    jobs = after["snca_batch_size_sum"] - before["snca_batch_size_sum"]
    phases = {ph: (after.get(ph, 0.0) - before.get(ph, 0.0)) * 1e6 / n for ph in PHASES}
    cpu = r["server_cpu_us"]
    return {
        "concurrency": conc,
        "rps": r["rps"],
        "errors": r["errors"],
        "mean_batch": jobs / max(batches, 1),
        "model_process_cpu_us": cpu.get("model_process", 0.0),
        "front_cpu_us": cpu.get("event_loop", 0.0) + cpu.get("other_threads", 0.0),
        "phases_us_per_request": phases,
        "vote_us_per_batch": phases["vote"] * n / max(batches, 1),
    }


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def vote_alone(run: Path, batch: int, calls: int = 300) -> dict:
    """The service's compiled vote on the run's memory bank, `batch` queries, one thread:
    median us per call alone, and with a busy loop pinned to every other CPU."""
    import torch

    from benchmarks.vote_screen import Votes
    from embedding.artifacts import load_memory_bank

    torch.set_num_threads(1)
    bank, _ = load_memory_bank(run / "memory.safetensors")
    rows = torch.nn.functional.normalize(bank["embeddings"].float(), dim=1)
    sigma = float(json.loads((run / "index" / "manifest.json").read_text())["temperature"])
    v = Votes(rows, bank["labels"], sigma)
    q = rows[:1].repeat(batch, 1)  # the load sends one image: a batch of the same query

    def median_us(between=None) -> float:
        for _ in range(20):
            v.exact(q)
        ts = []
        for _ in range(calls):
            if between is not None:
                between()
            t = time.perf_counter()
            v.exact(q)
            ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6

    import numpy as np

    junk = np.ones(FLUSH_MB << 18, np.float32)  # (FLUSH_MB MB)

    cpus = sorted(os.sched_getaffinity(0))
    mine, others = cpus[0], cpus[1:]
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {mine})
    try:
        alone = median_us()
        # FLUSH_MB streamed through the caches before each call, as a batch's other work
        # (the forward's activations, decoding, the front beside) does in service
        flushed = median_us(lambda: np.add(junk, 1.0, out=junk))
        ctx = mp.get_context("fork")
        stop = ctx.Event()
        hogs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in others]
        for h, cpu in zip(hogs, others, strict=True):
            h.start()
            os.sched_setaffinity(h.pid, {cpu})
        try:
            busy = median_us() if hogs else None
        finally:
            stop.set()
            for h in hogs:
                h.join(timeout=10)
    finally:
        os.sched_setaffinity(0, old)
    return {
        "batch": batch,
        "rows": int(rows.shape[0]),
        "alone_us": alone,
        "flushed_us": flushed,
        "flush_mb": FLUSH_MB,
        "busy_us": busy,
    }


def main() -> int:
    ap = parser(__doc__, port=8941, seconds=8.0)
    ap.add_argument("--prepare", action="store_true", help="train the tiny conv4 bench run first")
    ap.add_argument("--model", default=str(RUNS["conv4"]), help="run dir with an index")
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[4, 16, 64], help="keep-alive connections"
    )
    ap.add_argument("--vote-calls", type=int, default=300, help="timed calls of the vote alone")
    a = ap.parse_args()
    if a.seconds <= 0 or min(a.concurrency) < 1 or a.vote_calls < 1:
        ap.error("--seconds, --concurrency and --vote-calls must be positive")
    if a.prepare:
        prepare(["conv4"])
    run = Path(a.model).resolve()
    if not (run / "index" / "manifest.json").is_file():
        ap.error(f"{run} has no index: run with --prepare (the conv4 bench run) or give one")
    data = run / "bench-model-phases"
    shutil.rmtree(data, ignore_errors=True)
    print(f"starting the service on {run.name}", flush=True)
    p = serve(run, a.port, 64, data)
    rows = []
    try:
        req = request_bytes("127.0.0.1", a.port, query_png())
        with mp.get_context("spawn").Pool(1) as pool:
            pool.apply(load_level, (("127.0.0.1", a.port, req, max(a.concurrency), 2.0),))
            for conc in a.concurrency:
                r = level(pool, p, a.port, req, conc, a.seconds)
                rows.append(r)
                ph = r["phases_us_per_request"]
                print(
                    f"{conc:3d} connections: {r['rps']:6.0f}/s, batch {r['mean_batch']:5.1f}, "
                    f"model process {r['model_process_cpu_us']:4.0f} us/request (front "
                    f"{r['front_cpu_us']:.0f}): "
                    + ", ".join(f"{k} {v:.0f}" for k, v in ph.items())
                    + f"; the vote {r['vote_us_per_batch']:.0f} us a batch",
                    flush=True,
                )
    finally:
        p.terminate()
        p.wait(timeout=60)
        shutil.rmtree(data, ignore_errors=True)
    alone = []
    if (run / "memory.safetensors").is_file():
        for r in rows:
            b = max(1, round(r["mean_batch"]))
            x = vote_alone(run, b, a.vote_calls)
            alone.append(x)
            busy = "" if x["busy_us"] is None else f", {x['busy_us']:.0f} us beside a busy loop"
            print(
                f"the vote out of service, a batch of {b} ({x['rows']} rows): "
                f"{x['alone_us']:.0f} us alone, {x['flushed_us']:.0f} us after {FLUSH_MB} MB "
                f"streamed through the caches{busy}; in service {r['vote_us_per_batch']:.0f} "
                "(its world check included)",
                flush=True,
            )
    write_report(a.json, {"levels": rows, "vote_alone": alone, "run": str(run)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
