"""Queued queries grouped by similarity (issue 43): fifty photos of one new object should be one
decision for a person, not fifty (GET /review).

Groups are average-linkage clusters cut at `link`: two groups join while the mean similarity of
their members across them is at least `link`, halfway between how alike two items of one
gallery label are and how alike two of different labels are (`link_similarity`, from the
gallery's label statistics). Average linkage does
not chain: a run of in-between queries cannot glue two objects together (single linkage over a
threshold, and components of a mutual-nearest-neighbour graph, did: one group of 134 queries,
half pullovers and half shirts, on the base-7 model; docs/RESULTS.md). Computed by the
nearest-neighbour chain (O(n²) time over an (n, n) similarity matrix, n <= MAX_QUERIES). Each
group shows a diverse sample (farthest-point order from its medoid: Label Studio #5063 asks for
diversity, not the near-duplicates uncertainty sampling returns)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SAMPLE = 6  # queries shown per group
MAX_QUERIES = 2000  # queries grouped per listing (the newest): (n, n) similarities, bounded


@dataclass
class Group:
    members: np.ndarray  # (m,) indices into the rows grouped, medoid first
    sample: np.ndarray  # (<= SAMPLE,) indices: the medoid, then the farthest from those shown
    cohesion: float  # mean similarity of the members to the medoid


def link_similarity(stats) -> float | None:
    """The mean similarity two groups need to join: halfway between how alike two items of
    one gallery label are on average and how alike two items of two different labels are
    (medians over labels and over pairs of labels; exact from each label's count n and
    embedding sum S: within (|S|² - n) / (n (n - 1)), between S_a·S_b / (n_a n_b), unit rows).
    Unlike a nearest-neighbour similarity it does not grow with the gallery's size, so it
    carries over to a queue of a few dozen queries. None when no label has two items; the
    within-label mean alone when there is one label."""
    keep = [c for c in range(len(stats.names)) if stats.counts[c] >= 2]
    if not keep:
        return None
    n = stats.counts[keep].astype(np.float64)
    sums = stats.sums[keep]
    gram = sums @ sums.T  # (L, L)
    within = (np.diag(gram) - n) / (n * (n - 1))
    if len(keep) < 2:
        return float(within[0])
    between = (gram / np.outer(n, n))[np.triu_indices(len(keep), 1)]
    return float((np.median(within) + np.median(between)) / 2)


def group(emb: np.ndarray, link: float, sample: int = SAMPLE) -> list[Group]:
    """emb (n, d) unit rows -> groups, largest first (ties: the most cohesive first)."""
    n = len(emb)
    if n == 0:
        return []
    x = np.ascontiguousarray(emb, dtype=np.float32)
    sims = (x @ x.T).astype(np.float64)  # (n, n)
    out = []
    for members in _average_linkage(sims.copy(), link):
        sub = sims[np.ix_(members, members)]
        medoid = int(np.argmax(sub.sum(axis=1)))
        order = np.concatenate([[medoid], np.delete(np.arange(len(members)), medoid)])
        members, sub = members[order], sub[np.ix_(order, order)]
        out.append(Group(members, members[_spread(sub, sample)], float(sub[0].mean())))
    out.sort(key=lambda g: (-len(g.members), -g.cohesion))
    return out


def _average_linkage(s: np.ndarray, link: float) -> list[np.ndarray]:
    """Clusters of average linkage over similarities `s` (n, n; overwritten), cut where the
    mean similarity between two clusters falls below `link`, by the nearest-neighbour chain:
    follow each cluster's most similar one until two are each other's; merge them if at
    least `link` apart, else neither ever merges again (average linkage is reducible: a merge
    never brings a cluster closer to a third than its nearer part was)."""
    n = len(s)
    np.fill_diagonal(s, -np.inf)
    size = np.ones(n)
    alive = np.ones(n, dtype=bool)  # clusters that may still merge
    members = [[i] for i in range(n)]
    done: list[list[int]] = []
    chain: list[int] = []
    while alive.sum() > 1:
        if not chain:
            chain = [int(np.argmax(alive))]
        a = chain[-1]
        row = np.where(alive, s[a], -np.inf)
        b = int(np.argmax(row))
        if len(chain) > 1 and row[chain[-2]] >= row[b]:
            b = chain[-2]
        if len(chain) < 2 or b != chain[-2]:
            chain.append(b)
            continue
        chain = chain[:-2]  # a and b: each other's nearest
        if row[b] < link:  # neither joins anything at `link` any more
            for c in (a, b):
                alive[c] = False
                done.append(members[c])
            continue
        s[a] = (size[a] * s[a] + size[b] * s[b]) / (size[a] + size[b])
        s[:, a] = s[a]
        s[a, a] = -np.inf
        size[a] += size[b]
        members[a] += members[b]
        alive[b] = False
        s[b] = s[:, b] = -np.inf
    done += [members[c] for c in np.nonzero(alive)[0]]
    return [np.array(sorted(m), dtype=np.int64) for m in done]


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
