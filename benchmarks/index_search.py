"""Index build time, batched search throughput and recall@10 for Flat, IVF and HNSW.

    python benchmarks/index_search.py                   # 1,000,000 x 128, 10,000 queries
    python benchmarks/index_search.py --n 200000 --queries 2000   # quicker
    python benchmarks/index_search.py --data flat       # the hard case (no local structure)

Synthetic data shaped like an embedding gallery, two kinds (`--data`):
  hierarchical (default): `--clusters` class centres, `--modes` sub-centres per class at cosine
    ~0.85 to their class centre, points at cosine ~0.95 to their sub-centre; its neighbour
    profile (mean cosine of the 1st / 10th / 100th / 1000th neighbour, printed) is meant to
    resemble a trained embedding's (a Fashion-MNIST NCA memory bank: 0.98 / 0.97 / 0.95 / 0.89).
  flat: points around the class centres only, noise of norm `--spread` (1.5: cosine ~0.55 to
    the centre, ~0.3 between two points of a class): no local structure, the 10 nearest
    neighbours are decided by noise; the hard case for any approximate index.
Queries are fresh draws from the same distribution. All indexes use inner product and the
builder's own code path (index_builder.build.make_index), in one run, on this machine's threads.
Recall@10 is against the exact index; the exact index is itself checked against a plain numpy
matrix product + argpartition (the naive reference), timed on a subset of the queries.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from index_builder.build import BuildConfig, Vectors, make_index


def unit(x):
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def make_generator(args, rng):
    """A function n -> (n, d) unit vectors of the chosen distribution (fixed centres)."""
    d = args.d
    centres = unit(rng.standard_normal((args.clusters, d), dtype=np.float32))
    if args.data == "hierarchical":
        # sub-centre = normalize(centre + 0.62 g / sqrt(d)): cosine 1 / sqrt(1 + 0.62^2) = 0.85
        g = rng.standard_normal((args.clusters, args.modes, d), dtype=np.float32)
        around = unit(centres[:, None, :] + 0.62 * g / np.sqrt(d)).reshape(-1, d)
        spread = 0.33  # point cosine to its sub-centre 1 / sqrt(1 + 0.33^2) = 0.95
    else:
        around, spread = centres, args.spread

    def draw(n, chunk=200_000):
        out = np.empty((n, d), dtype=np.float32)
        for s in range(0, n, chunk):
            m = min(chunk, n - s)
            c = around[rng.integers(0, len(around), m)]
            noise = rng.standard_normal((m, d), dtype=np.float32) / np.sqrt(d)
            out[s : s + m] = unit(c + spread * noise)
        return out

    return draw


def neighbour_profile(base, queries, ranks=(1, 10, 100, 1000)):
    sims = queries[:200] @ base.T  # (200, N)
    top = -np.sort(-sims, axis=1)[:, : max(ranks)]
    return {str(r): float(top[:, r - 1].mean()) for r in ranks}


def numpy_topk(base, queries, k, chunk=256):
    ids = np.empty((len(queries), k), dtype=np.int64)
    for s in range(0, len(queries), chunk):
        sims = queries[s : s + chunk] @ base.T  # (q, N)
        part = np.argpartition(-sims, k, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(sims, part, axis=1), axis=1)
        ids[s : s + chunk] = np.take_along_axis(part, order, axis=1)
    return ids


def recall(found, truth):
    k = truth.shape[1]
    hits = sum(len(set(f) & set(t)) for f, t in zip(found, truth, strict=True))
    return hits / (k * len(truth))


def timed_search(index, queries, k):
    index.search(queries[:64], k)  # warm-up: first-touch of buffers, thread pool
    t0 = time.perf_counter()
    _, ids = index.search(queries, k)
    return ids, time.perf_counter() - t0


def main() -> None:
    import faiss

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--n", type=int, default=1_000_000)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--queries", type=int, default=10_000)
    p.add_argument("--numpy-queries", type=int, default=500, help="queries for the numpy reference")
    p.add_argument("--data", choices=("hierarchical", "flat"), default="hierarchical")
    p.add_argument("--clusters", type=int, default=1000, help="classes")
    p.add_argument("--modes", type=int, default=50, help="hierarchical: sub-centres per class")
    p.add_argument("--spread", type=float, default=1.5, help="flat: norm of the noise")
    p.add_argument("--ivf", default="IVF4096,Flat")
    p.add_argument("--nprobes", default="1,2,4,8,16,32,64")
    p.add_argument("--hnsw", default="HNSW32")
    p.add_argument(
        "--ef-construction", type=int, default=None, help="HNSW build breadth (builder default)"
    )
    p.add_argument("--efs", default="32,64,128,256")
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--target-recall", type=float, default=0.95)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    rng = np.random.default_rng(0)
    draw = make_generator(args, rng)
    base = draw(args.n)
    queries = draw(args.queries)
    ids = np.arange(args.n, dtype=np.int64)
    vec = Vectors(base, np.zeros(args.n, dtype=np.int64), ids)
    k = args.k
    prof = neighbour_profile(base, queries)
    res = {
        "n": args.n,
        "d": args.d,
        "queries": args.queries,
        "k": k,
        "data": args.data,
        "clusters": args.clusters,
        "modes": args.modes,
        "spread": args.spread,
        "neighbour_profile": prof,
        "threads": faiss.omp_get_max_threads(),
        "faiss": faiss.__version__,
    }
    print(
        f"{args.n} x {args.d} vectors ({args.data}), {args.queries} queries, k={k}, "
        f"{faiss.omp_get_max_threads()} threads, faiss {faiss.__version__}; mean cosine of the "
        "1st/10th/100th/1000th neighbour " + " / ".join(f"{v:.2f}" for v in prof.values()),
        flush=True,
    )

    def build(factory, **kw):
        cfg = BuildConfig(
            run_dir=Path("."), out=Path("."), factory=factory, device="cpu", progress=False, **kw
        )
        t0 = time.perf_counter()
        index, _, _ = make_index(vec, cfg, ids, log=lambda m: None)
        return index, time.perf_counter() - t0

    # exact
    flat, t_build = build("Flat")
    truth, t = timed_search(flat, queries, k)
    res["flat"] = {"build_s": t_build, "qps": args.queries / t, "recall": 1.0}
    print(
        f"Flat           build {t_build:7.1f} s  {args.queries / t:9.0f} q/s  recall@10 1.000 (exact)",
        flush=True,
    )

    # naive numpy reference on a subset; also checks the exact index
    nq = min(args.numpy_queries, args.queries)
    t0 = time.perf_counter()
    np_ids = numpy_topk(base, queries[:nq], k)
    t_np = time.perf_counter() - t0
    agree = recall(np_ids, truth[:nq])
    res["numpy"] = {"qps": nq / t_np, "agreement_with_flat": agree, "queries": nq}
    print(
        f"numpy matmul   build     0.0 s  {nq / t_np:9.0f} q/s  agreement with Flat {agree:.4f} ({nq} queries)",
        flush=True,
    )

    def sweep(name, factory, param, values, **kw):
        index, t_build = build(factory, **kw)
        rows = []
        for v in values:
            faiss.ParameterSpace().set_index_parameter(index, param, v)
            found, t = timed_search(index, queries, k)
            r = recall(found, truth)
            rows.append(
                {
                    param: v,
                    "qps": args.queries / t,
                    "recall": r,
                    "speedup_vs_flat": (args.queries / t) / res["flat"]["qps"],
                }
            )
            print(
                f"{factory:14s} build {t_build:7.1f} s  {args.queries / t:9.0f} q/s  "
                f"recall@10 {r:.3f}  {param}={v}  ({rows[-1]['speedup_vs_flat']:.1f}x Flat)",
                flush=True,
            )
        ok = [r for r in rows if r["recall"] >= args.target_recall]
        best = max(ok, key=lambda r: r["qps"]) if ok else None
        res[name] = {"factory": factory, "build_s": t_build, "sweep": rows, "best_at_target": best}

    sweep("ivf", args.ivf, "nprobe", [int(v) for v in args.nprobes.split(",")])
    sweep(
        "hnsw",
        args.hnsw,
        "efSearch",
        [int(v) for v in args.efs.split(",")],
        ef_construction=args.ef_construction,
    )
    for name in ("ivf", "hnsw"):
        b = res[name]["best_at_target"]
        if b:
            print(
                f"{res[name]['factory']}: recall@10 >= {args.target_recall} at "
                f"{b['qps']:.0f} q/s = {b['speedup_vs_flat']:.1f}x the exact index"
            )
        else:
            print(f"{res[name]['factory']}: no setting reached recall@10 {args.target_recall}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
