"""The label filter at gallery scale (issue 20): an IDSelectorBatch over the allowed labels' ids
on one IVF index (what the service does) against per-label IVF sub-indexes searched and merged.
Same queries (64 gallery vectors), K' candidates, 2 of 10 labels allowed; time per batch and
filtered recall@10 against an exact search of the allowed items.

    python benchmarks/gallery_scale.py scale --sizes 1000000     # makes the 1M cache first
    python benchmarks/label_filter.py --cache runs/gallery-scale-cache/aug-1000000.npz

    # what the filter does to classify: kde restricted to T-shirt/top and Shirt (the hardest
    # pair) on the 1M IVF gallery against the exact vote over those labels' items alone
    python benchmarks/label_filter.py --classify --model runs/demo
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.index import tune_faiss


def _median_ms(f, n: int = 5) -> float:
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)) * 1e3


def _ivf(x: np.ndarray, ids: np.ndarray, nprobe: int):
    nlist = 1 << round(np.log2(4 * np.sqrt(len(x))))
    base = faiss.index_factory(x.shape[1], f"IVF{nlist},Flat", faiss.METRIC_INNER_PRODUCT)
    rng = np.random.default_rng(0)
    base.train(x[rng.choice(len(x), min(len(x), 200_000), replace=False)])
    index = faiss.IndexIDMap2(base)
    index.add_with_ids(x, ids)
    base.nprobe = nprobe
    return index


def classify_parity(args) -> None:
    from benchmarks.gallery_scale import make_gallery, test_queries
    from embedding.rundir import RunDir

    names = RunDir(args.model).load_model().config.class_names
    z = np.load(args.cache)
    emb, y = z["emb"], z["labels"]
    q, qy = test_queries(args.model)
    two = [0, 6]
    sel = np.isin(qy, two)
    q, qy = q[sel], qy[sel]
    keep = np.isin(y, two)
    exact = make_gallery(emb[keep], y[keep], names, exact_max=10**12)
    params = {"nprobe": args.nprobe}
    cand = make_gallery(
        emb, y, names, "IVF4096,Flat", exact_max=0, candidates=args.k_prime, params=params
    )
    allowed = [names[c] for c in two]

    def run(g, labels):
        out = []
        for s in range(0, len(q), 256):
            out += [r.label for r in g.classify(q[s : s + 256], "kde", 30, labels=labels)]
        return np.array(out)

    e, c = run(exact, None), run(cand, allowed)
    truth = np.array([names[i] for i in qy])
    print(
        f"{len(q)} test images of {allowed}, classify filtered to those labels: exact vote "
        f"over their {int(keep.sum())} items top-1 {(e == truth).mean() * 100:.2f}; candidate "
        f"vote on the {len(emb)}-item IVF index with the filter {(c == truth).mean() * 100:.2f};"
        f" identical {(e == c).mean() * 100:.2f} %"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="runs/gallery-scale-cache/aug-1000000.npz")
    p.add_argument("--k-prime", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--classify", action="store_true", help="the classify parity instead")
    p.add_argument("--model", default="runs/demo")
    args = p.parse_args(argv)
    faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    tune_faiss()
    if args.classify:
        classify_parity(args)
        return 0
    z = np.load(args.cache)
    emb, y = z["emb"], z["labels"]
    q = emb[np.random.default_rng(1).choice(len(emb), 64, replace=False)].copy()
    k, allowed = args.k_prime, [0, 1]
    ids = np.nonzero(np.isin(y, allowed))[0].astype(np.int64)
    one = _ivf(emb, np.arange(len(emb), dtype=np.int64), args.nprobe)

    def selector(sel=None):
        sel = sel or faiss.IDSelectorBatch(ids)
        return one.search(q, k, params=faiss.SearchParametersIVF(sel=sel, nprobe=args.nprobe))

    subs = [_ivf(emb[y == c], np.nonzero(y == c)[0].astype(np.int64), args.nprobe) for c in allowed]

    def per_label():
        found = [s.search(q, k) for s in subs]
        sims = np.concatenate([f[0] for f in found], 1)
        got = np.concatenate([f[1] for f in found], 1)
        order = np.argsort(-sims, axis=1)[:, :k]
        return np.take_along_axis(sims, order, 1), np.take_along_axis(got, order, 1)

    exact = faiss.IndexFlatIP(emb.shape[1])
    exact.add(emb[ids])
    truth = ids[exact.search(q, 10)[1]]

    def recall(found) -> float:
        return float(
            np.mean([len(set(a[:10]) & set(b)) / 10 for a, b in zip(found, truth, strict=True)])
        )

    built = faiss.IDSelectorBatch(ids)
    print(
        f"{len(emb)} items, 64 queries, K'={k}, nprobe {args.nprobe}, labels {allowed} "
        f"({len(ids)} ids), {args.threads} thread(s)"
    )
    print(f"  no filter: {_median_ms(lambda: one.search(q, k)):.1f} ms")
    print(
        f"  IDSelectorBatch built per batch: {_median_ms(selector):.1f} ms (building it "
        f"{_median_ms(lambda: faiss.IDSelectorBatch(ids)):.1f} ms; a cached one "
        f"{_median_ms(lambda: selector(built)):.1f} ms), recall@10 {recall(selector()[1]):.3f}"
    )
    print(
        f"  per-label sub-indexes, merged: {_median_ms(per_label):.1f} ms, "
        f"recall@10 {recall(per_label()[1]):.3f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
