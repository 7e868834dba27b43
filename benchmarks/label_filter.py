"""The label filter at gallery scale (issue 20): an IDSelectorBatch over the allowed labels' ids
on one IVF index (what the service does) against per-label IVF sub-indexes searched and merged.
Same queries (64 gallery vectors), K' candidates, 2 of 10 labels allowed; time per batch and
filtered recall@10 against an exact search of the allowed items.

    python benchmarks/gallery_scale.py scale --sizes 1000000     # makes the 1M cache first
    python benchmarks/label_filter.py --cache runs/gallery-scale-cache/aug-1000000.npz
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", default="runs/gallery-scale-cache/aug-1000000.npz")
    p.add_argument("--k-prime", type=int, default=1024)
    p.add_argument("--nprobe", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    faiss.omp_set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    tune_faiss()
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
