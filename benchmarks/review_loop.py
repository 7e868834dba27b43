"""People in the loop, measured (issue 43), over HTTP against a real snca-serve with the review
queue on and the service's defaults: a model trained on base classes, three classes it never
saw arriving as queries.

Per draw of the shots (K training images of each held-out class registered through
POST /gallery/add):
- traffic: `--traffic` queries of the held-out classes and as many of the base classes (from
  one half of the test split) classified; the service queues what it cannot name;
- before: the generalized few-shot protocol of issue 28 on the other half of the test split
  (`--queries` novel and base queries through POST /classify): novel top-1, base top-1, their
  harmonic mean (HM);
- the loop, as a person does it: each held-out label's suggestions
  (GET /gallery/suggestions, the top 100) looked at, the right ones accepted (the
  queued queries through POST /review/name, the gallery's items through POST /gallery/relabel:
  one write each);
- after: the same protocol again, on the same held-out half (never seen by the loop);
- with `--learn EPOCHS`, the loop's last step: `snca-gallery learn` on that gallery (the shots,
  the accepted queries, the trained items), and, when it switched, the protocol a third time on
  the learned model (a server following the alias).
On the first draws (`--decisions`), before the loop, on the queue as it is: the precision and
recall of the top 100 suggestions of each held-out label among the queued queries and the
gallery; then a person naming GET /review's groups (the biggest first, named after the class
most of it is; a group mostly of a base class is dismissed), once naming whole groups (the
page) and once leaving out the members that are not of it (the API): how many decisions label
95 % of the queued held-out queries correctly, against one image at a time, and the groups'
purity. That part consumes the queue, so it runs on servers of their own.

Which queued query was which test image: the queue keeps a thumbnail, and a 28 x 28 image's
thumbnail is the image itself (re-encoded): matched by bytes.

    python benchmarks/review_loop.py runs/base7 --novel 2,6,9 --draws 10 --json docs/review_loop.json
    python benchmarks/review_loop.py runs/base7 --novel 2,6,9 --draws 3 --decisions 0 --learn 3 \
        --json docs/review_learn_loop.json
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.novel_split import NovelSplit, parser, png
from embedding.thumbnails import make_thumbnail
from tests.service.helpers import Server

TARGET = 0.95


class Session:
    """One server, one draw of the shots."""

    def __init__(self, c: httpx.Client, test, novel: list[int]):
        self.c, self.test, self.novel = c, test, novel
        self.label_of = {cls: f"new:{test.class_names[cls]}" for cls in novel}

    def register(self, shots: dict, train) -> None:
        """The draw's shots of each held-out class, through POST /gallery/add."""
        for cls, pick in shots.items():
            files = [("images", (f"{i}.png", png(train, i)))
                     for i in pick]  # fmt: skip
            r = self.c.post("/gallery/add", data={"label": self.label_of[cls]}, files=files)
            assert r.status_code == 201, r.text

    def png(self, i: int) -> bytes:
        return png(self.test, i)

    def truth(self, i: int) -> str:
        cls = int(self.test.targets[i])
        return self.label_of.get(cls, self.test.class_names[cls])

    def classify(self, idx) -> list[dict]:
        return [
            self.c.post("/classify", files={"image": ("q.png", self.png(i))}).json() for i in idx
        ]

    def protocol(self, nq, bq) -> dict:
        an, ab = self.classify(nq), self.classify(bq)
        hit = lambda xs, idx: float(  # noqa: E731
            np.mean([x["nearest_label"] == self.truth(i) for x, i in zip(xs, idx, strict=True)])
        )
        nov, base = hit(an, nq), hit(ab, bq)
        return {
            "novel": nov,
            "base": base,
            "hm": 2 * nov * base / max(nov + base, 1e-12),
            "novel_unknown": float(np.mean([x["unknown"] for x in an])),
        }

    def settle_queue(self) -> tuple[int, int]:
        """(rows, bytes) of the queue once its writer wrote everything (the count stops)."""
        last, body = -1, {"queued": 0, "bytes": 0}
        for _ in range(60):
            body = self.c.get("/review", params={"limit": 1}).json()
            if body["queued"] == last:
                break
            last = body["queued"]
            time.sleep(0.7)
        return body["queued"], body["bytes"]

    def queue_truth(self, traffic) -> dict[int, str]:
        """queued id -> the true label of the traffic image it was (by thumbnail bytes)."""
        by_thumb = {}
        for i in traffic:
            with Image.open(io.BytesIO(self.png(i))) as img:
                t = make_thumbnail(img, 96)
            by_thumb.setdefault(hashlib.sha256(t).hexdigest(), self.truth(i))
        out = {}
        body = self.c.get("/review", params={"limit": 2000, "sample": 1}).json()
        for g in body["groups"]:
            for qid in g["ids"]:
                t = self.c.get(f"/review/items/{qid}/thumbnail").content
                out[qid] = by_thumb.get(hashlib.sha256(t).hexdigest(), "?")
        return out

    def suggestions(self, label: str) -> list[dict]:
        r = self.c.get("/gallery/suggestions", params={"label": label, "limit": 100})
        return r.json()["suggestions"]

    def loop(self, truth: dict[int, str]) -> dict:
        """Each held-out label's top-100 suggestions; the right ones accepted."""
        accepted = {}
        for label in self.label_of.values():
            got = self.suggestions(label)
            q = [s["id"] for s in got if s["kind"] == "queued" and truth.get(s["id"]) == label]
            if q:
                r = self.c.post("/review/name", json={"ids": q, "label": label})
                assert r.status_code == 201, r.text
            accepted[label] = len(q)
        return accepted

    def propagation(self, truth: dict[int, str]) -> dict:
        """Precision and recall of each held-out label's top 100 suggestions."""
        out = {}
        for label in self.label_of.values():
            got = self.suggestions(label)
            right = sum(s["kind"] == "queued" and truth.get(s["id"]) == label for s in got)
            have = sum(v == label for v in truth.values())
            out[label] = {
                "suggested": len(got),
                "queued_of_label": have,
                "precision": right / max(len(got), 1),
                "recall": right / max(min(have, 100), 1),
            }
        return out

    def decisions(self, truth: dict[int, str], untick: bool) -> dict:
        """A person naming GET /review's groups, biggest first, until 95 % of the queued
        held-out queries carry their label (or no group is left). Each group is named after
        the class most of it is (a group mostly of base classes is dismissed); `untick`: the
        person leaves out the members that are not of it (the API names any subset; the page
        names the whole group), which stay queued and are grouped again."""
        novel_labels = set(self.label_of.values())
        total = sum(v in novel_labels for v in truth.values())
        right = wrong = named = dismissed = 0
        sizes, purities, curve = [], [], []
        for _ in range(500):
            if right >= TARGET * total:
                break
            groups = self.c.get("/review", params={"limit": 2000, "sample": 1}).json()["groups"]
            if not groups:
                break
            g = groups[0]
            kinds = Counter(truth.get(i, "?") for i in g["ids"])
            top, n = kinds.most_common(1)[0]
            sizes.append(g["size"])
            purities.append(n / g["size"])
            if top in novel_labels:
                ids = [i for i in g["ids"] if truth.get(i) == top] if untick else g["ids"]
                r = self.c.post("/review/name", json={"ids": ids, "label": top})
                assert r.status_code == 201, r.text
                right += n
                wrong += len(ids) - n
                named += 1
            else:
                self.c.post("/review/dismiss", json={"ids": g["ids"]})
                dismissed += 1
            curve.append(round(right / max(total, 1), 4))
        weighted = float(np.average(purities, weights=sizes)) if sizes else None
        return {
            "untick": untick,
            "queued_novel": total,
            "labelled_right": right,
            "labelled_wrong": wrong,
            "reached": right >= TARGET * total,
            "decisions": named + dismissed,
            "groups_named": named,
            "groups_dismissed": dismissed,
            "one_at_a_time": int(np.ceil(TARGET * total)),
            "share_labelled_after_each": curve,
            "purity_weighted": weighted,
            "purity_min": float(min(purities)) if purities else None,
            "group_sizes": sizes,
        }


