"""What a registration did to the gallery: how the label's images agree with each other, how
tight the label is against the gallery's other labels, which existing label it is nearest to
and whether the vote will confuse them, and which images look mislabelled.

Leave-one-out votes: each image is classified by the gallery's vote with itself taken out (the
index's top-K' candidates minus the image, its label's count and embedding sum minus it: the
candidate vote, embedding/votes), so a label of one image asks "what did the gallery call this
image before?" and an image of a label that sits with another label is found by its own vote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from embedding import collapse, openset
from embedding.votes import Candidates, VoteRule


@dataclass
class Outlier:
    id: int
    sits_with: str  # the label its leave-one-out vote chose
    probability: float


@dataclass
class Diagnostics:
    label: str
    count: int  # live items of the label
    checked: int  # images whose leave-one-out vote was taken
    agreement: float | None  # share of them whose leave-one-out vote is the label
    cohesion: float | None  # mean cosine between two of the label's items (n >= 2)
    gallery_cohesion: float | None  # the median of that over the gallery's labels of >= 20 items
    nearest_label: str | None  # the other label whose mean is nearest the label's mean
    nearest_similarity: float | None  # cosine between the two label means
    confused_with: dict[str, float] = field(default_factory=dict)  # label -> share of votes
    outliers: list[Outlier] = field(default_factory=list)
    outside_world: float | None = None  # share of the added images outside the training world
    warnings: list[str] = field(default_factory=list)


def cohesion(sums: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(C,) mean pairwise cosine of each label's unit rows from its sum S and count n:
    (|S|^2 - n) / (n (n - 1)); NaN where n < 2."""
    n = counts.astype(np.float64)
    sq = (sums.astype(np.float64) ** 2).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (sq - n) / (n * (n - 1))
    return np.where(n >= 2, out, np.nan)


def leave_one_out_votes(
    rule: VoteRule,
    emb: np.ndarray,
    own: np.ndarray,
    own_label: int,
    search,
    sums: np.ndarray,
    counts: np.ndarray,
    temperature: float,
    k: int,
    candidates: int,
    unknown_k: int,
) -> tuple[torch.Tensor, np.ndarray]:
    """(m, C) the vote's probabilities for each row of emb (m, d), item `own[i]` of label
    `own_label` taken out of the gallery (own[i] = -1: a row not in the gallery), and (m,)
    the open-set score of each row's top label (embedding.openset). `search(q, kk)` -> the
    index's (sims, ids, label ids) (m, kk) each."""
    n_live = int(counts.sum())
    kk = min(max(rule.candidates_needed(k, candidates), k, unknown_k) + 1, n_live)
    sims, ids, lab = search(emb, kk)  # (m, kk)
    out, scores = [], []
    for i in range(len(emb)):
        # a neighbour of a label made after the tables were read (other writers add while
        # this searches) is not in the gallery they describe: left out (it was a 500)
        keep = (ids[i] != own[i]) & (lab[i] < len(counts))
        s, lb = sims[i][keep][: kk - 1], lab[i][keep][: kk - 1]
        cnt, sm = counts.copy(), sums.copy()
        if own[i] >= 0:
            cnt[own_label] -= 1
            sm[own_label] -= emb[i].astype(np.float64)
        x = Candidates(
            torch.from_numpy(emb[i : i + 1].astype(np.float32)),
            torch.from_numpy(s[None, :].astype(np.float32)),
            torch.from_numpy(lb[None, :].astype(np.int64)),
            torch.from_numpy(sm),
            torch.from_numpy(cnt),
            temperature,
            k,
        )
        p = rule.vote_candidates(x)  # (1, C)
        out.append(p)
        top = p.argmax(dim=1)
        kc = torch.as_tensor(cnt, dtype=torch.long)[top].clamp(min=1, max=unknown_k)
        scores.append(float(openset.label_kth(x.similarities, x.labels, top, kc)[0]))
    probs = torch.cat(out) if out else torch.zeros(0, len(counts))
    return probs, np.array(scores)


