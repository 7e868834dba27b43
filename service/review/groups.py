"""Queued queries grouped by similarity (issue 43): fifty photos of one new object should be one
decision for a person, not fifty (GET /review).

A group is a connected component of the queries' mutual k-nearest-neighbour graph, keeping only
edges at least as similar as `link`: two queries join when each is among the other's k nearest
and they are as alike as two items of one label of the gallery are on average
(`link_similarity`, from the gallery's label statistics). Mutual neighbours
keep a chain of in-between queries from gluing two objects together (single linkage over a
plain threshold does); the similarity floor keeps a lone query alone. Each group shows a
diverse sample (farthest-point order from its medoid: Label Studio #5063 asks for diversity,
not the near-duplicates uncertainty sampling returns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

K = 5  # mutual neighbours a query links to (a group of fewer than K + 1 still links)
SAMPLE = 6  # queries shown per group
MAX_QUERIES = 2000  # queries grouped per listing (the newest): (n, n) similarities, bounded


@dataclass
class Group:
    members: np.ndarray  # (m,) indices into the rows grouped, medoid first
    sample: np.ndarray  # (<= SAMPLE,) indices: the medoid, then the farthest from those shown
    cohesion: float  # mean similarity of the members to the medoid


def link_similarity(stats) -> float | None:
    """The similarity two queries need to link: how alike two items of one label of the
    gallery are, on average (the median over labels of the mean similarity of a label's pairs,
    exact from its count n and embedding sum S: (|S|² - n) / (n (n - 1)) for unit rows). Unlike
    a nearest-neighbour similarity it does not grow with the gallery's size, so it carries
    over to a queue of a few dozen queries. None when no label has two items."""
    means = []
    for c in range(len(stats.names)):
        n = float(stats.counts[c])
        if n >= 2:
            v = stats.sums[c]
            means.append((float(v @ v) - n) / (n * (n - 1)))
    return float(np.median(means)) if means else None


def group(emb: np.ndarray, link: float, k: int = K, sample: int = SAMPLE) -> list[Group]:
    """emb (n, d) unit rows -> groups, largest first (ties: the most cohesive first)."""
    n = len(emb)
    if n == 0:
        return []
    x = np.ascontiguousarray(emb, dtype=np.float32)
    sims = x @ x.T  # (n, n)
    np.fill_diagonal(sims, -np.inf)
    kk = min(k, n - 1)
    near = np.zeros((n, n), dtype=bool)
    if kk > 0:
        top = np.argpartition(-sims, kk - 1, axis=1)[:, :kk]  # (n, kk) each row's k nearest
        near[np.repeat(np.arange(n), kk), top.ravel()] = True
    edges = near & near.T & (sims >= link)
    comp = _components(edges)
    np.fill_diagonal(sims, 1.0)
    out = []
    for c in np.unique(comp):
        members = np.nonzero(comp == c)[0]
        sub = sims[np.ix_(members, members)]
        medoid = int(np.argmax(sub.sum(axis=1)))
        order = np.concatenate([[medoid], np.delete(np.arange(len(members)), medoid)])
        members, sub = members[order], sub[np.ix_(order, order)]
        out.append(Group(members, members[_spread(sub, sample)], float(sub[0].mean())))
    out.sort(key=lambda g: (-len(g.members), -g.cohesion))
    return out


def _components(edges: np.ndarray) -> np.ndarray:
    """(n,) component id of each node of the symmetric boolean adjacency `edges`."""
    n = len(edges)
    comp = np.full(n, -1)
    for s in range(n):
        if comp[s] >= 0:
            continue
        comp[s] = s
        todo = [s]
        while todo:
            i = todo.pop()
            for j in np.nonzero(edges[i] & (comp < 0))[0]:
                comp[j] = s
                todo.append(int(j))
    return comp


def _spread(sims: np.ndarray, m: int) -> np.ndarray:
    """Farthest-point order of the first `m` of a group (sims (g, g), row 0 the medoid): each
    next member the one least similar to those already chosen."""
    chosen = [0]
    closest = sims[0].copy()  # each member's similarity to the nearest chosen one
    while len(chosen) < min(m, len(sims)):
        closest[chosen] = np.inf
        nxt = int(np.argmin(closest))
        chosen.append(nxt)
        closest = np.maximum(closest, sims[nxt])
    return np.array(chosen, dtype=np.int64)
