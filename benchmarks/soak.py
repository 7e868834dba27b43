"""Soak: sustained /classify load at a fixed fraction of the measured saturation rate, on
loopback, for a bounded time; stops by itself.

    python benchmarks/soak.py                         # conv4 bench run, 50% of saturation, 5 min
    python benchmarks/soak.py --minutes 10 --fraction 0.5 --json docs/soak.json

A fresh `python -m service` process; saturation measured first (16 keep-alive clients, 10 s);
then an open-loop load generator in a separate process (arrivals not paced by answers) at
`fraction` x saturation, in windows of `--window` seconds; after each window the server's RSS.
Passes (exit 0) when there were no errors, every window's p99 is within 2x of the first
window's, and RSS grew by less than `--rss-mb` from the end of the first window to the end.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from service_load import RUNS, load_level, open_loop, request_bytes, serve  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--run",
        type=Path,
        default=RUNS["conv4"],
        help="run dir with an index (service_load.py --prepare)",
    )
    ap.add_argument(
        "--minutes", type=float, default=5.0, help="load time after saturation, at most 10"
    )
    ap.add_argument("--fraction", type=float, default=0.5, help="of the saturation rate")
    ap.add_argument("--window", type=float, default=30.0, help="seconds per measurement window")
    ap.add_argument("--rss-mb", type=float, default=50.0, help="allowed RSS growth")
    ap.add_argument("--port", type=int, default=8791)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if not 0 < a.minutes <= 10 or not 0 < a.fraction <= 1:
        print("soak: error: --minutes must be in (0, 10] and --fraction in (0, 1]", file=sys.stderr)
        return 2
    import io

    import numpy as np
    from PIL import Image

    from embedding.datasets import load_raw

    raw = load_raw("fashion-mnist", "test")
    buf = io.BytesIO()
    Image.fromarray(raw.source.get(0)[0].numpy()).save(buf, "PNG")
    req = request_bytes("127.0.0.1", a.port, buf.getvalue())
    with tempfile.TemporaryDirectory() as tmp:
        proc = serve(a.run, a.port, 64, Path(tmp) / "serve")
        try:
            ctx = mp.get_context("spawn")
            with ctx.Pool(1) as pool:
                sat = pool.apply(load_level, (("127.0.0.1", a.port, req, 16, 10.0),))
                rate = sat["rps"] * a.fraction
                print(
                    f"saturation {sat['rps']:.0f} req/s; soaking at {rate:.0f} req/s for {a.minutes} min",
                    flush=True,
                )
                windows = []
                t_end = time.monotonic() + 60 * a.minutes
                while time.monotonic() < t_end:
                    w = pool.apply(open_loop, (("127.0.0.1", a.port, req, rate, a.window),))
                    w["rss_mb"] = rss_mb(proc.pid)
                    windows.append(w)
                    print(
                        f"window {len(windows)}: {w['rps']:.0f} req/s, p50 {w['p50_ms']:.2f} ms, "
                        f"p99 {w['p99_ms']:.2f} ms, errors {w['errors']}, RSS {w['rss_mb']:.0f} MB",
                        flush=True,
                    )
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    p99 = np.array([w["p99_ms"] for w in windows])
    errors = sum(w["errors"] for w in windows)
    growth = windows[-1]["rss_mb"] - windows[0]["rss_mb"]
    ok = errors == 0 and float(p99.max()) <= 2 * float(p99[0]) and growth < a.rss_mb
    result = {
        "run": str(a.run),
        "saturation_rps": sat["rps"],
        "fraction": a.fraction,
        "minutes": a.minutes,
        "windows": windows,
        "requests": int(sum(w["requests"] for w in windows)),
        "errors": errors,
        "p99_first_ms": float(p99[0]),
        "p99_max_ms": float(p99.max()),
        "rss_growth_mb": growth,
        "rss_bound_mb": a.rss_mb,
        "passed": ok,
    }
    print(
        f"{'PASSED' if ok else 'FAILED'}: {result['requests']} requests, {errors} errors, p99 "
        f"{p99[0]:.2f} -> max {p99.max():.2f} ms, RSS growth {growth:+.1f} MB (bound {a.rss_mb})"
    )
    if a.json:
        a.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
