"""What one write costs a process that holds a dense gallery and votes on it (issue 55, point 4):
the write itself (Gallery.apply_add: rows, statistics, open-set recalibration) and the first
classify after it, which brings up to date what every unfiltered vote reads (the snapshot; kde's
one-hot and the label groups, kept write by write since service/gallery/label_tables.py; until
then made anew, with a contiguous copy of the transposed rows once a snapshot had served two
votes), against a classify with nothing changed.
Both processes of a worker (the front and its model process) hold the gallery, so at W writes/s
beside classify load each pays about W x (write + rebuild) of CPU a second.

    python benchmarks/write_cost.py --rows 55000 --labels 10 --batch 8

Random unit vectors stand in for embeddings (the cost depends on the sizes only). To compare two
commits, run this file from a worktree of each, alternating (docs/PERFORMANCE.md did).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gallery_scale import make_gallery


def measure(g, q, rounds: int, vote: str) -> dict:
    """ms: a classify with nothing changed; apply_add of one item; the first classify after."""
    for _ in range(3):
        g.classify(q, vote, 30)
    t = time.perf_counter()
    for _ in range(rounds):
        g.classify(q, vote, 30)
    steady = (time.perf_counter() - t) / rounds
    write = after = 0.0
    nid = int(g.rows.ids.max()) + 1 + g.version
    for _ in range(rounds):
        t0 = time.perf_counter()
        g.apply_add([nid], "c0", q[:1].copy(), g.version + 1)
        t1 = time.perf_counter()
        g.classify(q, vote, 30)
        t2 = time.perf_counter()
        write, after, nid = write + t1 - t0, after + t2 - t1, nid + 1
    return {
        "classify_ms": 1e3 * steady,
        "write_ms": 1e3 * write / rounds,
        "first_classify_ms": 1e3 * after / rounds,
        "rebuild_ms": 1e3 * (after / rounds - steady),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--rows", type=int, default=55000)
    ap.add_argument("--labels", type=int, default=10)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="queries per classify")
    ap.add_argument("--vote", default="kde_shrunk")
    ap.add_argument("--rounds", type=int, default=30, help="writes (and classifies) per round")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median is reported")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    emb = rng.standard_normal((a.rows, a.dim)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    labels = rng.integers(0, a.labels, a.rows)
    g = make_gallery(emb, labels, [f"c{i}" for i in range(a.labels)], exact_max=2 * a.rows)
    q = rng.standard_normal((a.batch, a.dim)).astype(np.float32)
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    runs = [measure(g, q, a.rounds, a.vote) for _ in range(a.repeats)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    per_s = 100 * (med["write_ms"] + med["rebuild_ms"]) / 1e3
    print(
        f"{a.rows} rows, {a.labels} labels, batch {a.batch}: classify {med['classify_ms']:.2f} ms; "
        f"a write {med['write_ms']:.2f} ms; the first classify after it "
        f"{med['first_classify_ms']:.2f} ms (rebuild {med['rebuild_ms']:.2f}); at 100 writes/s "
        f"beside classify load: {per_s:.2f} s of CPU a second per process",
        flush=True,
    )
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "runs": runs,
                                      "median": med}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
