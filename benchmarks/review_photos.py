"""The review queue and propagation on real photographs (issue 43) with the pretrained photo
model served with nothing trained (issue 41): two objects registered (5 crops each), three
others arriving as queries (20 crops each, with 20 of each registered object), queue on, the
service's defaults (its app in this process).

- the queue: which queries it kept; GET /review's groups: purity; a person naming the biggest
  group after the object most of it is (whole groups, as the page does) until 95 % of the
  unregistered objects' queries carry their name: decisions vs one image at a time;
- propagation: 5 crops of one of the three registered, its suggestions' top 20 among the
  queued queries and the gallery: precision and recall.
Photographs: scikit-image's (benchmarks/pretrained_photos.py's objects and crops).

    python benchmarks/review_photos.py RUN [--json docs/review_photos.json]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pretrained_photos import OBJECTS, crops, photo
from embedding.thumbnails import make_thumbnail
from tests.service.helpers import make_client

REGISTERED = ("cup", "cat")


def thumb_key(data: bytes) -> str:
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (192, 192))
        return hashlib.sha256(make_thumbnail(img, 96)).hexdigest()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("run", type=Path)
    ap.add_argument("--queries", type=int, default=20, help="crops of each object queried")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    names = list(OBJECTS)
    imgs = {n: photo(OBJECTS[n][0]) for n in names}
    box = {n: OBJECTS[n][1] for n in names}
    out: dict = {"objects": names, "registered": list(REGISTERED)}
    with (
        tempfile.TemporaryDirectory() as d,
        make_client(a.run, Path(d) / "data", review_queue=True) as c,
    ):
        for n in REGISTERED:
            files = [
                ("images", (f"{i}.jpg", b)) for i, b in enumerate(crops(imgs[n], 5, 1, box[n]))
            ]
            assert c.post("/gallery/add", data={"label": n}, files=files).status_code == 201
        truth = {}
        for n in names:
            for b in crops(imgs[n], a.queries, 7, box[n], hard=True):
                r = c.post("/classify", files={"image": ("q.jpg", b)}).json()
                truth[thumb_key(b)] = (n, r["unknown"], r["label"])
        c.app.state.review.flush()
        body = c.get("/review", params={"limit": 2000, "sample": 1}).json()
        qtruth = {}
        for g in body["groups"]:
            for qid in g["ids"]:
                t = c.get(f"/review/items/{qid}/thumbnail").content
                qtruth[qid] = truth.get(hashlib.sha256(t).hexdigest(), ("?",))[0]
        unseen = [n for n in names if n not in REGISTERED]
        out["queued"] = dict(Counter(qtruth.values()))
        out["queried"] = {n: a.queries for n in names}
        sizes, pur = [], []
        for g in body["groups"]:
            k = Counter(qtruth[i] for i in g["ids"])
            sizes.append(g["size"])
            pur.append(k.most_common(1)[0][1] / g["size"])
        out["groups"] = sizes
        out["purity_weighted"] = sum(s * p for s, p in zip(sizes, pur, strict=True)) / max(
            sum(sizes), 1
        )
        # propagation: 5 crops of one unseen object registered, its suggestions' top 20
        target = unseen[0]
        files = [
            ("images", (f"{i}.jpg", b))
            for i, b in enumerate(crops(imgs[target], 5, 3, box[target]))
        ]
        assert c.post("/gallery/add", data={"label": target}, files=files).status_code == 201
        got = c.get("/gallery/suggestions", params={"label": target, "limit": 20}).json()[
            "suggestions"
        ]
        right = sum(s["kind"] == "queued" and qtruth.get(s["id"]) == target for s in got)
        have = sum(v == target for v in qtruth.values())
        out["propagation"] = {"label": target, "top": len(got), "right": right,
                              "queued_of_label": have, "precision": right / max(len(got), 1),
                              "recall": right / max(min(have, len(got)), 1)}  # fmt: skip
        # decisions: name the biggest group after its majority until 95 % of the queued
        # unseen queries carry their name (the registered one's own queries included)
        total = sum(v in unseen for v in qtruth.values())
        right = decisions = 0
        while right < 0.95 * total:
            groups = c.get("/review", params={"limit": 2000, "sample": 1}).json()["groups"]
            if not groups:
                break
            g = groups[0]
            top, n = Counter(qtruth[i] for i in g["ids"]).most_common(1)[0]
            if top in unseen:
                c.post("/review/name", json={"ids": g["ids"], "label": top})
                right += n
            else:
                c.post("/review/dismiss", json={"ids": g["ids"]})
            decisions += 1
        out["decisions"] = {"queued_unseen": total, "labelled_right": right,
                            "decisions": decisions, "one_at_a_time": int(-(-0.95 * total // 1))}  # fmt: skip
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
