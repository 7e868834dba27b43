"""Propagation (issue 43): for a label, the gallery items of other labels and the queued queries
a vote would most likely give to it, ranked, each with its score and its reason (the label's
item it sits nearest) — "I assigned 5 photos, how does it find the other 95?".

Candidates: the index's nearest items of each of the label's items (a sample of at most
`SEARCHED_ITEMS` of them), and every queued query handed in. Each is voted on at gallery scale
(embedding.votes: the index's top-K' candidates and the exact label statistics), an item of
the gallery without itself among its candidates (a leave-one-out vote; its label's statistics
still count it, one item among the label's). The score is the label's probability minus the
best other label's: above 0 the vote gives the candidate to the label, and an item filed
correctly under another label sits well below (ranked by the label's probability alone, the
base classes' items around five new shots filled the top 100: 3 to 13 of 100 were queued
queries of the label, on the base-7 model; docs/RESULTS.md). The rule is the paper's weighted
kNN by default (`vote`): the kde rules' per-label averages favour a label of five items
wherever it is near, which is what this ranking must not reward."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from embedding.votes import Candidates

SEARCHED_ITEMS = 200  # the label's items whose neighbourhoods are searched (a sample beyond)
PER_SOURCE = 64  # nearest items taken from each
MAX_CANDIDATES = 5000  # gallery items voted on at most (the nearest to the label first)


@dataclass
class Suggestion:
    kind: str  # "item" (a gallery item of another label) | "queued" (a queued query)
    id: int
    label: str | None  # its label now (items), the label answered (queued: None when unknown)
    score: float  # the label's probability minus the best other's in the candidate's vote
    near_id: int  # the label's item it sits nearest
    near_similarity: float


def suggest(
    gallery, vote: str, label: str, k: int, limit: int, queued=()
) -> list[Suggestion] | None:
    """Up to `limit` suggestions for `label` by the rule `vote` (None: no live item has the
    label), best first; `queued`: (id, vector, answer) of queued queries to rank too. Under
    the read lock."""
    from service.gallery.gallery import RULES_BY_NAME

    rule = RULES_BY_NAME[vote]
    with gallery.lock.read():
        c = gallery.stats.ids.get(label)
        if c is None or gallery.stats.counts[c] == 0:
            return None
        own = gallery.rows.ids_with(np.array([c]))
        rng = np.random.default_rng(0)
        src = own if len(own) <= SEARCHED_ITEMS else rng.choice(own, SEARCHED_ITEMS, replace=False)
        src_emb = _vectors(gallery, src)
        # the gallery's candidates: the nearest items of the label's items, not of the label
        sims, ids = gallery.vectors.search(src_emb, min(PER_SOURCE + 1, gallery.size()))
        cand = np.unique(ids[ids >= 0])
        cand = cand[gallery.rows.labels_of(cand) != c]
        if len(cand) > MAX_CANDIDATES:  # the nearest to the label first
            best = {}
            for s, i in zip(sims.ravel(), ids.ravel(), strict=True):
                best[int(i)] = max(best.get(int(i), -2.0), float(s))
            cand = np.array(sorted(cand, key=lambda i: -best[int(i)])[:MAX_CANDIDATES])
        item_emb = _vectors(gallery, cand)
        item_lab = gallery.rows.labels_of(cand)
        q_ids = [int(q[0]) for q in queued]
        q_emb = np.stack([q[1] for q in queued]).astype(np.float32) if queued else None
        out = []
        if len(cand):
            p = _margin(_vote(gallery, rule, item_emb, k, exclude=cand), c)
            out += _rank(
                "item", cand, p, item_emb, src, src_emb, [gallery._name(x) for x in item_lab]
            )
        if q_emb is not None:
            p = _margin(_vote(gallery, rule, q_emb, k, exclude=None), c)
            out += _rank("queued", q_ids, p, q_emb, src, src_emb, [q[2] for q in queued])
    out.sort(key=lambda s: (-s.score, -s.near_similarity))
    return out[:limit]


def _vectors(gallery, ids: np.ndarray) -> np.ndarray:
    """(n, d) the vectors of live items: the dense rows, else the index's copy."""
    if len(ids) == 0:
        return np.zeros((0, gallery.dim), np.float32)
    if gallery.rows.dense:
        return np.stack([gallery.rows.vector(int(i)) for i in ids]).astype(np.float32)
    return np.stack([gallery.vectors.vector(int(i)) for i in ids]).astype(np.float32)


def _vote(gallery, rule, q: np.ndarray, k: int, exclude: np.ndarray | None) -> np.ndarray:
    """(Q, C) the rule's probabilities at gallery scale, each query's own id (`exclude[i]`)
    left out of its candidates."""
    counts = gallery.stats.counts
    live = int(counts.sum())
    kk = min(max(rule.candidates_needed(k, gallery.candidates), gallery.candidates) + 1, live)
    sims, ids = gallery.vectors.search(q, kk)
    lab = gallery.rows.labels_of(ids)
    if exclude is not None:  # the candidate itself: at the end, as padding
        self_hit = ids == exclude[:, None]
        order = np.argsort(self_hit, axis=1, kind="stable")
        sims = np.take_along_axis(np.where(self_hit, -1.0, sims), order, axis=1)
        lab = np.take_along_axis(np.where(self_hit, -1, lab), order, axis=1)
    x = Candidates(
        torch.from_numpy(q),
        torch.from_numpy(np.ascontiguousarray(sims[:, : kk - 1 if kk > 1 else kk], np.float32)),
        torch.from_numpy(np.ascontiguousarray(lab[:, : kk - 1 if kk > 1 else kk])),
        torch.from_numpy(gallery.stats.sums),
        torch.from_numpy(counts),
        gallery.temperature,
        k,
    )
    return rule.vote_candidates(x).numpy()


def _margin(probs: np.ndarray, c: int) -> np.ndarray:
    """(Q,) the label's probability minus the best other label's: > 0 where the vote gives
    the candidate to the label (a correctly filed item of another label is well below 0)."""
    others = probs.copy()
    others[:, c] = -np.inf
    return probs[:, c] - others.max(axis=1)


def _rank(kind, ids, p, emb, src, src_emb, labels) -> list[Suggestion]:
    near = emb @ src_emb.T  # (n, S): the reason
    j = near.argmax(axis=1)
    return [
        Suggestion(kind, int(i), lab, float(s), int(src[jj]), float(near[n, jj]))
        for n, (i, s, jj, lab) in enumerate(zip(ids, p, j, labels, strict=True))
    ]
