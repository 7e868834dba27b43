"""Memory and speed of a model process's forward against oneDNN's primitive cache (issue 42's
groundwork: a photo worker's model process held 5.6 GB after its warm-up).

    python benchmarks/kernel_cache.py RUN [--capacities default,0,256,1024] [--mixed 60]

RUN: a run dir (`make photos` makes runs/photos-lite0). For each ONEDNN_PRIMITIVE_CACHE_CAPACITY
(set before oneDNN starts, so each in a child process): the service's Embedder (optimized, world
statistics, 2 threads, glibc's freed memory kept as the service keeps it), every batch size
1..64 warmed as the service's start-up does, then the resident memory, the best ms per image
at batch sizes 1, 4, 16, 48, and the mean ms per image over `--mixed` batches of random sizes
1..64 (what a micro-batcher under varying load forms: primitives evicted and rebuilt show here).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(run: Path, mixed: int) -> dict:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from embedding.rundir import RunDir
    from embedding.sysalloc import keep_freed_memory
    from service.model.embedder import Embedder

    def rss_mb() -> float:
        with open("/proc/self/status") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024

    keep_freed_memory()  # as the model process does
    torch.set_num_threads(1)
    e = Embedder(RunDir(run).load_model(), torch.device("cpu"), world=True)
    e.optimize()
    e.warmup()
    torch.set_num_threads(2)
    x = torch.zeros(64, 3, e.model.config.image_size, e.model.config.image_size, dtype=torch.uint8)
    t0 = time.perf_counter()
    for b in range(1, 65):
        e.embed(x[:b])
    out = {"warmup_s": round(time.perf_counter() - t0, 1), "rss_mb": round(rss_mb())}
    for b in (1, 4, 16, 48):
        ts = []
        for _ in range(8 if b <= 4 else 3):
            t = time.perf_counter()
            e.embed(x[:b])
            ts.append(time.perf_counter() - t)
        out[f"ms_per_image_b{b}"] = round(1000 * min(ts) / b, 2)
    rng = np.random.default_rng(0)
    n = t = 0.0
    for b in rng.integers(1, 65, mixed):
        s = time.perf_counter()
        e.embed(x[: int(b)])
        t += time.perf_counter() - s
        n += int(b)
    out["ms_per_image_mixed"] = round(1000 * t / max(n, 1), 2)
    out["rss_mb_after_mixed"] = round(rss_mb())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path)
    ap.add_argument("--capacities", default="default,0,256,1024")
    ap.add_argument("--mixed", type=int, default=60, help="batches of random sizes 1..64")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.run, a.mixed)))
        return 0
    rows = []
    for cap in a.capacities.split(","):
        env = dict(os.environ)
        env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
        if cap != "default":
            env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = cap
        cmd = [sys.executable, __file__, str(a.run), "--mixed", str(a.mixed), "--child"]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        r = {"capacity": cap, **json.loads(p.stdout.strip().splitlines()[-1])}
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
