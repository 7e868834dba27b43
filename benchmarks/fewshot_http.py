"""Generalized few-shot over HTTP with the service's defaults (issue 28, point 6): a model
trained on base classes serves its index; K training images of each held-out class are
registered through POST /gallery/add; novel and base test images are classified through
POST /classify. Top-1 on novel queries, on base queries, their harmonic mean; and how many of
each are answered unknown. Mean over draws of the shots.

    python benchmarks/fewshot_http.py runs/base7 --novel 2,6,9 --shots 5 --queries 600 --draws 3

The run needs its index dir (snca-build-index RUN --out RUN/index).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.command_line import write_report
from benchmarks.novel_split import NovelSplit, parser, png
from tests.service.helpers import Server


def main() -> int:
    ap = parser(__doc__, shots=5, draws=3, queries="novel and base test queries each")
    ap.add_argument("--vote", default=None, help="the /classify vote (default: the service's)")
    a = ap.parse_args()
    split = NovelSplit.of(a)
    novel, train, test, rng = split.novel, split.train, split.test, split.rng
    nq, bq = split.queries(a.queries)
    params = {"vote": a.vote} if a.vote else {}
    rows = []
    for draw in range(a.draws):
        with tempfile.TemporaryDirectory() as d:
            srv = Server(a.run, Path(d) / "data", {"SNCA_FUSED_BATCHES": "0"}, timeout=300)
            try:
                c = httpx.Client(base_url=srv.url, timeout=60)
                for cls in novel:
                    pick = rng.choice(np.nonzero(train.targets == cls)[0], a.shots, replace=False)
                    files = [("images", (f"{i}.png", png(train, i))) for i in pick]
                    r = c.post("/gallery/add", data={"label": f"new:{train.class_names[cls]}"},
                               files=files)  # fmt: skip
                    assert r.status_code == 201, r.text

                def ask(i, c=c):
                    img = png(test, i)
                    r = c.post("/classify", params=params, files={"image": ("q.png", img)})
                    return r.json()

                t0 = time.time()
                an = [ask(i) for i in nq]
                ab = [ask(i) for i in bq]
                nov = np.mean([x["nearest_label"] == f"new:{test.class_names[test.targets[i]]}"
                               for x, i in zip(an, nq, strict=True)])  # fmt: skip
                base = np.mean([x["nearest_label"] == test.class_names[test.targets[i]]
                                for x, i in zip(ab, bq, strict=True)])  # fmt: skip
                hm = 2 * nov * base / max(nov + base, 1e-12)
                row = {
                    "novel": float(nov),
                    "base": float(base),
                    "hm": float(hm),
                    "novel_unknown": float(np.mean([x["unknown"] for x in an])),
                    "base_unknown": float(np.mean([x["unknown"] for x in ab])),
                    "vote": an[0]["vote"],
                    "seconds": time.time() - t0,
                }
                rows.append(row)
                print(f"draw {draw + 1}: novel {100 * nov:.1f}% base {100 * base:.1f}% HM "
                      f"{hm:.3f} (unknown: novel {100 * row['novel_unknown']:.0f}%, base "
                      f"{100 * row['base_unknown']:.0f}%; vote {row['vote']})", flush=True)  # fmt: skip
            finally:
                srv.kill(15)
    m = {k: float(np.mean([r[k] for r in rows])) for k in ("novel", "base", "hm")}
    print(f"mean of {len(rows)} draws: novel {100 * m['novel']:.1f}% base {100 * m['base']:.1f}% "
          f"HM {m['hm']:.3f}")  # fmt: skip
    write_report(a.json, {"draws": rows, "mean": m})
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
