"""Closed-set evaluation of a run dir (the paper's Table 2 rows), with the service's kNN.

    python -m training.evaluate runs/fmnist-nca-10ep                     # validation split
    python -m training.evaluate runs/fmnist-softmax-10ep --split test    # test split, once

For the run's classes, on the validation split carved at training time (default) or on the
test split: weighted kNN top-1/top-5 (exp(s/σ), σ from the model card, `embedding.knn`) at each
k, against (a) the memory bank (the paper's protocol) and (b) the training images re-embedded
with the final model and the eval transform; and the penultimate features reduced by PCA (fitted
on the training images) and L2-normalised, kNN against the training images: the paper's
"+PCA" row (for conv4 the features are 64-d, so the PCA keeps min(--pca-dim, 64) dimensions).
A softmax-baseline run (it has classifier.safetensors) also reports its parametric top-1.
Per-class kNN top-1 (memory bank, largest k) is reported for the per-class gain figure. A run
trained with --coarse is also evaluated on the fine labels (the paper's Table 5, sub-category
discovery): kNN against the memory bank and the re-embedded images, and a linear probe on the
frozen penultimate features trained with the fine labels (the paper's reference row).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from embedding.artifacts import read_safetensors
from embedding.cliutil import documented_parser, positive_int
from embedding.datasets import load_raw
from embedding.errors import SNCAError
from embedding.knn import knn_evaluate, knn_search, weighted_knn_vote
from embedding.rundir import RunDir

from .config import run_config
from .datasets import build_data, embed_split, parse_classes, select, stratified_pick
from .protocols import linear_probe, pca_fit, pca_project


@torch.no_grad()
def _features(model, split) -> tuple[torch.Tensor, torch.Tensor]:
    """(penultimate features (n, D), unnormalised projections (n, d)) of a split, eval transform."""
    f = embed_split(model.features, split, model.config)
    if f.numel() == 0:
        f = torch.empty(0, model.feature_dim)
    return f, model.embed(f).float()


def per_class_top1(
    q: torch.Tensor,
    qy: torch.Tensor,
    g: torch.Tensor,
    gy: torch.Tensor,
    c: int,
    sigma: float,
    k: int,
) -> list[float]:
    """Weighted-kNN top-1 (%) of the queries of each class (NaN for a class with no query)."""
    sims, idx = knn_search(q, g, k)
    pred = weighted_knn_vote(sims, gy[idx], c, sigma).argmax(1)
    ok = (pred == qy).float()
    n = torch.bincount(qy, minlength=c).float()
    hits = torch.zeros(c).index_add_(0, qy, ok)
    return [
        100.0 * h / m if m > 0 else float("nan")
        for h, m in zip(hits.tolist(), n.tolist(), strict=True)
    ]


def closed_set(
    run: Path, split: str = "val", ks=(1, 30), pca_dim: int = 128, limit: int | None = None
) -> dict:
    """Closed-set kNN accuracy of a run on its `split` ("val" or "test"); `limit`: at most this
    many queries, the same share of every class (seeded: the same ones every time), for quick
    checks of the pipeline (`make reproduce QUICK=1`), never for reported numbers."""
    rd = RunDir(run)
    cfg = run_config(run)
    data = build_data(cfg)
    model = rd.load_model().eval()
    mc = model.config
    if split == "val":
        if data.val is None:
            raise SNCAError(f"{run} has no validation split (trained with --val-size 0)")
        queries = data.val
    else:
        raw = load_raw(cfg.dataset, "test", cfg.data_dir, mc.image_size, mc.in_channels)
        queries = select(raw, parse_classes(cfg.classes, raw.class_names), cfg.coarse)
    if limit is not None and len(queries) > limit:
        queries = queries.subset(stratified_pick(queries.labels, limit, np.random.default_rng(0)))
    mem = rd.load_memory()
    bank = {"embeddings": mem.embeddings, "labels": mem.labels, "fine_labels": mem.fine_labels}
    c, sigma = len(mc.class_names), mc.temperature
    qf, qz = _features(model, queries)
    tf, tz = _features(model, data.train)
    qy, ty = torch.from_numpy(queries.labels), torch.from_numpy(data.train.labels)
    q, t = F.normalize(qz, dim=1), F.normalize(tz, dim=1)
    out: dict = {"run": str(run), "split": split, "queries": len(qy), "gallery": len(ty)}
    out["class_names"] = list(mc.class_names)
    out["memory"] = knn_evaluate(q, qy, bank["embeddings"], bank["labels"], c, sigma, ks)
    out["recompute"] = knn_evaluate(q, qy, t, ty, c, sigma, ks)
    out["per_class_top1"] = per_class_top1(
        q, qy, bank["embeddings"], bank["labels"], c, sigma, max(ks)
    )
    dim = min(pca_dim, tf.shape[1], tf.shape[0])
    mean, comp = pca_fit(tf, dim)
    out["pca_dim"] = dim
    out["pca_features"] = knn_evaluate(
        pca_project(qf, mean, comp), qy, pca_project(tf, mean, comp), ty, c, sigma, ks
    )
    head = rd.classifier
    if head.is_file():  # softmax baseline: its classifier reads the unnormalised projection
        w, _ = read_safetensors(head)
        logits = qz @ w["weight"].T + w["bias"]  # (n, C)
        out["parametric_top1"] = 100.0 * (logits.argmax(1) == qy).float().mean().item()
    if cfg.coarse:  # Table 5: do coarse-trained neighbourhoods separate the fine classes?
        fq = torch.from_numpy(queries.fine_labels)
        ft = torch.from_numpy(data.train.fine_labels)
        fc = len(queries.fine_class_names)
        pred = linear_probe(tf, ft, qf, fc)
        out["fine"] = {
            "class_names": list(queries.fine_class_names),
            "memory": knn_evaluate(q, fq, bank["embeddings"], bank["fine_labels"], fc, sigma, ks),
            "recompute": knn_evaluate(q, fq, t, ft, fc, sigma, ks),
            "linear_probe_top1": 100.0 * (pred == fq).float().mean().item(),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = documented_parser("python -m training.evaluate", __doc__)
    ap.add_argument("runs", type=Path, nargs="+", help="run dirs")
    ap.add_argument("--split", choices=("val", "test"), default="val")
    ap.add_argument("--ks", default="1,30", help="k values of the kNN vote (a sweep: 1,5,10,...)")
    ap.add_argument("--pca-dim", type=positive_int, default=128)
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args(argv)
    results = []
    try:
        ks = tuple(int(k) for k in a.ks.split(","))
        if any(k < 1 for k in ks):
            raise SNCAError(f"--ks must be positive integers, got {a.ks!r}")
        for run in a.runs:
            t0 = time.perf_counter()
            r = closed_set(run, a.split, ks, a.pca_dim)
            r["seconds"] = round(time.perf_counter() - t0, 1)
            results.append(r)
            k = max(ks)
            line = (
                f"{run} ({a.split}, {r['queries']} queries): kNN top-1 @k={k} "
                f"memory {r['memory'][f'knn_top1@{k}']:.2f}, "
                f"re-embedded {r['recompute'][f'knn_top1@{k}']:.2f}, "
                f"PCA-{r['pca_dim']} features {r['pca_features'][f'knn_top1@{k}']:.2f}"
            )
            if "parametric_top1" in r:
                line += f", parametric {r['parametric_top1']:.2f}"
            if "fine" in r:
                fine = r["fine"]
                line += (
                    f"; fine labels: kNN memory {fine['memory'][f'knn_top1@{k}']:.2f}, "
                    f"re-embedded {fine['recompute'][f'knn_top1@{k}']:.2f}, "
                    f"linear probe {fine['linear_probe_top1']:.2f}"
                )
            print(line, flush=True)
    except (SNCAError, ValueError, OSError) as e:
        print(f"evaluate: error: {e}", file=sys.stderr)
        return 2
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
