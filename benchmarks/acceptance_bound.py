"""How far can any acceptance rule go on a model's embedding? (issue 52)

Real photographs of categories (benchmarks/category_photos.py: Debian's gcompris-qt-data), five
of each registered, the rest queries; unrelated photos, paintings and Fashion-MNIST images as
what must stay unknown. Embedded once in-process with the served model's own forward (the
served embedding), then per draw of the five, offline:

- the ceiling of "named right": the share of queries whose nearest registered image is of their
  category (no acceptance rule names more than its vote's nearest label gets right);
- how well a query's similarity tells a category member from an unrelated image (AUROC, 0.5 =
  not at all), for the best cosine to the gallery and for the same cosine relative to the chosen
  label's own spread (its leave-one-out nearest-neighbour cosines: median and a pooled spread,
  the label's median shrunk toward the gallery's by its size, n / (n + 5));
- operating points: the fixed floor the service applies (best cosine >= SNCA_UNKNOWN_SIMILARITY,
  0.5) and the label-relative rule at the threshold that accepts 85 % of category members: what
  share is named right, and what share of each unrelated set is still unknown.

    python benchmarks/acceptance_bound.py runs/photos-lite0 --draws 30 --json docs/acceptance_bound.json
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmarks.command_line import write_report


def embed(run: Path, blobs: list[bytes]) -> np.ndarray:
    """(N, d) served embeddings of encoded images (the model's eval transform and forward)."""
    from PIL import Image

    from embedding.artifacts import load_model
    from embedding.transforms import eval_transform

    net = load_model(run).eval()
    tf = eval_transform(net.config)
    out = []
    with torch.no_grad():
        for i in range(0, len(blobs), 32):
            x = torch.stack(
                [tf(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs[i : i + 32]]
            )
            out.append(net(x).numpy())
    return np.concatenate(out).astype(np.float64)


def auroc(pos: np.ndarray, neg: np.ndarray) -> float:
    """P(a member scores above an unrelated image), ties half (Mann-Whitney)."""
    from scipy.stats import rankdata

    r = rankdata(np.r_[pos, neg])
    return float((r[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def label_relative(q: np.ndarray, g: np.ndarray, gl: np.ndarray) -> tuple[np.ndarray, ...]:
    """(best cosine (Q,), chosen label (Q,), cosine relative to the chosen label's spread (Q,))
    of queries q (Q, d) against gallery g (G, d) labelled gl (G,): 1-NN vote."""
    s = q @ g.T
    best, chosen = s.max(1), gl[s.argmax(1)]
    med, dev = {}, []
    for c in np.unique(gl):
        m = g[gl == c] @ g[gl == c].T
        np.fill_diagonal(m, -np.inf)
        loo = m.max(1)  # each image's nearest other image of its label
        med[c] = (float(np.median(loo)), len(loo))
        dev.append(loo - med[c][0])
    sd = float(np.sqrt(np.mean(np.concatenate(dev) ** 2))) or 1.0
    gmed = float(np.median([v for v, _ in med.values()]))
    centre = np.array([med[c][0] * med[c][1] / (med[c][1] + 5) + gmed * 5 / (med[c][1] + 5)
                       for c in chosen])  # fmt: skip
    return best, chosen, (best - centre) / sd


def main(argv: list[str] | None = None) -> int:
    import category_photos as cp

    ap = cp.photo_parser(__doc__, draws=30)
    ap.add_argument("--floor", type=float, default=0.5, help="SNCA_UNKNOWN_SIMILARITY")
    ap.add_argument("--accept", type=float, default=0.85, help="members the relative rule takes")
    a = ap.parse_args(argv)
    cats, other = cp.photo_sets()
    names = sorted(cats)
    print("embedding", sum(map(len, cats.values())) + sum(map(len, other.values())), "images",
          flush=True)  # fmt: skip
    ce = {k: embed(a.run, cats[k]) for k in names}
    oe = {k: embed(a.run, v) for k, v in other.items()}
    rng = np.random.default_rng(a.seed)
    rows = []
    for _ in range(a.draws):
        g, gl, q, ql = [], [], [], []
        for ci, k in enumerate(names):
            p = rng.permutation(len(ce[k]))
            g.append(ce[k][p[: a.shots]])
            gl += [ci] * a.shots
            q.append(ce[k][p[a.shots :]])
            ql += [ci] * (len(p) - a.shots)
        g, gl, q, ql = np.concatenate(g), np.array(gl), np.concatenate(q), np.array(ql)
        best, chosen, rel = label_relative(q, g, gl)
        right = chosen == ql
        cut = float(np.quantile(rel, 1 - a.accept))
        row = {
            "nearest_right": float(right.mean()),
            "floor": {"named_right": float((right & (best >= a.floor)).mean()),
                      "accepted": float((best >= a.floor).mean())},
            "relative": {"named_right": float((right & (rel >= cut)).mean()),
                         "accepted": float((rel >= cut).mean())},
            "auroc_best": {}, "auroc_relative": {},
        }  # fmt: skip
        for k, e in oe.items():
            ob, _, orel = label_relative(e, g, gl)
            row["auroc_best"][k] = auroc(best, ob)
            row["auroc_relative"][k] = auroc(rel, orel)
            row["floor"].setdefault("unrelated_unknown", {})[k] = float((ob < a.floor).mean())
            row["relative"].setdefault("unrelated_unknown", {})[k] = float((orel < cut).mean())
        rows.append(row)

    def mean(f):
        return float(np.mean([f(r) for r in rows]))

    summary = {
        "nearest_right": mean(lambda r: r["nearest_right"]),
        "nearest_right_worst": float(min(r["nearest_right"] for r in rows)),
        "auroc_best": {k: mean(lambda r, k=k: r["auroc_best"][k]) for k in oe},
        "auroc_relative": {k: mean(lambda r, k=k: r["auroc_relative"][k]) for k in oe},
    }
    for rule in ("floor", "relative"):
        summary[rule] = {
            "named_right": mean(lambda r, u=rule: r[u]["named_right"]),
            "accepted": mean(lambda r, u=rule: r[u]["accepted"]),
            "unrelated_unknown": {
                k: mean(lambda r, u=rule, k=k: r[u]["unrelated_unknown"][k]) for k in oe
            },
        }
    print(f"{a.draws} draws of {a.shots} per category ({', '.join(names)}):")
    print(f"  nearest label right (the ceiling of named right): "
          f"{100 * summary['nearest_right']:.1f}% (worst {100 * summary['nearest_right_worst']:.1f}%)")  # fmt: skip
    for k in oe:
        print(f"  AUROC member vs {k}: best cosine {summary['auroc_best'][k]:.3f}, "
              f"label-relative {summary['auroc_relative'][k]:.3f}")  # fmt: skip
    for rule, what in (("floor", f"best cosine >= {a.floor}"),
                       ("relative", f"label-relative, {100 * a.accept:.0f}% of members")):  # fmt: skip
        s = summary[rule]
        print(f"  {what}: named right {100 * s['named_right']:.1f}%, accepted "
              f"{100 * s['accepted']:.1f}%; unrelated unknown: "
              + ", ".join(f"{k} {100 * v:.0f}%" for k, v in s["unrelated_unknown"].items()))  # fmt: skip
    write_report(a.json, {"run": a.run, "shots": a.shots, "draws": a.draws,
                          "categories": {k: len(v) for k, v in cats.items()},
                          "summary": summary, "per_draw": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    sys.exit(main())
