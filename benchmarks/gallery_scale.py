"""The vote at gallery scale (issue 20): the candidate vote against the exact dense vote at the
default gallery's size, and classify cost, memory and build time against gallery size.

    # parity on the default 55,000-item gallery (the run's memory bank) and the 10,000 test
    # images, for each rule and candidate count; generalized 5-shot on the same embeddings
    python benchmarks/gallery_scale.py parity --model runs/demo --candidates 256,512,1024

    # galleries of real embeddings (Fashion-MNIST training images under random pad-crop and
    # flip, re-embedded by the model), index by --factory auto, the service's Gallery
    python benchmarks/gallery_scale.py scale --model runs/demo --sizes 55000,100000,1000000

    # every index kind on one such gallery: bytes per item, parity, time, the label filter
    python benchmarks/gallery_scale.py kinds --model runs/demo --size 1000000

    # a run dir whose memory bank is such a gallery: snca-build-index and snca-serve serve it
    python benchmarks/gallery_scale.py make-run --model runs/demo --size 1000000 --out runs/scale-1m
    snca-build-index runs/scale-1m --factory auto && snca-serve --model runs/scale-1m &
    python benchmarks/gallery_scale.py http --url http://127.0.0.1:8000 --clients 8

Prints a table and writes JSON (--json). Timings are this machine's, in one run: compare
ratios within a run (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from embedding.artifacts import save_memory_bank
from embedding.datasets import load_raw
from embedding.rundir import RunDir
from embedding.transforms import normalize_batch
from service.model.accel import optimize_for_cpu

NOVEL = (7, 8, 9)  # generalized few-shot: Sneaker, Bag, Ankle boot registered from 5 shots
RULES = ("kde", "knn", "prototype")


# ---------------------------------------------------------------------------- embeddings
@torch.no_grad()
def embed(model, images: torch.Tensor, augment: bool = False, seed: int = 0, batch: int = 2048):
    """uint8 (N, C, H, W) at the model's size -> (N, d) float32 unit embeddings; with
    `augment`, training's small-image augmentation first (pad 3 and crop, horizontal flip),
    batched: each call with another seed gives other images of the same items. The model
    runs as the service runs it on a CPU (service.model.accel.optimize_for_cpu; ~4x eager)."""
    model.eval()
    cfg = model.config
    net, _ = optimize_for_cpu(model, normalize_batch(images[: min(64, len(images))], cfg))
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(0, len(images), batch):
        x = images[s : s + batch]
        if augment:
            n, _, h, w = x.shape
            pad = torch.nn.functional.pad(x, (3, 3, 3, 3))  # (n, C, h+6, w+6), zeros
            dy = torch.randint(0, 7, (n,), generator=g)
            dx = torch.randint(0, 7, (n,), generator=g)
            rows = (dy[:, None] + torch.arange(h))[:, None, :, None]  # (n, 1, h, 1)
            cols = (dx[:, None] + torch.arange(w))[:, None, None, :]  # (n, 1, 1, w)
            x = pad[
                torch.arange(n)[:, None, None, None],
                torch.arange(x.shape[1])[None, :, None, None],
                rows,
                cols,
            ]
            flip = torch.rand(n, generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        out.append(net(normalize_batch(x, cfg)).float())
    return torch.cat(out).numpy()


def _images(raw) -> torch.Tensor:
    return raw.source.images  # Fashion-MNIST: uint8 (N, 1, 28, 28) in memory


def augmented_gallery(run: Path, size: int, cache: Path | None = None, log=print):
    """(embeddings (size, d), label ids (size,), dataset indices (size,)): the training images
    cycled, each pass under another augmentation seed. Cached as .npy in `cache`."""
    if cache is not None:
        f = cache / f"aug-{size}.npz"
        if f.is_file():
            z = np.load(f)
            return z["emb"], z["labels"], z["indices"]
    model = RunDir(run).load_model()
    raw = load_raw("fashion-mnist", "train")
    imgs, y = _images(raw), np.asarray(raw.targets, dtype=np.int64)
    n = len(y)
    parts, t0 = [], time.perf_counter()
    for p in range((size + n - 1) // n):
        take = min(n, size - p * n)
        parts.append(embed(model, imgs[:take], augment=p > 0, seed=p))
        done = p * n + take
        rate = done / (time.perf_counter() - t0)
        log(f"  embedded {done}/{size} ({rate:.0f} img/s)", flush=True)
    emb = np.concatenate(parts)
    idx = np.arange(size) % n
    out = emb, y[idx], idx
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)
        np.savez(cache / f"aug-{size}.npz", emb=emb, labels=out[1], indices=idx)
    return out


def test_queries(run: Path):
    model = RunDir(run).load_model()
    test = load_raw("fashion-mnist", "test")
    return embed(model, _images(test)), np.asarray(test.targets, dtype=np.int64)


# ---------------------------------------------------------------------------- galleries
def make_gallery(emb, labels, names, factory="Flat", exact_max=0, candidates=1024, params=None):
    """The service's Gallery over (N, d) embeddings: `exact_max` >= N votes densely."""
    import faiss

    from embedding.index import apply_search_params
    from service.gallery.gallery import Gallery
    from service.gallery.vectors import VectorIndex

    base = faiss.index_factory(emb.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
    if not base.is_trained:
        rng = np.random.default_rng(0)
        base.train(emb[rng.choice(len(emb), min(len(emb), 500_000), replace=False)])
    index = faiss.IndexIDMap2(base)
    index.add_with_ids(emb, np.arange(len(emb), dtype=np.int64))
    apply_search_params(index, params or {})
    g = Gallery(VectorIndex(index, params or {}), emb.shape[1], 0.05, candidates, exact_max)
    g.rows = type(g.rows)(emb.shape[1], dense=len(emb) <= exact_max)
    for c, name in enumerate(names):
        rows = np.nonzero(labels == c)[0]
        if len(rows):
            lid = g.stats.id_of(name)
            g.rows.append(rows.astype(np.int64), lid, emb[rows])
            g.stats.add(lid, emb[rows], 0)
    return g


def predict(g, q: np.ndarray, vote: str, k: int = 30, batch: int = 1000) -> np.ndarray:
    if g.rows.dense:  # (batch, N) similarities: keep them within ~1 GB
        batch = max(16, min(batch, (1 << 28) // max(1, g.rows.n)))
    names = {n: i for i, n in enumerate(g.stats.names)}
    out = []
    for s in range(0, len(q), batch):
        out += [names.get(r.label, -1) for r in g.classify(q[s : s + batch], vote, k)]
    return np.array(out)


def _time_batches(g, q, vote, batch=64, reps=20) -> float:
    """Median seconds of one classify of a `batch`-query batch (the service's batch path)."""
    ts = []
    for r in range(reps):
        s = (r * batch) % (len(q) - batch)
        t = time.perf_counter()
        g.classify(q[s : s + batch], vote, 30)
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


# ---------------------------------------------------------------------------- parity
def fewshot_hm(emb, y, q, qy, names, vote, exact_max, candidates, shots=5, draws=5):
    """Generalized `shots`-shot on the same embeddings: the NOVEL labels' gallery items are
    removed and `shots` of them registered back; harmonic mean of novel and base top-1 over
    the test queries, mean over draws (training/fewshot.py's protocol on a model that saw
    every class in training: what it measures here is the vote, not the embedding)."""
    rng = np.random.default_rng(0)
    hms = []
    for _ in range(draws):
        keep = ~np.isin(y, NOVEL)
        for c in NOVEL:
            keep[rng.choice(np.nonzero(y == c)[0], shots, replace=False)] = True
        g = make_gallery(emb[keep], y[keep], names, exact_max=exact_max, candidates=candidates)
        ok = predict(g, q, vote) == qy
        novel = np.isin(qy, NOVEL)
        n, b = ok[novel].mean(), ok[~novel].mean()
        hms.append(0.0 if n + b == 0 else 2 * n * b / (n + b))
    return float(np.mean(hms))


def parity(args) -> dict:
    rd = RunDir(args.model)
    bank, names = rd.load_memory(), rd.load_model().config.class_names
    emb, y = bank.embeddings.numpy(), bank.labels.numpy()
    q, qy = test_queries(args.model)
    print(f"gallery {len(emb)} items (memory bank of {args.model}), {len(q)} test queries")
    exact = make_gallery(emb, y, names, exact_max=10**12)
    res = {"gallery": len(emb), "queries": len(q), "rules": {}}
    for vote in args.rules.split(","):
        ref = predict(exact, q, vote)
        t_exact = _time_batches(exact, q, vote)
        hm_exact = fewshot_hm(emb, y, q, qy, names, vote, 10**12, 0) if args.fewshot else None
        row = {"exact_top1": float((ref == qy).mean() * 100), "exact_ms": t_exact * 1e3}
        row["exact_hm5"] = hm_exact
        for kp in [int(x) for x in args.candidates.split(",")]:
            g = make_gallery(emb, y, names, exact_max=0, candidates=kp)
            got = predict(g, q, vote)
            cand = {
                "top1": float((got == qy).mean() * 100),
                "identical": float((got == ref).mean()),
                "ms": _time_batches(g, q, vote) * 1e3,
            }
            if args.fewshot:
                cand["hm5"] = fewshot_hm(emb, y, q, qy, names, vote, 0, kp)
            row[str(kp)] = cand
            print(
                f"{vote:9s} K'={kp:5d}  top-1 {cand['top1']:.2f} (exact {row['exact_top1']:.2f})"
                f"  identical {cand['identical'] * 100:.2f}%  hm5 {cand.get('hm5')}"
                f" (exact {hm_exact})  {cand['ms']:.1f} ms/64 (exact {t_exact * 1e3:.1f})",
                flush=True,
            )
            if vote != "kde":
                break  # knn and prototype read nothing beyond k <= K' / the statistics
        res["rules"][vote] = row
    return res


# ---------------------------------------------------------------------------- scale
def scale(args) -> dict:
    from index_builder.build import auto_factory

    model = RunDir(args.model).load_model()
    names = model.config.class_names
    q, qy = test_queries(args.model)
    cache = Path(args.cache) if args.cache else None
    imgs = _images(load_raw("fashion-mnist", "test"))
    with torch.no_grad():
        model.eval()
        x64 = normalize_batch(imgs[:64], model.config)
        fwd = []
        for _ in range(10):
            t = time.perf_counter()
            model(x64)
            fwd.append(time.perf_counter() - t)
    forward_ms = float(np.median(fwd)) * 1e3
    out = {"forward_ms_64": forward_ms, "sizes": []}
    print(f"forward pass, batch of 64: {forward_ms:.1f} ms")
    for n in [int(s) for s in args.sizes.split(",")]:
        emb, y, _ = augmented_gallery(args.model, n, cache)
        factory = auto_factory(n, emb.shape[1])
        t = time.perf_counter()
        from index_builder.build import tune_recall

        g = make_gallery(emb, y, names, factory, exact_max=0, candidates=args.k_prime)
        build_s = time.perf_counter() - t
        params, rec = tune_recall(g.vectors.index, emb, np.arange(n), 0.95, 0, log=lambda m: None)
        if params:
            from embedding.index import apply_search_params

            apply_search_params(g.vectors.index, params)
            g.vectors.search_params = params
        import faiss

        index_bytes = len(faiss.serialize_index(g.vectors.index))
        row = {
            "n": n,
            "factory": factory,
            "params": params,
            "recall_at_10": rec.get("recall_at_10", 1.0),
            "build_s": build_s,
            "index_bytes_per_item": index_bytes / n,
            "rows_bytes_per_item": 24,
        }
        got = predict(g, q, "kde")
        row["cand_top1"] = float((got == qy).mean() * 100)
        row["cand_ms_64"] = _time_batches(g, q, "kde") * 1e3
        row["cand_p50_ms_1"] = _time_batches(g, q, "kde", batch=1, reps=200) * 1e3
        row["cand_img_s"] = 64 / (row["cand_ms_64"] + forward_ms) * 1e3
        del g
        if n <= args.exact_upto:  # the dense exact vote as the reference
            ex = make_gallery(emb, y, names, "Flat", exact_max=10**12)
            ref = predict(ex, q, "kde")
            row["exact_top1"] = float((ref == qy).mean() * 100)
            row["identical"] = float((got == ref).mean())
            row["exact_ms_64"] = _time_batches(ex, q, "kde", reps=5) * 1e3
            row["exact_img_s"] = 64 / (row["exact_ms_64"] + forward_ms) * 1e3
            del ex
        out["sizes"].append(row)
        print(json.dumps(row), flush=True)
    base = out["sizes"][0]
    for r in out["sizes"]:
        r["img_s_vs_first"] = r["cand_img_s"] / base["cand_img_s"]
    return out


def http(args) -> dict:
    """Through HTTP against a running snca-serve: p50 of lone /classify requests (one at a
    time), then the rate `--clients` concurrent clients sustain for `--seconds`."""
    import threading

    import httpx

    from tests.service.helpers import png  # a real test image as PNG bytes

    test = load_raw("fashion-mnist", "test")
    bodies = [png(test, i) for i in range(200)]
    with httpx.Client(base_url=args.url, timeout=60) as c:
        lone = []
        for i in range(200):
            t = time.perf_counter()
            r = c.post("/classify", files={"image": ("x.png", bodies[i], "image/png")})
            lone.append(time.perf_counter() - t)
            assert r.status_code == 200, r.text
        size = c.get("/readyz").json()
    done, stop = [0] * args.clients, time.perf_counter() + args.seconds

    def client(j):
        with httpx.Client(base_url=args.url, timeout=60) as c:
            i = j
            while time.perf_counter() < stop:
                r = c.post("/classify", files={"image": ("x.png", bodies[i % 200], "image/png")})
                assert r.status_code == 200, r.text
                done[j] += 1
                i += args.clients

    ts = [threading.Thread(target=client, args=(j,)) for j in range(args.clients)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out = {
        "url": args.url,
        "gallery_items": size.get("gallery_items", size.get("items")),
        "lone_p50_ms": float(np.median(lone)) * 1e3,
        "clients": args.clients,
        "img_s": sum(done) / (time.perf_counter() - t0),
    }
    print(json.dumps(out), flush=True)
    return out


def kinds(args) -> dict:
    """Every index kind the builder makes, on one gallery of real embeddings: bytes per item,
    build time, recall-tuned search parameter, candidate-vote parity against the exact vote,
    time per batch; and what the label filter (an IDSelectorBatch of the allowed ids) costs."""
    import faiss

    from index_builder.build import tune_recall

    names = RunDir(args.model).load_model().config.class_names
    q, qy = test_queries(args.model)
    emb, y, _ = augmented_gallery(args.model, args.size, Path(args.cache) if args.cache else None)
    ref = predict(make_gallery(emb, y, names, "Flat", exact_max=10**12), q, "kde")
    out = {"n": args.size, "kinds": []}
    for factory in args.factories.split(";"):
        t = time.perf_counter()
        g = make_gallery(emb, y, names, factory, exact_max=0, candidates=args.k_prime)
        build_s = time.perf_counter() - t
        params, rec = tune_recall(
            g.vectors.index, emb, np.arange(len(emb)), 0.95, 0, log=lambda m: None
        )
        if params:
            from embedding.index import apply_search_params

            apply_search_params(g.vectors.index, params)
            g.vectors.search_params = params
        got = predict(g, q, "kde")
        two = [names[0], names[1]]
        row = {
            "factory": factory,
            "build_s": build_s,
            "bytes_per_item": len(faiss.serialize_index(g.vectors.index)) / len(emb) + 24,
            "params": params,
            "recall_at_10": rec.get("recall_at_10", 1.0),
            "top1": float((got == qy).mean() * 100),
            "exact_top1": float((ref == qy).mean() * 100),
            "identical": float((got == ref).mean()),
            "ms_64": _time_batches(g, q, "kde") * 1e3,
        }
        ts = []
        for r in range(10):  # the label filter: 2 of 10 labels
            t = time.perf_counter()
            g.classify(q[r * 64 : (r + 1) * 64], "kde", 30, labels=two)
            ts.append(time.perf_counter() - t)
        row["filtered_ms_64"] = float(np.median(ts)) * 1e3
        out["kinds"].append(row)
        print(json.dumps(row), flush=True)
        del g
    return out


def plot_cost(res: dict, path: str) -> None:
    """Time per query (vote only, batches of 64) against gallery size, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["sizes"]
    fig, ax = plt.subplots(figsize=(6, 4))
    n = [r["n"] for r in rows]
    ax.loglog(n, [r["cand_ms_64"] / 64 for r in rows], "o-", label="candidate vote (index)")
    ex = [r for r in rows if "exact_ms_64" in r]
    ax.loglog(
        [r["n"] for r in ex], [r["exact_ms_64"] / 64 for r in ex], "s--", label="exact dense vote"
    )
    for r in rows:
        ax.annotate(
            r["factory"],
            (r["n"], r["cand_ms_64"] / 64),
            fontsize=7,
            textcoords="offset points",
            xytext=(4, -10),
        )
    ax.set_xlabel("gallery items")
    ax.set_ylabel("ms per query (kde, batches of 64)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def make_run(args) -> dict:
    """A copy of the model's run dir whose memory bank is an augmented gallery of --size."""
    src, dst = Path(args.model), Path(args.out)
    if dst.exists():
        raise SystemExit(f"{dst} exists")
    emb, y, idx = augmented_gallery(src, args.size, Path(args.cache) if args.cache else None)
    dst.mkdir(parents=True)
    for f in os.listdir(src):
        if (src / f).is_file() and f != RunDir.MEMORY and f != RunDir.CHECKPOINT:
            shutil.copy2(src / f, dst / f)
    fp = RunDir(src).load_model().fingerprint
    save_memory_bank(
        dst / RunDir.MEMORY, torch.from_numpy(emb), torch.from_numpy(y), torch.from_numpy(idx), fp
    )
    return {"out": str(dst), "size": args.size}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("parity")
    a.add_argument("--model", default="runs/demo")
    a.add_argument("--candidates", default="256,512,1024")
    a.add_argument("--rules", default=",".join(RULES))
    a.add_argument("--fewshot", action=argparse.BooleanOptionalAction, default=True)
    b = sub.add_parser("scale")
    b.add_argument("--model", default="runs/demo")
    b.add_argument("--sizes", default="55000,100000,1000000")
    b.add_argument("--k-prime", type=int, default=1024)
    b.add_argument("--exact-upto", type=int, default=1_000_000)
    b.add_argument("--cache", default="runs/gallery-scale-cache")
    b.add_argument("--plot", help="write the cost curve (PNG) here")
    c = sub.add_parser("make-run")
    c.add_argument("--model", default="runs/demo")
    c.add_argument("--size", type=int, default=1_000_000)
    c.add_argument("--out", required=True)
    c.add_argument("--cache", default="runs/gallery-scale-cache")
    k = sub.add_parser("kinds")
    k.add_argument("--model", default="runs/demo")
    k.add_argument("--size", type=int, default=1_000_000)
    k.add_argument("--factories", default="Flat;IVF4096,Flat;IVF4096,PQ32;HNSW32")
    k.add_argument("--k-prime", type=int, default=1024)
    k.add_argument("--cache", default="runs/gallery-scale-cache")
    h = sub.add_parser("http")
    h.add_argument("--url", default="http://127.0.0.1:8000")
    h.add_argument("--clients", type=int, default=8)
    h.add_argument("--seconds", type=float, default=20)
    for x in (a, b, c, k, h):
        x.add_argument("--json", help="write the results here")
        x.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cmds = {"parity": parity, "scale": scale, "kinds": kinds, "make-run": make_run, "http": http}
    res = cmds[args.cmd](args)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    if getattr(args, "plot", None):
        plot_cost(res, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