def main() -> int:
    ap = parser(__doc__, shots=5, draws=10, queries="evaluation queries: novel and base")
    ap.add_argument("--traffic", type=int, default=300, help="traffic queries: novel and base")
    ap.add_argument("--decisions", type=int, default=1, help="draws that also measure decisions")
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server")
    ap.add_argument("--learn", type=int, metavar="EPOCHS", help="then snca-gallery learn, measured")
    a = ap.parse_args()
    split = NovelSplit.of(a)
    novel, train, test, rng = split.novel, split.train, split.test, split.rng
    order = rng.permutation(len(test.targets))
    half = len(order) // 2
    pool_t, pool_e = order[:half], order[half:]  # traffic, evaluation: disjoint
    is_novel, is_base = np.isin(test.targets, novel), split.is_base()
    traffic = np.concatenate(
        [pool_t[is_novel[pool_t]][: a.traffic], pool_t[is_base[pool_t]][: a.traffic]]
    )
    nq, bq = pool_e[is_novel[pool_e]][: a.queries], pool_e[is_base[pool_e]][: a.queries]
    env = {"SNCA_FUSED_BATCHES": "0", "SNCA_REVIEW_QUEUE": "1"}
    env.update(dict(kv.split("=", 1) for kv in a.env))
    rows = []
    for draw in range(a.draws):
        shots = {cls: rng.choice(np.nonzero(train.targets == cls)[0], a.shots, replace=False)
                 for cls in novel}  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            srv = Server(a.run, Path(d) / "data", env, timeout=300)
            try:
                c = httpx.Client(base_url=srv.url, timeout=120)
                s = Session(c, test, novel)
                s.register(shots, train)
                t0 = time.time()
                s.classify(traffic)
                queued, size = s.settle_queue()
                truth = s.queue_truth(traffic)
                before = s.protocol(nq, bq)
                row = {"draw": draw, "queued": queued, "queue_bytes": size, "before": before}
                row["queued_novel"] = sum(v in s.label_of.values() for v in truth.values())
                row["traffic_novel"] = len(traffic) // 2
                if draw < a.decisions:
                    row["propagation"] = s.propagation(truth)
                accepted = s.loop(truth)
                row["accepted"] = accepted
                row["after"] = s.protocol(nq, bq)
                row["seconds"] = time.time() - t0
                if a.learn:
                    row["learn"] = _learn(a.run, Path(d), a.learn)
            finally:
                srv.kill(15)
            if row.get("learn", {}).get("switched"):
                srv = Server(a.run, Path(d) / "data", env, "--follow-alias", timeout=600)
                try:
                    c = httpx.Client(base_url=srv.url, timeout=120)
                    row["learned"] = Session(c, test, novel).protocol(nq, bq)
                finally:
                    srv.kill(15)
            for untick in (False, True) if draw < a.decisions else ():
                # on a server of its own: it consumes the queue
                srv = Server(a.run, Path(d) / f"data-{untick}", env, timeout=300)
                try:
                    c = httpx.Client(base_url=srv.url, timeout=120)
                    s = Session(c, test, novel)
                    s.register(shots, train)
                    s.classify(traffic)
                    s.settle_queue()
                    key = "decisions_untick" if untick else "decisions"
                    row[key] = s.decisions(s.queue_truth(traffic), untick)
                finally:
                    srv.kill(15)
        rows.append(row)
        b, f = row["before"], row["after"]
        print(f"draw {draw + 1}: queued {row['queued']} ({row['queued_novel']} of "
              f"{row['traffic_novel']} held-out); before: novel {100 * b['novel']:.1f}% base "
              f"{100 * b['base']:.1f}% HM {b['hm']:.3f}; accepted {sum(accepted.values())}; "
              f"after: novel {100 * f['novel']:.1f}% base {100 * f['base']:.1f}% HM "
              f"{f['hm']:.3f}", flush=True)  # fmt: skip
        if "learn" in row:
            lr = row.get("learned")
            print(f"  learn: {row['learn']['seconds']:.0f} s, switched {row['learn']['switched']}"
                  + (f"; learned: novel {100 * lr['novel']:.1f}% base {100 * lr['base']:.1f}% "
                     f"HM {lr['hm']:.3f}" if lr else f" ({row['learn']['compared']})"),
                  flush=True)  # fmt: skip
        for key in ("decisions", "decisions_untick", "propagation"):
            if key in row:
                print(f"  {key}:", json.dumps(row[key]), flush=True)
    summary = {}
    for when in ("before", "after", "learned"):
        if not all(when in r for r in rows):
            continue  # (learned: only where learn switched)
        hms = [r[when]["hm"] for r in rows]
        summary[when] = {
            "hm_mean": float(np.mean(hms)),
            "hm_worst": float(np.min(hms)),
            "novel_mean": float(np.mean([r[when]["novel"] for r in rows])),
            "base_mean": float(np.mean([r[when]["base"] for r in rows])),
            "base_worst": float(np.min([r[when]["base"] for r in rows])),
        }
        print(f"{when}: HM mean {summary[when]['hm_mean']:.3f} worst "
              f"{summary[when]['hm_worst']:.3f}; novel {100 * summary[when]['novel_mean']:.1f}% "
              f"base {100 * summary[when]['base_mean']:.1f}% (worst "
              f"{100 * summary[when]['base_worst']:.1f}%)")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"args": vars(a) | {"run": str(a.run), "json": str(a.json)},
                                      "draws": rows, "summary": summary}, indent=2))  # fmt: skip
    return 0


def _learn(run: Path, where: Path, epochs: int) -> dict:
    """snca-gallery learn on the draw's gallery, the server running: its learn.json."""
    out = where / "learned"
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "service.tools.gallery_tool", "learn", "--model", str(run),
           "--data-dir", str(where / "data"), "--out", str(out), "--epochs", str(epochs),
           "--no-progress"]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        print(p.stdout[-3000:], p.stderr[-3000:])
        raise SystemExit(f"learn failed ({p.returncode})")
    st = json.loads((out / "learn.json").read_text())
    return {"seconds": time.monotonic() - t0, "switched": bool(st.get("switched")),
            "compared": st.get("compared")}  # fmt: skip


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
