"""Does `confidence` mean what it says? (issue 53) Reliability of the answers' `confidence`
(the vote's probability of the label it names) on held-out queries.

- Fashion-MNIST: a model of 7 trained classes (runs/base7-*), its gallery as built, test-split
  queries of every class (the 3 held-out ones are what it should answer unknown or get wrong);
  then 5 images of each held-out class registered and the same queries again (a gallery of
  labels of very different sizes).
- Photos: the pretrained photo model with nothing trained, 5 photos of each category of
  benchmarks/category_photos.py registered, the other photos as queries (several draws).

Over the answers given (not unknown): the expected calibration error (10 equal-width bins),
accuracy against mean confidence per bin (the reliability diagram, written as a PNG), and the
spread of confidence among right answers (a constant confidence says nothing); the same for the
vote's own probability of the label (`nearest_probability`, what `confidence` was before issue
53) beside it.

    python benchmarks/confidence_calibration.py runs/base7-269 runs/photos-lite0 \\
        --json docs/confidence_calibration.json --png docs/figures/confidence_calibration.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def bins(conf: np.ndarray, right: np.ndarray, n: int = 10) -> list[dict]:
    idx = np.minimum((conf * n).astype(int), n - 1)
    out = []
    for b in range(n):
        m = idx == b
        if m.any():
            out.append({"bin": [b / n, (b + 1) / n], "answers": int(m.sum()),
                        "confidence": float(conf[m].mean()), "accuracy": float(right[m].mean())})  # fmt: skip
    return out


def ece(conf: np.ndarray, right: np.ndarray, n: int = 10) -> float:
    """Expected calibration error: |accuracy - mean confidence| of equal-width bins, weighted
    by their share of the answers."""
    return float(sum(b["answers"] * abs(b["accuracy"] - b["confidence"]) for b in bins(conf, right, n))
                 / max(len(conf), 1))  # fmt: skip


def summary(name: str, rows: list[tuple[float, bool, float]]) -> dict:
    conf = np.array([r[0] for r in rows])
    right = np.array([r[1] for r in rows], dtype=float)
    p1 = np.array([r[2] for r in rows])
    s = {
        "answers": len(rows),
        "accuracy": float(right.mean()) if len(rows) else None,
        "mean_confidence": float(conf.mean()) if len(rows) else None,
        "ece": ece(conf, right),
        "right_confidence_spread": float(np.std(conf[right == 1])) if right.any() else None,
        "bins": bins(conf, right),
        "vote_probability": {
            "mean": float(p1.mean()) if len(rows) else None,
            "ece": ece(p1, right),
            "bins": bins(p1, right),
        },
    }
    print(f"{name}: {s['answers']} answers, accuracy {100 * s['accuracy']:.1f}%, mean confidence "
          f"{100 * s['mean_confidence']:.1f}%; ECE {s['ece']:.3f}; std of the confidence of right "
          f"answers {s['right_confidence_spread']:.3f}; the vote's probability: mean "
          f"{100 * p1.mean():.1f}%, ECE {s['vote_probability']['ece']:.3f}", flush=True)  # fmt: skip
    return s


def answers(c, queries) -> list[tuple[float, bool, float]]:
    """(confidence, right, the vote's probability) of each answer given."""
    out = []
    for truth, img in queries:
        x = c.post("/classify", files={"image": ("q.png", img)}).json()
        if x["label"] is not None:
            out.append((x["confidence"], x["label"] == truth, x["nearest_probability"]))
    return out


def fashion(run: Path, n: int, seed: int) -> dict:
    from category_photos import _png

    from embedding.datasets import load_raw
    from embedding.rundir import RunDir
    from tests.service.helpers import make_client

    names = RunDir(run).load_model_card()[0].class_names
    test, train = load_raw("fashion-mnist", "test"), load_raw("fashion-mnist", "train")
    rng = np.random.default_rng(seed)
    pick = rng.permutation(len(test.targets))[:n]
    novel = sorted({int(t) for t in test.targets} - {test.class_names.index(x) for x in names})
    out = {}
    with tempfile.TemporaryDirectory() as d, make_client(run, Path(d) / "data") as c:

        def truth(i):
            name = test.class_names[int(test.targets[i])]
            return name if name in names else f"new:{name}"

        qs = [(truth(i), _png(test.source.get(int(i))[0].numpy())) for i in pick]
        known = [q for q in qs if not q[0].startswith("new:")]
        out["trained_known"] = summary("Fashion-MNIST, 7 trained labels, their queries",
                                       answers(c, known))  # fmt: skip
        out["trained"] = summary("Fashion-MNIST, 7 trained labels, all queries", answers(c, qs))
        for cls in novel:
            shots = rng.choice(np.nonzero(train.targets == cls)[0], 5, replace=False)
            files = [("images", (f"{i}.png", _png(train.source.get(int(i))[0].numpy())))
                     for i in shots]  # fmt: skip
            r = c.post("/gallery/add", data={"label": f"new:{train.class_names[cls]}"}, files=files)
            assert r.status_code == 201, r.text
        out["with_new"] = summary("Fashion-MNIST, + 3 labels of 5 images", answers(c, qs))
    return out


def photos(run: Path, draws: int, seed: int) -> dict:
    import category_photos as cp

    from tests.service.helpers import make_client

    cats, _ = cp.sets(cp.fetch())
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(draws):
        with tempfile.TemporaryDirectory() as d, make_client(run, Path(d) / "data") as c:
            qs = []
            for label, ph in cats.items():
                order = rng.permutation(len(ph))
                files = [("images", (f"{i}.img", ph[i])) for i in order[:5]]
                assert c.post("/gallery/add", data={"label": label}, files=files).status_code == 201
                qs += [(label, ph[i]) for i in order[5:]]
            rows += answers(c, qs)
    return {"categories": summary(f"photos of categories, 5 shots, {draws} draws", rows)}


def figure(path: Path, parts: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(parts), figsize=(4.2 * len(parts), 4.2), squeeze=False)
    for ax, (name, s) in zip(axes[0], parts.items(), strict=True):
        ax.plot([0, 1], [0, 1], ":", color="grey")
        b = s["bins"]
        ax.plot([x["confidence"] for x in b], [x["accuracy"] for x in b], "s-",
                label=f"confidence (ECE {s['ece']:.3f})")  # fmt: skip
        v = s["vote_probability"]
        ax.plot([x["confidence"] for x in v["bins"]], [x["accuracy"] for x in v["bins"]], "o--",
                alpha=0.6, label=f"vote's probability (ECE {v['ece']:.3f})")  # fmt: skip
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("confidence")
        ax.set_ylabel("accuracy")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fashion_run", type=Path, help="a model of 7 trained Fashion-MNIST classes")
    ap.add_argument("photo_run", type=Path, help="the pretrained photo model (make photos)")
    ap.add_argument("--queries", type=int, default=2000)
    ap.add_argument("--draws", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--png", type=Path)
    a = ap.parse_args(argv)
    res = {"fashion": fashion(a.fashion_run, a.queries, a.seed),
           "photos": photos(a.photo_run, a.draws, a.seed)}  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    if a.png:
        figure(a.png, {"Fashion-MNIST, 7 trained": res["fashion"]["trained_known"],
                       "their + 3 unseen classes": res["fashion"]["trained"],
                       "+ 3 labels of 5 images": res["fashion"]["with_new"],
                       "photos of categories": res["photos"]["categories"]})  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
