"""Before and after `snca-gallery learn`, over HTTP (issue 52): a model trained on base classes
serves its gallery; K training images of each held-out class are registered through
/gallery/add; the generalized few-shot protocol (novel and base test images through /classify:
top-1 of the nearest label, novel and base, their harmonic mean H; and the share named right,
an unknown counting as wrong) is measured; then `snca-gallery learn` runs beside the server
(timed, each of its steps), and the protocol again on a server of the learned model.

    python benchmarks/learn_loop.py runs/base7-269 --novel 2,6,9 --shots 50 --draws 2 \\
        --json docs/learn_loop.json

The run needs its index dir. Each draw learns a model of its own (minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.novel_split import NovelSplit, parser, png
from tests.service.helpers import Server


def protocol(url: str, test, nq, bq, names_of) -> dict:
    """The generalized few-shot protocol through /classify: nearest-label top-1 on the novel
    and base queries, H, and the share named right (unknown: wrong)."""
    with httpx.Client(base_url=url, timeout=60) as c:

        def ask(i):
            img = png(test, i)
            return c.post("/classify", files={"image": ("q.png", img)}).json()

        an, ab = [ask(i) for i in nq], [ask(i) for i in bq]
    truth_n = [names_of(test.targets[i]) for i in nq]
    truth_b = [names_of(test.targets[i]) for i in bq]
    nov = float(np.mean([x["nearest_label"] == t for x, t in zip(an, truth_n, strict=True)]))
    base = float(np.mean([x["nearest_label"] == t for x, t in zip(ab, truth_b, strict=True)]))
    named_n = float(np.mean([x["label"] == t for x, t in zip(an, truth_n, strict=True)]))
    named_b = float(np.mean([x["label"] == t for x, t in zip(ab, truth_b, strict=True)]))
    h = 2 * nov * base / max(nov + base, 1e-12)
    return {"novel": nov, "base": base, "h": h, "novel_named": named_n, "base_named": named_b}


def main() -> int:
    ap = parser(__doc__, shots=50, draws=1, queries="novel and base test queries each")
    ap.add_argument("--epochs", type=int, default=3, help="snca-gallery learn --epochs")
    ap.add_argument("--balance", type=float, help="snca-gallery learn --balance")
    ap.add_argument("--keep", type=Path, help="keep each draw's data dir and learned run here")
    a = ap.parse_args()
    split = NovelSplit.of(a)
    novel, train, test, rng = split.novel, split.train, split.test, split.rng
    nq, bq = split.queries(a.queries)

    def names_of(t):
        n = test.class_names[int(t)]
        return f"new:{n}" if int(t) in novel else n

    rows = []
    for draw in range(a.draws):
        where = Path(tempfile.mkdtemp(prefix="learn-loop-", dir=a.keep))
        data, out = where / "data", where / "learned"
        srv = Server(a.run, data, {"SNCA_FUSED_BATCHES": "0"}, timeout=600)
        try:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                for cls in novel:
                    pick = rng.choice(np.nonzero(train.targets == cls)[0], a.shots, replace=False)
                    files = [("images", (f"{i}.png", png(train, i)))
                             for i in pick]  # fmt: skip
                    r = c.post("/gallery/add", data={"label": f"new:{train.class_names[cls]}"},
                               files=files)  # fmt: skip
                    assert r.status_code == 201, r.text
            before = protocol(srv.url, test, nq, bq, names_of)
            print(f"draw {draw + 1} before: {_line(before)}", flush=True)
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "service.tools.gallery_tool", "learn", "--model",
                   str(a.run), "--data-dir", str(data), "--out", str(out), "--epochs",
                   str(a.epochs), "--no-progress"]  # fmt: skip
            cmd += [] if a.balance is None else ["--balance", str(a.balance)]
            p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
            took = time.monotonic() - t0
            if p.returncode != 0:
                print(p.stdout[-3000:], p.stderr[-3000:])
                raise SystemExit(f"learn failed ({p.returncode})")
            steps = json.loads((out / "learn.json").read_text()).get("seconds", {})
            print(f"draw {draw + 1} learn: {took:.0f} s ({steps})", flush=True)
        finally:
            srv.kill(15)
        st = json.loads((out / "learn.json").read_text())
        after = None
        if st.get("switched"):
            srv = Server(a.run, data, {"SNCA_FUSED_BATCHES": "0"}, "--follow-alias", timeout=600)
            try:
                after = protocol(srv.url, test, nq, bq, names_of)
            finally:
                srv.kill(15)
            print(f"draw {draw + 1} after:  {_line(after)}", flush=True)
        else:
            print(f"draw {draw + 1}: not switched ({st['compared']})", flush=True)
        rows.append({"before": before, "after": after, "learn_seconds": round(took, 1),
                     "steps": steps, "compared": st["compared"], "switched": st.get("switched")})  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"run": str(a.run), "shots": a.shots, "epochs": a.epochs,
                                      "novel": novel, "draws": rows}, indent=2) + "\n")  # fmt: skip
    return 0


def _line(r: dict) -> str:
    return (f"novel {100 * r['novel']:.1f}% base {100 * r['base']:.1f}% H {r['h']:.3f} "
            f"(named right: novel {100 * r['novel_named']:.1f}%, base {100 * r['base_named']:.1f}%)")  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
