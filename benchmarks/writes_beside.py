"""Writes beside classify load, served (issue 55, point 4): a real server (front + model process)
takes `--connections` keep-alive clients of POST /classify (this project's load client) while a
few writers add one image a request to POST /gallery/add at `--write-rate` a second in all
(`--writers` connections, open loop each); classify/s,
writes acknowledged, and the CPU per classify of the front and of the whole service from /proc.
Against a worktree of another commit (`--base`), alternating rounds, so that both are measured
in one run on the same VM.

    git worktree add /tmp/base c9133b8
    python benchmarks/writes_beside.py --model runs/demo --base /tmp/base --rounds 3

The model must hold a gallery of the size that matters (make run's 55,000 items: the vote reads
every row on the dense path); each round starts each tree's server on a fresh data dir.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import benchmarks.service_load as sl  # noqa: E402
from benchmarks.command_line import parser, write_report  # noqa: E402
from benchmarks.image_body import front, medians, service  # noqa: E402


def writer(url: str, png: bytes, rate: float, stop: threading.Event, out: dict) -> None:
    """One add of one image every 1/rate s (open loop: a late one is sent at once); its own
    tally in `out`."""
    with httpx.Client(base_url=url, timeout=30) as c:
        due = time.perf_counter()
        while not stop.is_set():
            r = c.post("/gallery/add", data={"label": "written"}, files={"images": ("w.png", png)})
            out["ok" if r.status_code == 201 else "failed"] += 1
            due += 1.0 / rate
            time.sleep(max(0.0, due - time.perf_counter()))


def one(pool, tree: Path, run: Path, port: int, a, req: bytes, png: bytes) -> dict:
    """A fresh server of `tree` on a fresh data dir: classify load with writes beside."""
    with tempfile.TemporaryDirectory() as d:
        proc = sl.serve(run, port, 64, Path(d) / "data", cwd=tree)
        try:
            pool.apply(sl.load_level, (("127.0.0.1", port, req, a.connections, 2.0),))  # warm-up
            tallies = [{"ok": 0, "failed": 0} for _ in range(a.writers)]
            stop = threading.Event()
            url, rate = f"http://127.0.0.1:{port}", a.write_rate / a.writers
            ws = [
                threading.Thread(target=writer, args=(url, png, rate, stop, t))
                for t in (tallies if a.write_rate > 0 else [])
            ]
            for w in ws:
                w.start()
            args = ("127.0.0.1", port, req, a.connections, a.seconds)
            r = sl._with_cpu(pool, proc.pid, sl.load_level, args)
            stop.set()
            for w in ws:
                w.join()
            writes = {k: sum(t[k] for t in tallies) for k in ("ok", "failed")}
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return r | {"writes": writes}


def main() -> int:
    ap = parser(__doc__, seconds=15.0, rounds=3, port=8921)
    ap.add_argument("--model", required=True, type=Path, help="run dir with an index")
    ap.add_argument("--base", required=True, type=Path, help="a worktree of the other commit")
    ap.add_argument("--connections", type=int, default=16, help="classify clients (keep-alive)")
    ap.add_argument("--write-rate", type=float, default=100.0, help="adds a second (0: none)")
    ap.add_argument("--writers", type=int, default=8, help="connections sharing the write rate")
    a = ap.parse_args()
    if not (a.model / "index" / "manifest.json").is_file():
        ap.error(f"{a.model} has no index (python -m index_builder RUN --out RUN/index)")
    if not (a.base / "service").is_dir():
        ap.error(f"{a.base} is not a worktree of this project (git worktree add DIR COMMIT)")
    png = sl.query_png()
    req = sl.request_bytes("127.0.0.1", a.port, png)
    trees = {"this": ROOT, "base": a.base.resolve()}
    got: dict[str, list[dict]] = {k: [] for k in trees}
    with mp.get_context("spawn").Pool(1) as pool:
        for i in range(a.rounds):
            for who in ("this", "base") if i % 2 == 0 else ("base", "this"):
                r = one(pool, trees[who], a.model, a.port, a, req, png)
                got[who].append(r)
                print(f"round {i + 1} {who}: {r['rps']:.0f} classify/s, {r['errors']} errors, "
                      f"writes {r['writes']['ok']} ok / {r['writes']['failed']} failed; CPU "
                      f"us/classify: front {front(r):.0f}, service {service(r):.0f}",
                      flush=True)  # fmt: skip
    med = {
        who: medians(rs)
        | {"writes_per_s": statistics.median(r["writes"]["ok"] for r in rs) / a.seconds}
        for who, rs in got.items()
    }
    t, b = med["this"], med["base"]
    print(
        f"medians of {a.rounds}, {a.connections} connections, {a.write_rate:g} writes/s asked: "
        f"this {t['rps']:.0f} classify/s (service {t['service_cpu_us']:.0f} us, writes "
        f"{t['writes_per_s']:.0f}/s); base {b['rps']:.0f}/s (service {b['service_cpu_us']:.0f} "
        f"us, writes {b['writes_per_s']:.0f}/s); this/base {t['rps'] / b['rps']:.2f}x classify/s, "
        f"{t['service_cpu_us'] / b['service_cpu_us']:.2f}x CPU per classify"
    )
    write_report(a.json, {"args": vars(a), "median": med, "rounds": got}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
