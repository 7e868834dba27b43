"""A photo model process's memory and throughput, this tree against another commit's worktree,
alternating: a real snca-serve (front + model process, the deployed defaults: fused copies,
30 s of warm-up) on a pretrained photo model, four labels registered from five crops each of
scikit-image's photographs, then rounds of /classify from 1 to 64 connections at once (the
micro-batcher forms batches of every size up to what it may). Reported per side: how long the
start took, the model process's resident memory (VmRSS) after the start and after the load,
and photos/s over the load.

    python benchmarks/photo_memory.py /tmp/lite0 --base /tmp/wt_old --rounds 2

RUN: a photo model with an index (`snca-train --init pypi:efficientnet-lite0 --epochs 0 --out
RUN` then `snca-build-index RUN --out RUN/index`); --base: a worktree of the other commit
(`git worktree add /tmp/wt_old COMMIT`), run with this venv.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.command_line import parser, write_report  # noqa: E402

LEVELS = [1, 4, 16, 32, 64] + [random.Random(k).choice([2, 8, 24, 48, 64]) for k in range(6)]
PER_CLIENT = 12  # requests each connection sends at each level


def _rss_mb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) // 1024


def one(run: Path) -> dict:
    """In the tree at the working directory: start, register, load; the measurements."""
    import httpx

    sys.path.insert(0, os.getcwd())
    from tests.service.helpers import Server
    from tests.service.photos import crops, photo, png_bytes

    # the defaults (the test helper's Server turns these start-up steps off)
    env = {"SNCA_FUSED_BATCHES": "8", "SNCA_WARMUP_SECONDS": "30", "SNCA_BATCH_MIN_GAIN": "0.05"}
    t0 = time.monotonic()
    s = Server(run, Path(tempfile.mkdtemp()) / "data", env, model_process=True)
    out = {"start_s": time.monotonic() - t0}
    try:
        mp = httpx.get(s.url + "/readyz").json()["model_pid"]
        out["model_rss_after_start_mb"] = _rss_mb(mp)
        for name in ("coffee", "chelsea", "rocket", "astronaut"):
            shots = [
                ("images", (f"{i}.png", png_bytes(c)))
                for i, c in enumerate(crops(photo(name), 5, 1))
            ]
            r = httpx.post(s.url + "/gallery/add", data={"label": name}, files=shots, timeout=300)
            r.raise_for_status()
        queries = [png_bytes(c) for c in crops(photo("chelsea"), 8, 3)]

        def client() -> None:
            with httpx.Client(timeout=300) as c:
                for i in range(PER_CLIENT):
                    c.post(s.url + "/classify", files={"image": ("q.png", queries[i % 8])})

        t0, n = time.monotonic(), 0
        for conns in LEVELS:
            ts = [threading.Thread(target=client) for _ in range(conns)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            n += conns * PER_CLIENT
        out["photos_per_s"] = n / (time.monotonic() - t0)
        out["model_rss_after_load_mb"] = _rss_mb(mp)
        out["front_rss_after_load_mb"] = _rss_mb(s.proc.pid)
        for line in s.read_log().splitlines():
            if '"msg": "ready"' in line and '"max_batch"' in line:
                out["max_batch"] = json.loads(line)["max_batch"]
    finally:
        s.kill()
    return out


def main() -> int:
    ap = parser(__doc__, rounds=2)
    ap.add_argument("run", type=Path, help="a photo model's run dir with its index")
    ap.add_argument("--base", type=Path, required=True, help="a worktree of the other commit")
    ap.add_argument("--child", action="store_true", help="(internal) one measurement, as JSON")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.run.resolve())))
        return 0
    if not (a.run / "index" / "manifest.json").is_file():
        ap.error(f"{a.run} has no index (snca-build-index {a.run} --out {a.run}/index)")
    got: dict[str, list[dict]] = {"this": [], "base": []}
    for k in range(a.rounds):
        for side, tree in (("base", a.base), ("this", ROOT)):
            p = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), str(a.run.resolve()),
                 "--base", str(a.base), "--child"],
                cwd=tree, capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            if p.returncode != 0:
                sys.exit(f"{side} round {k + 1} failed:\n{p.stderr[-3000:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            got[side].append(r)
            print(f"round {k + 1} {side}: {r}", flush=True)
    med = {
        side: {key: statistics.median(r[key] for r in rs) for key in rs[0] if key != "max_batch"}
        for side, rs in got.items()
    }
    for side, m in med.items():
        print(
            f"{side}: start {m['start_s']:.1f} s, model process {m['model_rss_after_start_mb']:.0f}"
            f" MB after it, {m['model_rss_after_load_mb']:.0f} MB after the load, "
            f"{m['photos_per_s']:.1f} photos/s (medians of {a.rounds})"
        )
    write_report(a.json, {"median": med, "rounds": got, "levels": LEVELS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