def diagnose(
    name: str,
    c: int,
    emb: np.ndarray,
    own: np.ndarray,
    rule: VoteRule,
    names: list[str],
    sums: np.ndarray,
    counts: np.ndarray,
    search,
    temperature: float,
    k: int,
    candidates: int,
    unknown_k: int,
    thresholds: np.ndarray,
) -> Diagnostics:
    """Diagnostics of label `name` (id c) from some of its items: emb (m, d), their ids `own`;
    `thresholds` (C,) the open-set thresholds: an image whose leave-one-out vote chose another
    label but is unknown there is new, not mislabelled."""
    n = int(counts[c]) if c < len(counts) else 0
    coh = cohesion(sums, counts)
    big = coh[(counts >= openset.MIN_OWN) & ~np.isnan(coh)]
    others = np.nonzero((counts > 0) & (np.arange(len(counts)) != c))[0]
    d = Diagnostics(
        name,
        n,
        len(emb),
        None,
        None if np.isnan(coh[c]) else float(coh[c]),
        float(np.median(big)) if len(big) else None,
        None,
        None,
    )
    if len(others):
        means = sums[others] / np.linalg.norm(sums[others], axis=1, keepdims=True).clip(1e-12)
        mine = sums[c] / max(np.linalg.norm(sums[c]), 1e-12)
        cos = means @ mine
        j = int(np.argmax(cos))
        d.nearest_label, d.nearest_similarity = names[others[j]], float(cos[j])
    if len(emb) == 0 or n == 0:
        return d
    probs, scores = leave_one_out_votes(
        rule, emb, own, c, search, sums, counts, temperature, k, candidates, unknown_k
    )  # (m, C), (m,)
    if probs.shape[1] == 0 or float(probs.sum()) == 0.0:
        return d
    top_p, top_c = probs.max(dim=1)
    agree = top_c == c
    d.agreement = float(agree.float().mean()) if n > 1 else None  # one image: no other
    votes: dict[str, int] = {}
    for i in range(len(emb)):
        oc = int(top_c[i])
        if not bool(agree[i]) and scores[i] >= thresholds[oc]:  # sits with a known label
            other = names[oc]
            votes[other] = votes.get(other, 0) + 1
            d.outliers.append(Outlier(int(own[i]), other, float(top_p[i])))
    d.confused_with = {lab: v / len(emb) for lab, v in sorted(votes.items(), key=lambda x: -x[1])}
    _warn(d, n, _labels_alike(sums, others))
    return d


def world_warning(d: Diagnostics, outside: np.ndarray) -> None:
    """`outside` (m,) bool: which of the images just added are outside the training world."""
    if not len(outside):
        return
    d.outside_world = float(outside.mean())
    if outside.any():
        d.warnings.append(
            f"{int(outside.sum())} of {len(outside)} images are not like the images the model "
            "was trained on: the label is recognised by its own images (a query must look like "
            "one of them), and the embedding separates such images less well than its own "
            "kind; register several varied images of it"
        )


def _labels_alike(sums: np.ndarray, labels: np.ndarray) -> float | None:
    """Median cosine between the means of `labels` (rows of `sums`); None under two labels."""
    if len(labels) < 2:
        return None
    m = sums[labels] / np.linalg.norm(sums[labels], axis=1, keepdims=True).clip(1e-12)
    cos = m @ m.T
    return float(np.median(cos[np.triu_indices(len(labels), 1)]))


def _warn(d: Diagnostics, n: int, labels_alike: float | None = None) -> None:
    """Plain-language warnings from the numbers (what a user should look at). `labels_alike`:
    the median cosine between the other labels' means (None: fewer than two other labels)."""
    # the label's images and its nearest other label's all one direction: a collapsed model
    # when the other labels are alike too (or there are too few to tell), else two labels of
    # near-identical images (crops of one photo under two names) on a model that is fine
    alike = min(d.cohesion or 0.0, d.nearest_similarity or 0.0) if n > 1 else None
    if labels_alike is not None and labels_alike < collapse.COLLAPSED:
        if alike is not None and alike >= collapse.COLLAPSED:
            d.warnings.append(
                f"this label's images and {d.nearest_label!r}'s are nearly identical (cosine "
                f"{d.nearest_similarity:.3f}): the vote cannot tell the two labels apart; "
                f"register images that differ from {d.nearest_label!r}'s, or merge the two"
            )
    elif (said := collapse.warning(alike, "this label's images and its neighbours'")) is not None:
        d.warnings.append(said)
    if n == 1 and not d.outliers:
        d.warnings.append(
            "one image: the label takes only images very like it, and nothing says how much "
            "its kind varies; register about five varied images of it"
        )
    if n == 1 and d.outliers:
        o = d.outliers[0]
        d.warnings.append(
            f"the gallery already classifies this image as {o.sits_with!r} "
            f"({100 * o.probability:.0f}%): the new label will compete with {o.sits_with!r} for "
            "images like it; register more images, or add it to that label"
        )
        return
    for lab, share in d.confused_with.items():
        if share >= 0.5:
            d.warnings.append(
                f"overlaps {lab!r}: {100 * share:.0f}% of the images checked are classified as "
                f"{lab!r} without themselves; the vote will confuse the two labels"
            )
    if (
        d.cohesion is not None
        and d.nearest_similarity is not None
        and d.nearest_similarity >= d.cohesion
    ):
        d.warnings.append(
            f"the label's images are no closer to each other (mean cosine {d.cohesion:.2f}) than "
            f"its mean is to {d.nearest_label!r}'s ({d.nearest_similarity:.2f})"
        )
    if d.outliers and len(d.outliers) < d.checked / 2:
        d.warnings.append(
            "suspected mislabelled image(s): "
            + ", ".join(f"#{o.id} sits with {o.sits_with!r}" for o in d.outliers[:10])
        )
