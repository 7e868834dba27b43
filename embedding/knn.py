"""The weighted kNN classifier of the paper (reference `kNN()`; DINO `knn_classifier`).

One implementation, used by training evaluation and by the service alike:
top-K gallery items by cosine similarity s_j, score_c = Σ_{j∈topK, y_j=c} exp(s_j / σ),
prediction = argmax_c score_c, probabilities = scores / Σ scores.
"""

from __future__ import annotations

import torch


def weighted_knn_vote(
    similarities,
    neighbor_labels,
    num_classes: int,
    temperature: float,
    k: int | None = None,
) -> torch.Tensor:
    """Class probabilities from the K nearest neighbours of each query.

    similarities: (Q, K) float cosine similarities, sorted descending when `k` < K is given.
    neighbor_labels: (Q, K) int label ids in [0, num_classes); a negative id marks padding
        (FAISS returns -1 when the gallery has fewer than K items) and gets no vote.
    Returns (Q, num_classes) float32 probabilities; a row with no valid neighbour is all zero.
    """
    s = torch.as_tensor(similarities, dtype=torch.float32)
    y = torch.as_tensor(neighbor_labels, dtype=torch.int64)
    if s.shape != y.shape or s.ndim != 2:
        raise ValueError(
            f"similarities {tuple(s.shape)} and labels {tuple(y.shape)} must be (Q, K)"
        )
    if k is not None:
        s, y = s[:, :k], y[:, :k]
    if s.shape[1] == 0:  # no neighbour at all (an empty gallery): no label takes the query
        return torch.zeros(s.shape[0], num_classes, dtype=torch.float32, device=s.device)
    valid = y >= 0
    # exp(s/σ) with a max shift: the shift cancels in scores / Σ scores.
    s = s.masked_fill(~valid, float("-inf"))
    shift = s.amax(dim=1, keepdim=True).clamp_min(-1e30)  # (Q, 1); finite even for empty rows
    w = torch.exp((s - shift) / temperature)  # (Q, K); padding -> exp(-inf) = 0
    scores = torch.zeros(s.shape[0], num_classes, dtype=torch.float32, device=s.device)
    scores.scatter_add_(1, y.clamp_min(0), w)  # (Q, C): Σ_{y_j=c} exp(s_j/σ)
    total = scores.sum(dim=1, keepdim=True)
    return torch.where(total > 0, scores / total.clamp_min(1e-38), scores)


@torch.no_grad()
def knn_search(
    queries: torch.Tensor, gallery: torch.Tensor, k: int, chunk_size: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k by inner product (cosine on unit vectors), chunked over queries.

    queries (Q, d), gallery (N, d) -> similarities (Q, k) descending, indices (Q, k) int64.
    """
    k = min(k, gallery.shape[0])
    sims, idx = [], []
    for start in range(0, queries.shape[0], chunk_size):
        s = queries[start : start + chunk_size] @ gallery.T  # (q, N)
        top = s.topk(k, dim=1)
        sims.append(top.values)
        idx.append(top.indices)
    return torch.cat(sims), torch.cat(idx)


@torch.no_grad()
def knn_evaluate(
    queries: torch.Tensor,
    query_labels: torch.Tensor,
    gallery: torch.Tensor,
    gallery_labels: torch.Tensor,
    num_classes: int,
    temperature: float,
    ks: tuple[int, ...] = (1, 30),
    exclude_self: bool = False,
) -> dict[str, float]:
    """Top-1 / top-5 accuracy (in %) of the weighted kNN vote for each k in `ks`.

    exclude_self: queries are the gallery itself (leave-one-out): drop each query's own item.
    Returns {"knn_top1@k": .., "knn_top5@k": ..} for every k.
    """
    kmax = max(ks) + (1 if exclude_self else 0)
    sims, idx = knn_search(queries, gallery, kmax)
    if exclude_self:
        own = idx == torch.arange(queries.shape[0], device=idx.device)[:, None]
        # push the self hit to the end, then drop the last column
        sims = sims.masked_fill(own, float("-inf"))
        order = sims.argsort(dim=1, descending=True)
        sims, idx = sims.gather(1, order)[:, :-1], idx.gather(1, order)[:, :-1]
    labels = gallery_labels[idx]  # (Q, kmax)
    out: dict[str, float] = {}
    for k in ks:
        probs = weighted_knn_vote(sims, labels, num_classes, temperature, k=k)
        top = probs.topk(min(5, num_classes), dim=1).indices
        hit = top == query_labels[:, None]
        out[f"knn_top1@{k}"] = 100.0 * hit[:, 0].float().mean().item()
        out[f"knn_top5@{k}"] = 100.0 * hit.any(dim=1).float().mean().item()
    return out
