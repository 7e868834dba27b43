"""Evaluation protocol building blocks (the evaluation issue), kept free of I/O so that each is
tested on synthetic embeddings with known answers:

- `mean_ci95`: mean and 95% confidence half-width over repetitions (episodes, draws).
- `sample_episodes` / `episode_accuracy`: N-way K-shot episodes (paper Table 6): support and
  queries drawn from disjoint items of N held-out classes, queries classified by the weighted
  kNN vote over the episode's support (k = K, as the paper: k = 1 for 1-shot, 5 for 5-shot).
- `pca_fit` / `pca_project`: the paper's "+PCA" baseline row (Table 2): penultimate features
  reduced to d dimensions, then L2-normalised for cosine kNN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from embedding.knn import weighted_knn_vote


def mean_ci95(values) -> tuple[float, float]:
    """(mean, 1.96 · s / sqrt(n)) with s the sample standard deviation; half-width 0 for n < 2."""
    a = np.asarray(values, dtype=np.float64).ravel()
    if a.size == 0:
        raise ValueError("mean_ci95 of no values")
    if a.size < 2:
        return float(a.mean()), 0.0
    return float(a.mean()), 1.96 * float(a.std(ddof=1)) / math.sqrt(a.size)


def novel_base_hm(draws) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Generalized few-shot scores: `draws` [(novel top-1, base top-1)] a draw -> arrays (n,) of
    novel, base and their harmonic mean 2nb / (n + b) (0 where both are 0)."""
    a = np.asarray(draws, dtype=np.float64).reshape(-1, 2)
    n, b = a[:, 0], a[:, 1]
    return n, b, np.where(n + b > 0, 2 * n * b / np.maximum(n + b, 1e-12), 0.0)


@dataclass(frozen=True)
class Episode:
    support: np.ndarray  # (N*K,) item positions
    support_y: np.ndarray  # (N*K,) episode-local labels 0..N-1
    query: np.ndarray  # (N*Q,) item positions, disjoint from support
    query_y: np.ndarray  # (N*Q,)


def sample_episodes(
    labels: np.ndarray,
    classes,
    n_way: int,
    k_shot: int,
    n_query: int,
    n_episodes: int,
    seed: int = 0,
):
    """Yield `n_episodes` Episodes over items whose label is in `classes`.

    Each episode draws `n_way` distinct classes, then for each class k_shot + n_query distinct
    items: the first k_shot are support, the rest queries (never an item in both). Labels are
    renumbered 0..N-1 in the order the classes were drawn. Deterministic for a seed."""
    labels = np.asarray(labels)
    classes = sorted(int(c) for c in set(classes))
    if n_way < 1 or k_shot < 1 or n_query < 1 or n_episodes < 1:
        raise ValueError("n_way, k_shot, n_query and n_episodes must be positive")
    if len(classes) < n_way:
        raise ValueError(f"{n_way}-way episodes need {n_way} classes, got {len(classes)}")
    pools = {c: np.nonzero(labels == c)[0] for c in classes}
    short = [c for c, p in pools.items() if len(p) < k_shot + n_query]
    if short:
        raise ValueError(
            f"classes {short} have fewer than k_shot + n_query = {k_shot + n_query} items"
        )
    rng = np.random.default_rng(seed)
    for _ in range(n_episodes):
        chosen = rng.choice(classes, size=n_way, replace=False)
        sup, sup_y, qry, qry_y = [], [], [], []
        for local, c in enumerate(chosen):
            pick = rng.choice(pools[int(c)], size=k_shot + n_query, replace=False)
            sup.append(pick[:k_shot])
            qry.append(pick[k_shot:])
            sup_y.append(np.full(k_shot, local))
            qry_y.append(np.full(n_query, local))
        yield Episode(
            np.concatenate(sup), np.concatenate(sup_y), np.concatenate(qry), np.concatenate(qry_y)
        )


@torch.no_grad()
def episode_accuracy(
    embeddings: torch.Tensor, episodes, temperature: float, k: int | None = None
) -> np.ndarray:
    """Top-1 accuracy (0..1) of each episode: every query votes over the episode's support
    with the paper's weighted kNN (k = K, the shots per class, unless given).

    embeddings (M, d) unit rows indexed by the episodes' item positions."""
    accs = []
    for ep in episodes:
        sup = embeddings[torch.as_tensor(ep.support)]  # (N*K, d)
        qry = embeddings[torch.as_tensor(ep.query)]  # (N*Q, d)
        n_way = int(ep.support_y.max()) + 1
        kk = min(k or len(ep.support) // n_way, len(ep.support))
        sims = qry @ sup.T  # (N*Q, N*K)
        top = sims.topk(kk, dim=1)
        lab = torch.as_tensor(ep.support_y)[top.indices]  # (N*Q, kk)
        pred = weighted_knn_vote(top.values, lab, n_way, temperature).argmax(dim=1)
        accs.append(float((pred.numpy() == ep.query_y).mean()))
    return np.array(accs)


def pca_fit(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) -> (mean (D,), components (dim, D)) of the top `dim` principal directions."""
    if not 1 <= dim <= min(x.shape):
        raise ValueError(f"PCA to {dim} dimensions needs 1 <= dim <= min{tuple(x.shape)}")
    x = x.double()
    mean = x.mean(dim=0)
    # Right singular vectors of the centred data = eigenvectors of its covariance, ordered.
    _, _, vh = torch.linalg.svd(x - mean, full_matrices=False)
    return mean.float(), vh[:dim].float()


def pca_project(x: torch.Tensor, mean: torch.Tensor, components: torch.Tensor) -> torch.Tensor:
    """(N, D) -> (N, dim) projections, L2-normalised (cosine kNN, like the learned embedding)."""
    return torch.nn.functional.normalize((x.float() - mean) @ components.T, dim=1)


def linear_probe(
    train_x: torch.Tensor,
    train_y: torch.Tensor,
    test_x: torch.Tensor,
    num_classes: int,
    weight_decay: float = 1e-4,
    max_iter: int = 200,
) -> torch.Tensor:
    """Multinomial logistic regression on frozen features (the paper's linear-classifier row of
    Table 5), full-batch L-BFGS on standardised features. Returns test predictions (M,).

    train_x (N, D), train_y (N,) in [0, num_classes), test_x (M, D)."""
    if train_x.shape[0] != train_y.shape[0] or train_x.shape[0] == 0:
        raise ValueError("linear probe needs matching, non-empty features and labels")
    mean, std = train_x.mean(0), train_x.std(0).clamp_min(1e-6)
    x = ((train_x - mean) / std).double()
    y = train_y.long()
    w = torch.zeros(x.shape[1], num_classes, dtype=torch.float64, requires_grad=True)
    b = torch.zeros(num_classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(x @ w + b, y) + weight_decay * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    with torch.no_grad():
        return (((test_x - mean) / std).double() @ w + b).argmax(1)
